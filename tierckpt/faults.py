"""Named fault points, for crash tests (kill-anywhere harnesses).

``TIERCKPT_FAULT=<point>[:<n>]`` in the environment makes the process SIGKILL itself the n-th time (default 1st) it
reaches ``point``. Points: ``staging``, ``mid-file``, ``before-fsync``, ``after-fsync``, ``before-manifest``,
``after-manifest``, ``before-rename``, ``after-rename``, ``mid-upload``, ``before-remote-manifest``,
``remote-commit`` (rank 0 of a multi-rank job, every shard reported, before ``manifest.json``), ``retention``,
``rollback`` (after each step a rollback set aside).
Unset (the normal case) it costs one dictionary lookup per point.
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = (
    "staging", "mid-file", "before-fsync", "after-fsync", "before-manifest", "after-manifest", "before-rename",
    "after-rename", "mid-upload", "before-remote-manifest", "remote-commit", "retention", "rollback",
)


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"TIERCKPT_FAULT names an unknown point {name!r}; known: {', '.join(POINTS)}")
    return name, int(n or 1)


_target = _parse(os.environ.get("TIERCKPT_FAULT"))
_hits = 0
_lock = threading.Lock()


def point(name: str) -> None:
    """A place where a crash test may kill the process."""
    global _hits
    if _target is None or _target[0] != name:
        return
    with _lock:
        _hits += 1
        if _hits == _target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
