"""``lazy_snapshot=True``: ``save()`` returns before the state's bytes are copied; the copy runs on the snapshot
thread while training goes on, and the barrier before ``optimizer.step()`` (installed for every optimizer in a saved
state) holds the step until it is done. Each checkpoint must still hold the state exactly as it was at its
``save()``: tensors as they were before the next optimizer step, and every Python value (a data position, an
optimizer's hyper-parameters, a generator's state, a module's extra state) as it was when ``save()`` was called,
whatever the caller changes right after."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tensor_equal
from tierckpt import CheckpointManager
from tierckpt.engine.pipeline import SavePipeline
from tierckpt.snapshot import copier


class _Counter(torch.nn.Module):
    """A module whose extra state is a Python value that changes every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]


def _job(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), _Counter())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optim": opt, "data": {"pos": 0, "seen": [0]},
            "gen": torch.Generator().manual_seed(seed), "sched": {"lr": 1e-2}}


def _step(job: dict[str, Any], i: int) -> None:
    model, opt = job["model"], job["optim"]
    x = torch.randn(4, 8, generator=job["gen"])
    loss = model(x).pow(2).sum() * (1 + i)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()  # the barrier runs first (the optimizer's step pre-hook)


def _snapshot(job: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in job["model"].state_dict().items() if isinstance(v, torch.Tensor)},
            "calls": job["model"][2].calls,
            "optim": copy.deepcopy(job["optim"].state_dict()),
            "data": copy.deepcopy(job["data"]), "gen": job["gen"].get_state().clone(), "lr": job["sched"]["lr"]}


def _assert_restores_to(mgr: CheckpointManager, step: int, want: dict[str, Any]) -> None:
    got = _job(1000 + step)
    _step(got, 0)  # optimizer state exists, as after a restart's first step
    assert mgr.restore(got, step=step) == step
    for k, v in want["model"].items():
        assert_tensor_equal(got["model"].state_dict()[k], v, f"step {step} model.{k}")
    assert got["model"][2].calls == want["calls"]
    opt_state = got["optim"].state_dict()
    assert opt_state["param_groups"] == want["optim"]["param_groups"]
    for p, st in want["optim"]["state"].items():
        for name, v in st.items():
            assert_tensor_equal(opt_state["state"][p][name], v, f"step {step} optim.{p}.{name}")
    assert got["data"] == want["data"] and got["sched"]["lr"] == want["lr"]
    assert torch.equal(got["gen"].get_state(), want["gen"])


def test_each_lazy_checkpoint_holds_the_state_of_its_save_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(0)
    want = {}
    changed = threading.Event()  # the snapshot thread starts only once the caller has changed everything
    real_flatten = SavePipeline._flatten

    def late_flatten(self: SavePipeline, state: Any) -> Any:
        assert changed.wait(30)
        return real_flatten(self, state)

    monkeypatch.setattr(SavePipeline, "_flatten", late_flatten)  # the pipeline's flatten of a lazy snapshot
    with CheckpointManager(tmp_path, lazy_snapshot=True, keep_local=10) as mgr:
        for i in range(1, 9):
            _step(job, i)
            if i % 2 == 0:
                want[i] = _snapshot(job)
                changed.clear()
                mgr.save(i, job)
                # right after save() returns, before any barrier: change every kind of Python value
                job["data"]["pos"] += 100
                job["data"]["seen"].append(i)
                job["sched"]["lr"] *= 0.5
                for g in job["optim"].param_groups:
                    g["lr"] *= 0.5
                torch.randn(3, generator=job["gen"])
                job["model"][2].calls += 1000
                changed.set()
        mgr.wait()
        for i, w in want.items():
            _assert_restores_to(mgr, i, w)


def test_lazy_save_returns_before_the_copy_and_the_optimizer_step_waits_for_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(1)
    _step(job, 1)
    started, release = threading.Event(), threading.Event()
    real = copier.copy_into

    def slow_copy(*a: Any, **k: Any) -> Any:
        started.set()
        assert release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(copier, "copy_into", slow_copy)
    with CheckpointManager(tmp_path, lazy_snapshot=True) as mgr:
        want = _snapshot(job)
        t0 = time.perf_counter()
        handle = mgr.save(1, job)
        assert time.perf_counter() - t0 < 5 and not handle.staged.done()
        assert started.wait(30)
        stepped = threading.Event()
        worker = threading.Thread(target=lambda: (_step(job, 2), stepped.set()), daemon=True)
        worker.start()
        assert not stepped.wait(0.3), "optimizer.step() ran while the snapshot was still being copied"
        release.set()
        assert stepped.wait(30)
        worker.join(30)
        assert handle.staged.done()
        mgr.wait()
        _assert_restores_to(mgr, 1, want)


def test_restore_waits_for_a_pending_lazy_snapshot(tmp_path: Path) -> None:
    job = _job(2)
    _step(job, 1)
    want = _snapshot(job)
    with CheckpointManager(tmp_path, lazy_snapshot=True) as mgr:
        mgr.save(3, job)
        _assert_restores_to(mgr, 3, want)  # no explicit wait: restore() first waits for the snapshot
