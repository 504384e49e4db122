"""TieredCheckpointCallback: each resolved save's seconds and the upload lag land in HF's logs (log_history) next to
the loss."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.lazy import requires, subclass
from tests.integrations._hf_names import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, tierhf
from tierckpt.testing import refused_url

pytestmark = requires("transformers")

EVERY = 2


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.ids = torch.randint(0, 101, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class WaitForRecords:
    """A TrainerCallback: before the step after a save, wait until that save's record reached the callback (so
    that the step's log deterministically carries it)."""

    def __init__(self, cb: Any) -> None:
        self.arrived = 0
        self.cond = threading.Condition()
        keep = cb._keep_record

        def counting(rec):
            keep(rec)
            with self.cond:
                self.arrived += 1
                self.cond.notify_all()

        cb._keep_record = counting  # the manager is created later and takes this hook

    def on_step_begin(self, args, state, control, **kwargs):
        saves = state.global_step // EVERY
        with self.cond:
            assert self.cond.wait_for(lambda: self.arrived >= saves, timeout=60)


def make_trainer(tmp_path: Path, cb, max_steps: int):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=32))
    args = TrainingArguments(output_dir=str(tmp_path / "hf_out"), max_steps=max_steps, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], logging_steps=1, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    wait = subclass(WaitForRecords, "transformers", "TrainerCallback")(cb)
    return Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb, wait])


def saved_records(local: Path) -> dict[int, dict]:
    with open(local / "saves.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


class Spy:
    """A TrainerCallback registered before the tierckpt one (as report_to integrations are): what logs it sees."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


@pytest.mark.parametrize("through_train", [True, False], ids=["tierckpt.hf.train", "trainer.train"])
def test_each_save_lands_in_the_log_after_it_next_to_the_loss(tmp_path: Path, through_train: bool) -> None:
    cb = tierhf.TieredCheckpointCallback(tmp_path / "c", remote=str(tmp_path / "r"), save_steps=EVERY)
    trainer = make_trainer(tmp_path, cb, max_steps=8)
    spy = subclass(Spy, "transformers", "TrainerCallback")()
    trainer.callback_handler.callbacks.insert(0, spy)
    if through_train:
        tierhf.train(trainer)
    else:
        trainer.train()
    recs = saved_records(tmp_path / "c")
    assert sorted(recs) == [2, 4, 6, 8]
    logged = [e for e in trainer.state.log_history if "checkpoint/stall_s" in e]
    # the save of step s resolved before step s+1 began: the log of step s+1 carries it; step 8's came after the
    # last log
    assert [(e["step"], e["checkpoint/step"]) for e in logged] == [(3, 2), (5, 4), (7, 6)]
    for e in logged:
        rec = recs[e["checkpoint/step"]]
        assert "loss" in e  # the same log_history entry as the loss
        for key in ("stall_s", "persist_s", "upload_s"):
            assert e[f"checkpoint/{key}"] == pytest.approx(rec[key])
        assert e["checkpoint/upload_lag_steps"] == 0  # uploaded, and no newer save yet
    with_values = [s for s in spy.seen if "checkpoint/stall_s" in s]
    # through tierhf.train the values are in the logs before any callback sees them; with a plain train() the
    # callbacks registered before the tierckpt one (report_to integrations) miss them
    assert len(with_values) == (3 if through_train else 0)


def test_a_failed_upload_logs_stall_and_lag_without_upload_seconds(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    cb = tierhf.TieredCheckpointCallback(
        tmp_path / "c", remote="s3://bucket/run", save_steps=EVERY, remote_timeout_s=2, upload_deadline_s=3,
        storage_options={"client_kwargs": {"endpoint_url": refused_url()}, "key": "k", "secret": "s"})
    trainer = make_trainer(tmp_path, cb, max_steps=3)
    # (not tierhf.train: its resume would refuse to start while the remote cannot be listed)
    trainer.train()  # closing the manager at the end of training logs the upload error (strict_uploads=False)
    assert cb.final_health is not None and not cb.final_health.ok and 2 in cb.final_health.waiting
    logged = [e for e in trainer.state.log_history if "checkpoint/stall_s" in e]
    assert [(e["step"], e["checkpoint/step"]) for e in logged] == [(3, 2)]
    assert logged[0]["checkpoint/persist_s"] > 0
    assert "checkpoint/upload_s" not in logged[0]
    assert logged[0]["checkpoint/upload_lag_steps"] >= 1


def test_checkpoint_logs_takes_the_newest_record_once(tmp_path: Path) -> None:
    cb = tierhf.TieredCheckpointCallback(tmp_path / "c", save_steps=1)
    try:
        for s in (1, 2):
            cb.manager.save(s, {"w": torch.ones(8) * s})
        cb.manager.wait()
        got = cb.checkpoint_logs()
        assert got["checkpoint/step"] == 2 and "checkpoint/upload_s" not in got  # no remote tier
        assert got["checkpoint/upload_lag_steps"] == 0 and got["checkpoint/persist_s"] > 0
        assert cb.checkpoint_logs() == {}
    finally:
        cb.close()
