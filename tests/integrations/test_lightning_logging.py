"""TieredCheckpointLogger: each save's stall, persist, upload seconds and upload lag reach Lightning's loggers at
the save's step, next to the loss (read back from CSVLogger's metrics.csv)."""

from __future__ import annotations

import csv
import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from tests._support.lazy import lazy, requires, subclass
from tierckpt.handle import SaveRecord
from tierckpt.testing import refused_url

pytestmark = requires("lightning")
L = lazy("lightning.pytorch")
ModelCheckpoint = lazy("lightning.pytorch.callbacks", "ModelCheckpoint")
CSVLogger = lazy("lightning.pytorch.loggers", "CSVLogger")
TieredCheckpointIO = lazy("tierckpt.lightning", "TieredCheckpointIO")
TieredCheckpointLogger = lazy("tierckpt.lightning", "TieredCheckpointLogger")

KEYS = ("checkpoint/stall_s", "checkpoint/persist_s", "checkpoint/upload_s", "checkpoint/upload_lag_steps")


def net():
    return subclass(Net, "lightning.pytorch", "LightningModule")()


def thread_spy(*args, **kwargs):
    return subclass(ThreadSpy, "lightning.pytorch.loggers", "CSVLogger")(*args, **kwargs)


class Net:
    """The test's LightningModule (:func:`subclass` adds the base)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(64, 64)
        self.threads: set[str] = set()

    def training_step(self, batch, batch_idx):
        x = torch.randn(8, 64)
        loss = self.net(x).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(400.0), batch_size=4)


class ThreadSpy:
    """A CSVLogger that notes which threads call log_metrics."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.threads: set[str] = set()

    def log_metrics(self, metrics, step=None):
        self.threads.add(threading.current_thread().name)
        return super().log_metrics(metrics, step)


def fit(tmp_path: Path, io: TieredCheckpointIO, callbacks, max_steps: int = 9, every: int = 3,
        logger=None):
    logger = logger or thread_spy(str(tmp_path / "logs"), name="run")
    trainer = L.Trainer(max_steps=max_steps, plugins=[io], accelerator="cpu", devices=1, logger=logger,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=every),
                                   *callbacks],
                        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    torch.manual_seed(0)
    trainer.fit(net())
    return logger


def rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def saved_records(local: Path) -> dict[int, dict]:
    with open(local / "saves.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def test_each_save_is_logged_at_its_step_next_to_the_loss(tmp_path: Path) -> None:
    io = TieredCheckpointIO(tmp_path / "c", remote=str(tmp_path / "r"))
    logger = fit(tmp_path, io, [TieredCheckpointLogger()])
    got = {int(r["step"]): r for r in rows(logger) if r.get("checkpoint/stall_s")}
    recs = saved_records(tmp_path / "c")
    assert sorted(got) == sorted(recs) == [3, 6, 9]  # the last save too (waited for at on_train_end)
    for step, row in got.items():
        for key in ("stall_s", "persist_s", "upload_s"):
            assert float(row[f"checkpoint/{key}"]) == pytest.approx(recs[step][key])
        assert float(row["checkpoint/upload_lag_steps"]) >= 0
        assert float(row["checkpoint/upload_s"]) >= float(row["checkpoint/persist_s"])
    assert any(r.get("loss") for r in rows(logger))  # the loss is in the same file
    assert logger.threads == {threading.main_thread().name}  # logged from the training thread only


def test_a_failed_upload_logs_stall_and_persist_without_upload_seconds(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("s3fs")
    io = TieredCheckpointIO(tmp_path / "c", remote="s3://bucket/run", remote_timeout_s=2, upload_deadline_s=3,
                            storage_options={"client_kwargs": {"endpoint_url": refused_url()}, "key": "k",
                                             "secret": "s"})
    logger = thread_spy(str(tmp_path / "logs"), name="run")
    with caplog.at_level(logging.ERROR):  # the teardown logs the step the remote lacks; fit finishes
        fit(tmp_path, io, [TieredCheckpointLogger()], max_steps=3, every=3, logger=logger)
    assert "1 committed steps are not on" in caplog.text
    assert io.final_health is not None and io.final_health.waiting == (3,)
    logger.save()
    got = [r for r in rows(logger) if r.get("checkpoint/stall_s")]
    assert [int(r["step"]) for r in got] == [3]
    assert float(got[0]["checkpoint/persist_s"]) > 0
    assert not got[0].get("checkpoint/upload_s")  # no upload seconds for a failed upload
    assert float(got[0]["checkpoint/upload_lag_steps"]) == 1  # step 3 is not on the remote


def test_without_the_logger_nothing_is_logged_and_a_wrong_plugin_warns(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    io = TieredCheckpointIO(tmp_path / "c")
    logger = fit(tmp_path, io, [], max_steps=3)
    assert not any(k in r and r[k] for r in rows(logger) for k in KEYS)
    assert [r.step for r in io.take_records()] == [3]  # kept for a logger that never came

    logger2 = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path / "l2")),
                        callbacks=[TieredCheckpointLogger()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level(logging.WARNING, logger="tierckpt.lightning"):
        logger2.fit(net())
    assert caplog.text.count("not a TieredCheckpointIO") == 1


def test_records_resolved_before_save_checkpoint_returns_are_not_waited_for(tmp_path: Path) -> None:
    io = TieredCheckpointIO(tmp_path / "c")  # no remote: records arrive as soon as the step is durable
    ckpt = {"global_step": 1, "state_dict": {"w": torch.ones(4)}}
    io.save_checkpoint(ckpt, str(tmp_path / "m" / "a.ckpt"))
    io.last_handle.persisted.result(timeout=30)
    assert io.wait_records(timeout=10)
    assert not io._unresolved and [r.step for r in io.take_records()] == [1]
    io.teardown()


def test_the_plugin_still_pickles(tmp_path: Path) -> None:  # ddp_spawn pickles the strategy's plug-ins
    import pickle

    io = TieredCheckpointIO(tmp_path / "c")
    io._keep_record(SaveRecord(step=4, stall_s=0.1))
    copy = pickle.loads(pickle.dumps(io))
    assert [r.step for r in copy.take_records()] == [4] and copy.wait_records(timeout=1)
