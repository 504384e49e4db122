"""The local tier's per-rank lock: one writer per rank and folder (a ``CheckpointManager`` or ``tierckpt pull``).

Invariants:
- whoever holds ``<root>/.lock-r<rank>`` (an exclusive, non-blocking ``flock``) is the only process that writes,
  recovers or deletes that rank's steps in the folder; a second taker fails at once instead of waiting;
- the kernel drops the lock when its holder's process dies, so a crash never leaves the folder locked; the file
  keeps the last holder's pid, for people.
"""

from __future__ import annotations

import fcntl
import os

from ..errors import CheckpointLockedError
from ..format import layout


def acquire(root: str, rank: int) -> int:
    """Take rank ``rank``'s lock of the folder ``root``; returns its file descriptor (for :func:`release`).
    :class:`CheckpointLockedError` (also a ``BlockingIOError``) if another process holds it."""
    path = os.path.join(root, layout.lock_name(rank))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointLockedError(f"another CheckpointManager (rank {rank}) is using this folder", tier="local",
                                    path=path) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(fd: int) -> None:
    """Give the lock back and close its descriptor."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


__all__ = ["acquire", "release"]
