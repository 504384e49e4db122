"""tierckpt.hf: the transformers Trainer callback saves asynchronously and a restarted Trainer resumes exactly."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import threading

import pytest
import torch

from tests._support.lazy import requires, subclass
from tests.integrations._hf_names import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, tierhf
from tierckpt import CheckpointManager, faults

pytestmark = requires("transformers")

MAX_STEPS = 8


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 101, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def recorder(stop_at: int | None = None):
    return subclass(Recorder, "transformers", "TrainerCallback")(stop_at)


class Recorder:
    """A TrainerCallback: per-step losses from the logs; optionally stops training after ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.losses: dict[int, float] = {}
        self.stop_at = stop_at

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True


def make_model(seed: int = 0):
    torch.manual_seed(seed)  # dropout stays on (0.1): the RNG states must be restored for equal losses
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32))


def make_trainer(tmp_path, model, callbacks, n_samples: int = 64, **overrides):
    kw = dict(output_dir=str(tmp_path / "hf_out"), max_steps=MAX_STEPS, per_device_train_batch_size=4,
              save_strategy="no", report_to=[], logging_steps=1, seed=0, use_cpu=True,
              dataloader_num_workers=0, disable_tqdm=True, learning_rate=1e-3, warmup_steps=2)
    kw.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**kw), train_dataset=TokenDataset(n_samples),
                   callbacks=callbacks)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_REFERENCES: dict[int, tuple] = {}


def uninterrupted(tmp_path_factory, n_samples: int = 64, accumulation: int = 1):
    """An uninterrupted 8-step run without any checkpointing (one per variant, shared by the tests)."""
    key = (n_samples, accumulation)
    if key not in _REFERENCES:
        model = make_model()
        rec = recorder()
        make_trainer(tmp_path_factory.mktemp("ref"), model, [rec], n_samples=n_samples,
                     gradient_accumulation_steps=accumulation).train()
        assert sorted(rec.losses) == list(range(1, MAX_STEPS + 1))
        _REFERENCES[key] = (rec.losses, weights(model))
    return _REFERENCES[key]


@pytest.fixture
def reference(tmp_path_factory):
    return uninterrupted(tmp_path_factory)


def interrupted_run(tmp_path, stop_at: int, n_samples: int = 64, accumulation: int = 1,
                    **cb_options) -> tierhf.TieredCheckpointCallback:
    cb = tierhf.TieredCheckpointCallback(tmp_path / "local", save_steps=2, **cb_options)
    trainer = make_trainer(tmp_path, make_model(), [cb, recorder(stop_at=stop_at)], n_samples=n_samples,
                           gradient_accumulation_steps=accumulation)
    assert tierhf.train(trainer) is not None
    assert cb.resumed_step is None  # nothing to resume from: a fresh start
    return cb


def resumed_run(tmp_path, n_samples: int = 64, accumulation: int = 1, **cb_options):
    cb = tierhf.TieredCheckpointCallback(tmp_path / "local", save_steps=2, **cb_options)
    model = make_model(seed=99)  # other initial weights: equal results need the restored ones
    rec = recorder()
    tierhf.train(make_trainer(tmp_path, model, [cb, rec], n_samples=n_samples,
                              gradient_accumulation_steps=accumulation))
    return cb, rec, model


def assert_matches(reference, rec, model, first_step: int) -> None:
    ref_losses, ref_weights = reference
    assert sorted(rec.losses) == list(range(first_step, MAX_STEPS + 1))
    for step in range(first_step, MAX_STEPS + 1):
        assert rec.losses[step] == pytest.approx(ref_losses[step], rel=1e-6, abs=1e-7), step
    got = weights(model)
    assert got.keys() == ref_weights.keys()
    for k, v in ref_weights.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize(("n_samples", "accumulation"), [(64, 1), (16, 1), (64, 2)],
                         ids=["mid-epoch", "epoch-boundary", "grad-accumulation"])
