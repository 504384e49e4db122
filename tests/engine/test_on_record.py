"""``on_record``: each save's record reaches the caller's hooks once the save is resolved in every tier (an
upload that fails included), in order; a hook that raises is logged and costs nothing."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import CheckpointManager, UploadError
from tierckpt.handle import SaveRecord
from tierckpt.testing import refused_url


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def test_each_save_reaches_every_hook_with_its_timings(tmp_path: Path) -> None:
    first: list[SaveRecord] = []
    second: list[int] = []
    threads: set[str] = set()

    def hook(rec: SaveRecord) -> None:
        threads.add(threading.current_thread().name)
        first.append(rec)

    with CheckpointManager(tmp_path / "c", remote=str(tmp_path / "r"),
                           on_record=[hook, lambda rec: second.append(rec.step)]) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        mgr.wait()
        # once each, in the order they resolved (the newest step may be uploaded before an older one)
        assert sorted(r.step for r in first) == [1, 2, 3] and [r.step for r in first] == second
        assert mgr.records() == first
    for rec in first:
        assert rec.bytes >= 4000 and rec.stall_s is not None and rec.persist_s is not None
        assert rec.upload_s is not None and rec.upload_s >= rec.persist_s and rec.error is None
    assert threading.main_thread().name not in threads  # never on the training thread


def test_a_failed_upload_is_reported_and_a_raising_hook_is_logged(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("s3fs")
    got: list[SaveRecord] = []

    def broken(rec: SaveRecord) -> None:
        raise RuntimeError("exporter down")

    url = refused_url()
    with caplog.at_level(logging.WARNING, logger="tierckpt.manager"):
        mgr = CheckpointManager(tmp_path / "c", remote="s3://bucket/run", remote_timeout_s=2,
                                storage_options={"client_kwargs": {"endpoint_url": url}, "key": "k", "secret": "s"},
                                upload_deadline_s=3, on_record=(broken, got.append))
        try:
            handle = mgr.save(1, _state(1))
            assert handle.persisted.result(timeout=30) is not None  # the local tier has it whatever the hooks do
            with pytest.raises(UploadError, match="step 1"):
                mgr.wait(timeout=60)
        finally:
            with contextlib.suppress(UploadError):
                mgr.close()
    assert [r.step for r in got] == [1]
    assert got[0].error and got[0].upload_s is None
    assert "on_record hook" in caplog.text and "exporter down" in caplog.text and "step 1" in caplog.text


@pytest.mark.parametrize("bad", ["print", 3, [print, "x"]])
def test_on_record_is_validated(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="on_record"):
        CheckpointManager(tmp_path / "c", on_record=bad)


def test_a_hook_added_later_gets_the_next_records_once(tmp_path: Path) -> None:
    got: list[int] = []

    def hook(rec: SaveRecord) -> None:
        got.append(rec.step)

    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, _state(1)).persisted.result(timeout=30)
        mgr.wait()
        mgr.add_on_record(hook)
        mgr.add_on_record(hook)  # not twice
        mgr.save(2, _state(2))
        mgr.wait()
        with pytest.raises(ValueError, match="on_record"):
            mgr.add_on_record("not callable")  # type: ignore[arg-type]
    assert got == [2]
