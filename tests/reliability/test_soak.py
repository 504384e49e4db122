"""Soak: many saves and restores in one process with a small state. RSS, open file descriptors and the
thread count stay flat; every save leaves a record (API and saves.jsonl). 120 rounds in the suite, 2000 with
TIERCKPT_LONG=1."""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path

import psutil
import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointManager

LONG = os.environ.get("TIERCKPT_LONG") == "1"
ROUNDS = 2000 if LONG else 120
WARMUP = 10
pytestmark = pytest.mark.timeout(1800 if LONG else 120)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16_000, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "opt": {"lr": 1e-3 * step, "betas": (0.9, 0.999)}, "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(16_000), "b": torch.zeros(33, dtype=torch.bfloat16),
            "opt": {"lr": 0.0, "betas": (0.0, 0.0)}, "step": -1}


def _sample() -> tuple[int, int, int]:
    gc.collect()
    return psutil.Process().memory_info().rss, len(os.listdir("/proc/self/fd")), threading.active_count()


def test_soak_saves_and_restores(tmp_path: Path) -> None:
    root = tmp_path / "c"
    base = None
    earlier = set(threading.enumerate())  # threads of earlier tests in this process are not this manager's
    with CheckpointManager(root, keep_local=2) as mgr:
        for step in range(1, ROUNDS + 1):
            want = _state(step)
            mgr.save(step, want, metadata={"round": step})
            mgr.wait()
            got = _empty()
            assert mgr.restore(got) == step
            if step % 20 == 0 or step == ROUNDS:
                assert_tree_equal(got, want, f"round {step}")
            if step == WARMUP:
                base = _sample()
        end = _sample()
        records = mgr.records()
    assert base is not None
    rss0, fds0, thr0 = base
    rss1, fds1, thr1 = end
    print(f"\nsoak {ROUNDS} rounds: rss {rss0 >> 20} -> {rss1 >> 20} MiB, fds {fds0} -> {fds1}, "
          f"threads {thr0} -> {thr1}")
    assert rss1 - rss0 < 64 << 20, f"RSS grew by {(rss1 - rss0) >> 20} MiB over {ROUNDS} rounds"
    assert fds1 <= fds0 + 2, f"open fds grew {fds0} -> {fds1}"
    assert thr1 <= thr0 + 1, f"threads grew {thr0} -> {thr1}"
    assert [r.step for r in records] == list(range(1, ROUNDS + 1))
    assert all(r.stall_s is not None and r.persist_s is not None and r.bytes > 0 and not r.error for r in records)
    lines = (root / "saves.jsonl").read_text().splitlines()
    assert len(lines) == ROUNDS, f"saves.jsonl has {len(lines)} lines for {ROUNDS} saves"
    parsed = [json.loads(line) for line in lines]
    assert [p["step"] for p in parsed] == list(range(1, ROUNDS + 1))
    assert all(p["persist_s"] is not None and p["stall_s"] is not None for p in parsed)
    assert (sorted(n for n in os.listdir(root) if n.startswith("step-"))
            == [f"step-{s:010d}" for s in (ROUNDS - 1, ROUNDS)])
    # after close: every thread of the manager is gone
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("tierckpt-") and t.is_alive() and t not in earlier] == []
