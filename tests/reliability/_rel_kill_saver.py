"""Fork server for the kill-anywhere harness (tests/reliability/test_kill.py).

Importing torch costs ~2 s per process, so one server process imports tierckpt once and forks a fresh child per
trial. The server stays single-threaded (it never runs a torch op nor starts a manager), so forking is safe.

Protocol: one JSON object per stdin line, one JSON answer per stdout line.

request ``{"root": str, "remote": str|null, "fault": "point[:n]"|null, "kill_after": float|null, "seed": int,
"steps": int, "progress": str}`` (and optionally ``"incremental": true``: :data:`INCREMENTAL_KW` and
:func:`inc_state`); the child opens ``CheckpointManager(root, remote, keep_local=2, keep_remote=2)``
and saves steps 1..``steps`` (``rel_state(step, seed)``), calling ``wait()`` after each and appending ``done <step>``
to the ``progress`` file (``start <step>`` before each save). ``fault`` arms ``tierckpt.faults`` exactly as
``TIERCKPT_FAULT`` does at import; ``kill_after`` makes the server SIGKILL the child that many seconds after the fork.

answer ``{"killed": bool, "status": str}``: ``killed`` is true iff the child died of SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def rel_state(step: int, seed: int) -> dict[str, Any]:
    """~1.3 MB state in two data files (file_size_mb=1), rebuilt identically by the tests."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "w": torch.randn(160_000, generator=g),
        "v": torch.randn(160_000, generator=g),
        "h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (500,), generator=g),
        "meta": {"step": step, "seed": seed},
    }


def rel_empty() -> dict[str, Any]:
    import torch

    return {
        "w": torch.zeros(160_000),
        "v": torch.zeros(160_000),
        "h": torch.zeros(64, 33, dtype=torch.bfloat16),
        "ids": torch.zeros(500, dtype=torch.int64),
        "meta": {"step": -1, "seed": -1},
    }


MANAGER_KW: dict[str, Any] = {"keep_local": 2, "file_size_mb": 1, "writer_threads": 2, "upload_threads": 2}
#: what a request with ``"incremental": true`` adds (tests/reliability/test_incremental_kill.py)
INCREMENTAL_KW: dict[str, Any] = {"incremental": True, "full_every": 3}


def inc_state(step: int, seed: int) -> dict[str, Any]:
    """:func:`rel_state` with a tensor ``w`` that never changes (a frozen base): incremental saves reference it."""
    import torch

    state = rel_state(step, seed)
    state["w"] = torch.randn(160_000, generator=torch.Generator().manual_seed(seed))
    return state


def _child(req: dict[str, Any]) -> None:
    from tierckpt import CheckpointManager, faults

    spec = req.get("fault")
    if spec:
        os.environ["TIERCKPT_FAULT"] = spec
    faults._target = faults._parse(spec)  # what the import does with TIERCKPT_FAULT
    faults._hits = 0
    remote = req.get("remote")
    inc = bool(req.get("incremental"))
    kw = {**MANAGER_KW, **(INCREMENTAL_KW if inc else {})}
    with open(req["progress"], "a") as prog:
        mgr = CheckpointManager(req["root"], remote=remote, keep_remote=2 if remote else None, **kw)
        for step in range(1, int(req["steps"]) + 1):
            prog.write(f"start {step}\n")
            prog.flush()
            mgr.save(step, (inc_state if inc else rel_state)(step, int(req["seed"])))
            mgr.wait()
            prog.write(f"done {step}\n")
            prog.flush()
        mgr.close()


def serve() -> None:
    # the expensive imports, once (tierckpt's package __init__ is lazy: name what the child will use)
    import torch  # noqa: F401
    import zstandard  # noqa: F401

    import tierckpt.cli  # noqa: F401
    import tierckpt.tiers.uploader  # noqa: F401
    from tierckpt import CheckpointManager  # noqa: F401

    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _child(req)
            except BaseException as exc:  # report, never fall back into the server loop
                sys.stderr.write(f"child error: {type(exc).__name__}: {exc}\n")
                code = 3
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        kill_after = req.get("kill_after")
        status = None
        if kill_after is not None:
            deadline = time.monotonic() + float(kill_after)
            while status is None and time.monotonic() < deadline:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = st
                else:
                    time.sleep(0.002)
            if status is None:
                os.kill(pid, signal.SIGKILL)
        if status is None:
            _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        what = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        print(json.dumps({"killed": killed, "status": what}), flush=True)


if __name__ == "__main__":
    serve()