def test_resume_matches_uninterrupted_run(tmp_path, tmp_path_factory, n_samples, accumulation):
    """64 samples: step 4 is inside epoch 0 (HF skips 4 batches, 8 with 2 accumulation steps); 16: step 4 ends
    epoch 0 (4 batches per epoch)."""
    reference = uninterrupted(tmp_path_factory, n_samples, accumulation)
    interrupted_run(tmp_path, stop_at=4, n_samples=n_samples, accumulation=accumulation)
    with CheckpointManager(tmp_path / "local") as mgr:
        assert [s.step for s in mgr.steps()] == [2, 4]
        meta = mgr.load(4, keys=["trainer_state"])
    saved = json.loads(meta.state["trainer_state"])
    assert saved["global_step"] == 4
    assert saved["log_history"][-1]["step"] == 4  # taken after step 4's log, where HF takes checkpoint-4
    cb, rec, model = resumed_run(tmp_path, n_samples=n_samples, accumulation=accumulation)
    assert (cb.resumed_step, cb.resumed_tier) == (4, "local")
    assert_matches(reference, rec, model, first_step=5)
    with CheckpointManager(tmp_path / "local") as mgr:
        assert mgr.latest_step() == MAX_STEPS  # saving went on after the resume


def test_resume_from_remote_after_local_wiped(tmp_path, reference):
    remote = tmp_path / "remote"
    interrupted_run(tmp_path, stop_at=6, remote=str(remote))  # on_train_end closes: every step uploaded
    shutil.rmtree(tmp_path / "local")
    cb, rec, model = resumed_run(tmp_path, remote=str(remote))
    assert (cb.resumed_step, cb.resumed_tier) == (6, "remote")
    assert_matches(reference, rec, model, first_step=7)


def test_corrupt_newest_local_step_falls_back(tmp_path, reference, caplog):
    interrupted_run(tmp_path, stop_at=4)
    data = glob.glob(str(tmp_path / "local" / "step-0000000004" / "*.safetensors"))
    assert data
    with open(data[0], "r+b") as f:  # flip bytes in the middle of the tensor data
        f.seek(os.path.getsize(data[0]) - 64)
        chunk = f.read(8)
        f.seek(-8, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
    with caplog.at_level(logging.WARNING):
        cb, rec, model = resumed_run(tmp_path)
    assert (cb.resumed_step, cb.resumed_tier) == (2, "local")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("tierckpt")]
    assert any("step 4" in m and "corrupt" in m for m in warned), warned
    assert any("resuming from step 2" in m for m in warned), warned
    assert_matches(reference, rec, model, first_step=3)


def test_saves_do_not_wait_for_the_disk(tmp_path, monkeypatch):
    """The local write of step 2 is held at its fsync; training still runs steps 3 and 4 meanwhile."""
    gate = threading.Event()
    real_point = faults.point

    def held(name: str) -> None:
        if name == "before-fsync" and threading.current_thread() is not threading.main_thread():
            gate.wait(20)
        real_point(name)

    monkeypatch.setattr(faults, "point", held)
    seen: list[tuple[int, int, bool]] = []
    cb = tierhf.TieredCheckpointCallback(tmp_path / "local", save_steps=2, staging_buffers=2)

    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            handle = cb.last_handle
            if handle is not None:
                seen.append((state.global_step, handle.step, handle.persisted.done()))
            if state.global_step == 3:
                gate.set()

    try:
        make_trainer(tmp_path, make_model(), [cb, Watch()], max_steps=4).train()
    finally:
        gate.set()
    # step 3 ran while step 2's save was still unwritten
    assert (3, 2, False) in seen, seen
    with CheckpointManager(tmp_path / "local") as mgr:
        assert [s.step for s in mgr.steps()] == [2, 4]


def test_warns_once_when_hf_saves_too(tmp_path):
    cb = tierhf.TieredCheckpointCallback(tmp_path / "local", save_steps=2)
    trainer = make_trainer(tmp_path, make_model(), [cb], max_steps=2, save_strategy="steps", save_steps=100)
    with pytest.warns(UserWarning, match="save_strategy='no'"):
        trainer.train()


def test_accelerate_state_round_trip(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)

    class Counter:  # a custom object registered for checkpointing
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict:
            return {"n": self.n}

        def load_state_dict(self, sd: dict) -> None:
            self.n = sd["n"]

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    def step() -> torch.Tensor:
        loss = model(torch.randn(8, 4)).square().mean()
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n += 1
        return loss.detach()

    step()
    state = tierhf.accelerate_state(accelerator)
    assert {"model_0", "optimizer_0", "scheduler_0", "custom_0", "torch_rng"} <= state.keys()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
        mgr.wait()
        expected = [step() for _ in range(3)]
        final = weights(model)
        assert mgr.restore(state) == 1
        assert counter.n == 1 and sched.scheduler.last_epoch == 1
        got = [step() for _ in range(3)]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for k, v in final.items():
        torch.testing.assert_close(weights(model)[k], v, rtol=0, atol=0)
