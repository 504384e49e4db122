"""Where an in-place restore reads the bytes that do not go straight into live tensors.

Those bytes (file headers, tensors under the direct-read threshold) lie at their file offsets in a state-sized
buffer. With no staging slot ready, a fresh manager's restore (a restart) puts them in a private buffer on small
pages, freed afterwards, instead of allocating a staging slot; a slot that is ready is used; a state whose bytes
mostly do not go straight into tensors still reads into a slot. Every case restores exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._support.helpers import assert_tensor_equal, step_path
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.engine import restore as _restore
from tierckpt.snapshot import staging
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.reader import read_manifests

pytestmark = pytest.mark.timeout(120)


def _state(large: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {f"small{i}": torch.randn(1000 + i, generator=g) for i in range(20)}  # under DIRECT_READ_MIN_BYTES
    if large:
        out |= {"w1": torch.randn(300_000, generator=g), "w2": torch.randn(200_001, generator=g).double()}
    return out


def _spy_private(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the private buffers a restore allocates (the real allocation still runs)."""
    sizes: list[int] = []
    real = _restore.aligned_empty

    def spy(size: int, *, pin: bool, huge: bool = False) -> torch.Tensor:
        sizes.append(size)
        assert not pin and not huge, "the private buffer is pageable, on small pages"
        return real(size, pin=pin, huge=huge)

    monkeypatch.setattr(_restore, "aligned_empty", spy)
    return sizes


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _restored_in_a_fresh_manager(tmp_path: Path, monkeypatch, state: dict[str, torch.Tensor], *,
                                 in_place: bool) -> tuple[int, list[int]]:
    """Save ``state``, restore it with a fresh manager and check the values; returns the staging allocations of that
    restore and the sizes of the private buffers it took."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.wait()
    sizes = _spy_private(monkeypatch)
    out = _zeros(state)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(out, in_place=in_place) == 1
        allocations = mgr.components.staging.allocations
    for k in state:
        assert_tensor_equal(out[k], state[k], k)
    return allocations, sizes


def test_a_fresh_manager_reads_the_small_rest_into_a_private_buffer_not_a_staging_slot(tmp_path: Path, monkeypatch):
    state = _state()
    allocations, sizes = _restored_in_a_fresh_manager(tmp_path, monkeypatch, state, in_place=True)
    assert allocations == 0, "a staging slot was allocated for a few small tensors"
    assert len(sizes) == 1
    with CheckpointManager(tmp_path) as mgr:  # a restore after a save finds the save's slot ready and uses it
        mgr.save(2, state)
        mgr.wait()
        allocations = mgr.components.staging.allocations
        out = _zeros(state)
        assert mgr.restore(out, in_place=True) == 2
        assert len(sizes) == 1 and mgr.components.staging.allocations == allocations, \
            "a private buffer beside a ready slot"
    for k in state:
        assert_tensor_equal(out[k], state[k], k)


def test_a_state_mostly_of_small_tensors_still_reads_into_a_staging_slot(tmp_path: Path, monkeypatch):
    assert _restored_in_a_fresh_manager(tmp_path, monkeypatch, _state(large=False), in_place=True) == (1, [])


def test_a_default_restore_never_uses_a_private_buffer(tmp_path: Path, monkeypatch):
    assert _restored_in_a_fresh_manager(tmp_path, monkeypatch, _state(), in_place=False) == (1, [])


def test_a_corrupt_small_tensor_read_into_the_private_buffer_is_found(tmp_path: Path, monkeypatch):
    state = _state()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.save(2, {k: v + 1 for k, v in state.items()})
        mgr.wait()
    _, rms = read_manifests(LocalStore(tmp_path), 2)
    rec = next(t for t in rms[0].tensors if "small3" in t.path)
    path = step_path(tmp_path, 2) / rms[0].files[rec.file].name
    with open(path, "r+b") as f:  # one bit of a small tensor, which the private buffer receives
        f.seek(rec.offset + 5)
        b = f.read(1)
        f.seek(rec.offset + 5)
        f.write(bytes([b[0] ^ 0x10]))
    sizes = _spy_private(monkeypatch)
    out = _zeros(state)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="small3"):
            mgr.restore(_zeros(state), step=2, in_place=True)
        assert mgr.restore(out, in_place=True) == 1  # step 2 is corrupt: step 1, loaded over it
        assert mgr.components.staging.allocations == 0 and len(sizes) == 3
    for k in state:
        assert_tensor_equal(out[k], state[k], k)


def test_the_pool_tells_whether_a_slot_is_ready() -> None:
    pool = staging.StagingPool(slots=1, pin=False)
    assert not pool.ready(1000)
    slot = pool.acquire(1000)
    assert not pool.ready(1000)  # handed out
    pool.release(slot)
    assert pool.ready(1000) and not pool.ready(slot.capacity + 1)
    pool.close()
