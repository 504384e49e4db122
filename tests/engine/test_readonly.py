"""tierckpt.readonly: reading a checkpoint root that a live manager owns, without its lock, verified."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tierckpt import CheckpointLockedError, CheckpointManager, CheckpointNotFoundError, readonly


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(1000.0) + step}, "optim": {"m": torch.full((500,), float(step))}, "step": step}


def test_reads_beside_the_live_owner(tmp_path: Path) -> None:
    root, remote = tmp_path / "c", tmp_path / "r"
    with CheckpointManager(root, remote=str(remote), keep_local=3) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
        mgr.wait()
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(root)  # a second owner is refused ...
        got = readonly.load(root)  # ... a reader is not, and takes no lock
        assert got.step == 2 and got.tier == "local" and got.state["step"] == 2
        assert torch.equal(got.state["model"]["w"], _state(2)["model"]["w"])
        only = readonly.load(root, step=1, keys=["model"])
        assert only.step == 1 and set(only.state) == {"model"}
        assert readonly.committed_steps(root) == [2, 1]
        mgr.save(3, _state(3))  # the owner goes on saving
        mgr.wait()
    shutil.rmtree(root)
    from_remote = readonly.load(root, remote=str(remote))  # a node without the folder reads the remote
    assert from_remote.step == 3 and from_remote.tier == "remote"
    assert readonly.committed_steps(root, remote=str(remote)) == [3, 2, 1]


def test_a_corrupt_copy_falls_back_and_nothing_is_created(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with CheckpointManager(root, keep_local=3) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    data = sorted((root / "step-0000000002").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert readonly.load(root).step == 1
    with pytest.raises(CheckpointNotFoundError):
        readonly.load(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()
    with pytest.raises(ValueError, match="source"):
        readonly.load(root, source="nowhere")
