"""TieredCheckpointIO: Lightning's checkpoints through tierckpt (docs/lightning.md)."""

from __future__ import annotations

import glob
import json
import logging
import os
import threading

import pytest
import torch

from tests._support.lazy import lazy, requires, subclass

pytestmark = requires("lightning")
L = lazy("lightning.pytorch")
ModelCheckpoint = lazy("lightning.pytorch.callbacks", "ModelCheckpoint")
TieredCheckpointIO = lazy("tierckpt.lightning", "TieredCheckpointIO")

N, K = 6, 3  # steps of the first run, checkpoint interval


class Net:
    """The test's LightningModule (:func:`subclass` adds the base)."""

    def __init__(self, lr: float = 0.01, **extra) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        # the data depends on the global step only: a resumed run sees the batches an uninterrupted one sees
        g = torch.Generator().manual_seed(1000 + self.global_step)
        x = torch.randn(8, 4, generator=g)
        y = x.sum(dim=1, keepdim=True)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(64.0), batch_size=8)


class Opaque:
    pass


def make_model(**hp):
    torch.manual_seed(0)
    return subclass(Net, "lightning.pytorch", "LightningModule")(**hp)


def trainer(max_steps, plugins=(), callbacks=(), enable_checkpointing=True):
    return L.Trainer(max_steps=max_steps, plugins=list(plugins), callbacks=list(callbacks), accelerator="cpu",
                     devices=1, enable_progress_bar=False, logger=False, enable_model_summary=False,
                     enable_checkpointing=enable_checkpointing, num_sanity_val_steps=0)


def ckpt_cb(d, **kw):
    return ModelCheckpoint(dirpath=str(d), every_n_train_steps=K, save_last=True, **kw)


@pytest.fixture(scope="module")
def reference():
    """Weights after an uninterrupted 2N-step run without checkpoints."""
    model = make_model()
    trainer(2 * N, enable_checkpointing=False).fit(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(model, ref):
    sd = model.state_dict()
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k


def first_run(tmp_path, remote=None, steps=N, **cb_kw):
    io = TieredCheckpointIO(tmp_path / "local", remote=remote, keep_local=5)
    cb = ckpt_cb(tmp_path / "ckpts", **cb_kw)
    t = trainer(steps, [io], [cb])
    t.fit(make_model())
    return io, cb, t


def resume(tmp_path, ckpt_path, remote=None):
    io = TieredCheckpointIO(tmp_path / "local", remote=remote, keep_local=5)
    model = make_model()
    trainer(2 * N, [io], [ckpt_cb(tmp_path / "ckpts")]).fit(model, ckpt_path=ckpt_path)
    return io, model


def test_resume_last_bit_exact_and_one_step_per_trigger(tmp_path, reference):
    io, _, _ = first_run(tmp_path)
    steps = sorted(os.listdir(tmp_path / "local"))
    assert [s for s in steps if s.startswith("step-")] == ["step-0000000003", "step-0000000006"]  # 2 saves/trigger
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["epoch=0-step=6.ckpt", "last.ckpt"]  # top-1: the step-3 marker was removed
    for name in names:  # markers, not weights
        assert json.loads((tmp_path / "ckpts" / name).read_text())["tierckpt_step"] == 6
    io2, model = resume(tmp_path, "last")
    assert io2._loaded_step == N
    assert_same(model, reference)


def test_second_save_of_a_step_keeps_its_callback_state(tmp_path):
    io, cb, _ = first_run(tmp_path, steps=K)
    # Lightning set last_model_path before saving last.ckpt: that path must load it, the step's file must not
    last = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    topk = io.load_checkpoint(tmp_path / "ckpts" / "epoch=0-step=3.ckpt")
    io.teardown()
    key = next(k for k in last["callbacks"] if k.startswith("ModelCheckpoint"))
    assert last["callbacks"][key]["last_model_path"] == cb.last_model_path
    assert topk["callbacks"][key]["last_model_path"] != cb.last_model_path
    assert torch.equal(last["state_dict"]["net.0.weight"], topk["state_dict"]["net.0.weight"])


def test_resume_best_and_explicit_path(tmp_path, reference):
    io, cb, t = first_run(tmp_path, save_top_k=-1)
    reported = sorted(glob.glob(str(tmp_path / "ckpts" / "epoch=*.ckpt")))
    assert cb.best_model_path == reported[-1]
    assert [os.path.basename(p) for p in reported] == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]
    # "best" on the same trainer (the manager was closed by teardown and opens again)
    model = make_model()
    t.fit_loop.epoch_loop.max_steps = 2 * N
    t.fit(model, ckpt_path="best")
    assert_same(model, reference)
    # an older reported path, in a fresh trainer: steps after it are set aside, training goes on from step 3
    io2, model = resume(tmp_path, reported[0])
    assert io2._loaded_step == K
    assert_same(model, reference)


def corrupt_newest(local):
    step_dir = sorted(glob.glob(os.path.join(local, "step-*")))[-1]
    files = sorted(glob.glob(os.path.join(step_dir, "**", "*.safetensors"), recursive=True))
    path = files[0]
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def test_corrupt_newest_local_falls_back_to_previous_step(tmp_path, reference, caplog):
    first_run(tmp_path)
    bad = corrupt_newest(tmp_path / "local")
    with caplog.at_level(logging.WARNING):
        io, model = resume(tmp_path, "last")
    assert io._loaded_step == K
    assert os.path.basename(bad) in caplog.text
    assert_same(model, reference)


