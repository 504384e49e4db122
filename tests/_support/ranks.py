"""Running one OS process per rank for the multi-rank tests, and collecting what each rank recorded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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


#: What the rank processes are forked from: a server that imported these once (``import torch`` alone costs each
#: process 1.5 s of CPU, and a multi-rank test starts 2 to 6 of them). Nothing of tierckpt: it reads its environment
#: (fault points, switches) when imported, so each rank imports it under its own environment.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy"]
_context: Any = None


def _forkserver() -> Any:
    """The multiprocessing context whose forkserver starts the ranks (started on first use, one per test process)."""
    global _context
    if _context is None:
        import multiprocessing

        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run_script(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A rank process (forked from the forkserver): ``python argv`` in ``cwd`` with ``env``, output to ``log``, as
    a fresh interpreter would run it (``__main__``, its folder first on ``sys.path``, exit handlers at the end)."""
    import atexit
    import runpy
    import threading

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED, which only a new interpreter reads
    sys.stderr.reconfigure(line_buffering=True)
    if env.get("OMP_NUM_THREADS"):  # read by OpenMP when the forkserver loaded it: torch's own setting instead
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit: non-daemon threads first,
        atexit._run_exitfuncs()  # then the exit handlers (multiprocessing's child exit skips both)


def run_ranks(argv: Callable[[int], list[str]], world: int, root: Path, name: str, *, env: dict[str, str],
              timeout: float) -> Ranks:
    """Start ``world`` processes (``python argv(rank)``) and wait for all, killing them all past ``timeout``; each
    rank's output goes to ``root/log-<name>-r<rank>.txt`` and its record is read from ``result-<name>-r<rank>.json``.

    The processes are forked from a server that has imported torch (:data:`PRELOAD`), so each starts in a fraction
    of a second; they are separate OS processes all the same (own memory, own gloo connections, killed by
    SIGKILL)."""
    ctx = _forkserver()
    for r in range(world):
        (root / f"log-{name}-r{r}.txt").write_text("")
    procs = [ctx.Process(target=_run_script, args=(argv(r), env, str(root), str(root / f"log-{name}-r{r}.txt")),
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
