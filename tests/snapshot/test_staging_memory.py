"""Host buffers are allocated once and reused; back-to-back saves do not allocate without bound."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch

from tests._support.helpers import assert_tensor_equal
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(180)

STATE_MB = 64


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_steady_state_saves_do_not_grow_rss(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(STATE_MB << 18, generator=g)  # 64 MiB of float32
    state = {"w": w, "b": torch.randn(1000, generator=g)}
    size = w.numel() * w.element_size()
    with CheckpointManager(tmp_path / "c", keep_local=2) as mgr:
        mgr.save(1, state)
        mgr.wait()
        base = _rss()
        # one more save, waited for: must reuse the buffers of the first
        w.add_(1.0)
        mgr.save(2, state)
        mgr.wait()
        after_one = _rss()
        # three back-to-back saves without waiting: back-pressure, not a buffer per pending save
        peak = after_one
        for step in (3, 4, 5):
            w.add_(1.0)
            mgr.save(step, state)
            peak = max(peak, _rss())
        mgr.wait()
        peak = max(peak, _rss())
        want = w.clone()
    grow_one = (after_one - base) / size
    grow_peak = (peak - base) / size
    assert grow_one < 0.5, f"a second save grew RSS by {grow_one:.2f}x the state size"
    assert grow_peak < 1.0, f"back-to-back saves grew RSS by {grow_peak:.2f}x the state size"
    with CheckpointManager(tmp_path / "c") as mgr:
        fresh = {"w": torch.zeros_like(w), "b": torch.zeros(1000)}
        assert mgr.restore(fresh) == 5
    assert_tensor_equal(fresh["w"], want, "w")
