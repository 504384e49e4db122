"""Running one OS process per rank for the multi-rank tests, and collecting what each rank recorded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests._support.procs import forkserver, run_as_main

REPO_ROOT = Path(__file__).resolve().parents[2]


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank process: this checkout importable, one OpenMP thread, no inherited fault point."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TIERCKPT_FAULT", None)
    env.update(extra or {})
    return env


@dataclass
class Ranks:
    """The outcome of one multi-rank job: exit codes, each rank's recorded phases, each rank's log."""

    name: str
    root: Path
    returncodes: list[int | None]
    results: list[dict[str, Any]]
    logs: list[str]
    timed_out: bool

    def phase(self, rank: int, name: str) -> dict[str, Any]:
        """One rank's record of one phase; a phase that raised fails the test with the rank's traceback."""
        rec = self.results[rank].get(name)
        assert rec is not None, f"{self.name}: rank {rank} recorded no phase {name!r}; log:\n{self.logs[rank][-4000:]}"
        if isinstance(rec, dict) and "phase_error" in rec:
            pytest.fail(f"{self.name}: rank {rank}, phase {name!r} raised:\n{rec['traceback']}")
        return rec

    def phases(self, name: str) -> list[dict[str, Any]]:
        return [self.phase(r, name) for r in range(len(self.results))]

    def detail(self) -> str:
        return "\n".join(f"--- rank {r} (rc {rc}):\n{log[-3000:]}"
                         for r, (rc, log) in enumerate(zip(self.returncodes, self.logs)))


def run_ranks(argv: Callable[[int], list[str]], world: int, root: Path, name: str, *, env: dict[str, str],
              timeout: float) -> Ranks:
    """Start ``world`` processes (``python argv(rank)``) and wait for all, killing them all past ``timeout``; each
    rank's output goes to ``root/log-<name>-r<rank>.txt`` and its record is read from ``result-<name>-r<rank>.json``.

    The processes are forked from a server that has imported torch (:mod:`tests._support.procs`), so each starts in
    a fraction of a second; they are separate OS processes all the same (own memory, own gloo connections, killed
    by SIGKILL)."""
    ctx = forkserver()
    for r in range(world):
        (root / f"log-{name}-r{r}.txt").write_text("")
    procs = [ctx.Process(target=run_as_main, args=(argv(r), env, str(root), str(root / f"log-{name}-r{r}.txt")),
                         name=f"{name}-r{r}")
             for r in range(world)]
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            timed_out = timed_out or p.exitcode is None
    finally:  # never leave a rank behind (timeout, or the test interrupted)
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
    results = []
    for r in range(world):
        path = root / f"result-{name}-r{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    texts = [(root / f"log-{name}-r{r}.txt").read_text() for r in range(world)]
    return Ranks(name, root, [p.exitcode for p in procs], results, texts, timed_out)


def assert_all_ok(ranks: Ranks, name: str, timeout: float) -> None:
    assert not ranks.timed_out, f"{name}: ranks still running after {timeout} s\n{ranks.detail()}"
    assert ranks.returncodes == [0] * len(ranks.returncodes), f"{name}: a rank failed\n{ranks.detail()}"