def test_corrupt_newest_local_resumes_from_remote_copy(tmp_path, reference, caplog):
    remote = str(tmp_path / "r")
    first_run(tmp_path, remote=remote)  # teardown waits for the uploads
    bad = corrupt_newest(tmp_path / "local")
    with caplog.at_level(logging.WARNING):
        io, model = resume(tmp_path, "last", remote=remote)
    assert io._loaded_step == N
    assert os.path.basename(bad) in caplog.text
    assert_same(model, reference)


def test_explicit_step_with_no_intact_copy_falls_back_older(tmp_path, caplog):
    io, _, _ = first_run(tmp_path)
    corrupt_newest(tmp_path / "local")
    path = tmp_path / "ckpts" / "epoch=0-step=6.ckpt"
    with caplog.at_level(logging.WARNING):
        ckpt = io.load_checkpoint(path)
    io.teardown()
    assert ckpt["global_step"] == K
    assert str(path) in caplog.text


def test_hyperparameters(tmp_path):
    io = TieredCheckpointIO(tmp_path / "local")
    model = make_model(lr=0.01, name="run", sizes=(4, 8), flag=True, opts={"a": 1.5})
    trainer(K, [io], [ckpt_cb(tmp_path / "ckpts")]).fit(model)
    ckpt = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    io.teardown()
    assert ckpt["hyper_parameters"] == {"lr": 0.01, "name": "run", "sizes": (4, 8), "flag": True,
                                        "opts": {"a": 1.5}}
    assert ckpt["hparams_name"] == "kwargs"
    assert "pytorch-lightning_version" in ckpt

    io = TieredCheckpointIO(tmp_path / "local2")
    model = make_model(lr=0.01, thing=Opaque())
    with pytest.raises(TypeError, match=r"hyper_parameters.*thing.*Opaque|thing.*Opaque"):
        trainer(K, [io], [ckpt_cb(tmp_path / "ckpts2")]).fit(model)
    io.teardown()


def test_save_returns_before_the_write_is_durable(tmp_path):
    io = TieredCheckpointIO(tmp_path / "local")
    gate = threading.Event()
    # the persist thread is busy until the gate opens
    blocker = io.manager.components.pipeline.persist_thread.submit(gate.wait)
    try:
        ckpt = {"global_step": 5, "state_dict": {"w": torch.ones(1000)}, "epoch": 0}
        io.save_checkpoint(ckpt, tmp_path / "ckpts" / "a.ckpt")
        handle = io.last_handle
        assert handle is not None and handle.step == 5
        assert not handle.persisted.done()  # save_checkpoint returned without waiting for the write
        io.save_checkpoint(ckpt, tmp_path / "ckpts" / "last.ckpt")  # same step: no second save
        assert io.last_handle is handle
    finally:
        gate.set()
    blocker.result()
    handle.persisted.result(timeout=60)
    io.teardown()
    io2 = TieredCheckpointIO(tmp_path / "local")
    assert [s.step for s in io2.manager.steps()] == [5]
    assert torch.equal(io2.load_checkpoint(tmp_path / "ckpts" / "a.ckpt")["state_dict"]["w"], torch.ones(1000))
    io2.remove_checkpoint(tmp_path / "ckpts" / "a.ckpt")  # the marker goes, the step stays
    assert not (tmp_path / "ckpts" / "a.ckpt").exists()
    assert [s.step for s in io2.manager.steps()] == [5]
    io2.teardown()


@pytest.fixture(scope="module")
def ddp_jobs(tmp_path_factory) -> dict[str, list[dict]]:
    """Each rank's result of the 2-process DDP jobs of tests/integrations/_lightning_ddp.py: an uninterrupted run, a
    first job saving through the plug-in (rank 0), and two new jobs resuming from "last", one with the first job's
    folders and one with only its remote. Run once, in a child started with torch already imported."""
    from tests._support.helpers import subprocess_env
    from tests._support.procs import run_python

    out = tmp_path_factory.mktemp("ddp")
    env = subprocess_env()
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(name, None)
    proc = run_python([os.path.join(os.path.dirname(__file__), "_lightning_ddp.py"), str(out)], env=env,
                      timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {job: [json.load(open(out / f"{job}-r{r}.json")) for r in range(2)]
            for job in ("straight", "fit", "resume", "resume-remote")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["resume", "resume-remote"], ids=["same-node", "remote-only"])
def test_ddp_two_processes_resume_from_last(job, ddp_jobs):
    """A 2-process DDP job saves through the plug-in (rank 0) and a new job resumes from "last" on both ranks: rank
    1 reads rank 0's folder without its lock (or the remote when that folder is gone), and both end with the
    weights of an uninterrupted run."""
    resumed, straight = ddp_jobs[job], ddp_jobs["straight"]
    assert [r["global_step"] for r in ddp_jobs["fit"]] == [4, 4]
    for r in range(2):
        assert resumed[r]["loaded_step"] == 4 and resumed[r]["global_step"] == 8, resumed[r]
        assert resumed[r]["weights"] == straight[r]["weights"], f"rank {r} diverged from the uninterrupted run"
