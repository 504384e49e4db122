"""Incremental steps in the memory tier (``memory_tier=True, incremental=True``): the slot holds the snapshot's
files whole, the step's files reference an earlier step; the memory copy carries a slot manifest (the same tensors
and checksums, at their places in the slot), a restore and a load are served from memory, and a byte changed in the
memory copy, in a tensor the step references, is caught and the disk serves the step. The multi-rank case is
``test_memory_tier.py::test_two_ranks_on_a_node_restore_each_from_its_own_memory_copy`` (its steps are
incremental)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import empty_like_kill_state, kill_state
from tierckpt import CheckpointManager
from tierckpt.format.manifest import RankManifest
from tierckpt.tiers import memory

pytestmark = pytest.mark.timeout(60)

FROZEN = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB that no step changes


def saved(step: int) -> dict[str, Any]:
    return {**kill_state(step, 7, False), "frozen": FROZEN.clone()}


def empty() -> dict[str, Any]:
    return {**empty_like_kill_state(False), "frozen": torch.zeros_like(FROZEN)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in ("w", "h", "ids", "frozen")) \
        and a["meta"] == b["meta"]


def test_an_incremental_step_is_restored_from_memory_and_verified(tmp_path: Path, shm: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierckpt")
    root = tmp_path / "ckpt"
    with CheckpointManager(root, memory_tier=True, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, saved(step))
            mgr.wait()
        assert json.loads((root / "step-0000000002" / "manifest.json").read_text())["refs"] == [1]
        tier = mgr.components.staging.memory
        assert tier is not None
        (copy,) = tier.copies().values()
        assert copy.step == 2 and copy.slot_manifest  # the slot's files, described tensor for tensor

        state = empty()
        assert mgr.restore(state) == 2 and tier.restored == [2]
        assert same(state, saved(2))
        out = mgr.load()
        assert (out.step, out.tier) == (2, "memory") and same(out.state, saved(2))

        # one bit of the frozen tensor in the memory copy: the bytes the step references in step 1's file
        slot = RankManifest.from_bytes(copy.slot_manifest)
        rec = next(r for r in slot.tensors if r.nbytes == FROZEN.nbytes)
        at = copy.files[rec.file].offset + rec.offset + 5
        with open(copy.path, "r+b") as f:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 1]))
        caplog.clear()
        state = empty()
        assert mgr.restore(state) == 2 and tier.restored == [2, 2]  # not a third time: the disk served it
        assert same(state, saved(2))
        assert "restore: step 2 in tier memory" in caplog.text and "is corrupt" in caplog.text
        assert "restore: step 2 from tier local" in caplog.text


def test_a_slot_manifest_not_describing_the_committed_tensors_is_refused(tmp_path: Path, shm: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A slot manifest whose checksums are those of its own (changed) bytes, not the committed ones: refused before a
    byte is read."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root, memory_tier=True, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, saved(step))
            mgr.wait()
        tier = mgr.components.staging.memory
        assert tier is not None
        (copy,) = tier.copies().values()
        slot = RankManifest.from_bytes(copy.slot_manifest)
        bad = slot.tensors[0]._replace(checksum="0" * 32)
        forged = memory.MemoryCopy(copy.slot, copy.step, copy.save_id, copy.rank, copy.step_manifest,
                                   copy.rank_manifest_name, copy.rank_manifest, copy.files, copy.path, copy.created,
                                   dataclasses.replace(slot, tensors=(bad, *slot.tensors[1:])).to_bytes())
        Path(copy.path + ".manifest.json").write_bytes(forged.to_bytes())
        state = empty()
        assert mgr.restore(state) == 2 and tier.restored == []
        assert same(state, saved(2))
        assert "does not describe the committed rank manifest's tensors" in caplog.text
