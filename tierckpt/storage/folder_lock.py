"""The local tier's per-rank lock: one writer per rank and folder (a ``CheckpointManager`` or ``tierckpt pull``).

Invariants:
- whoever holds ``<root>/.lock-r<rank>`` (an exclusive, non-blocking ``flock``) is the only process that writes,
  recovers or deletes that rank's steps in the folder; a second taker fails at once instead of waiting;
- the kernel drops the lock when its holder's process dies, so a crash never leaves the folder locked; the file
  keeps the last holder's pid, for people.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ..errors import CheckpointLockedError, StorageAccessError, StorageError
from ..format import layout


def acquire(root: str, rank: int) -> int:
    """Take rank ``rank``'s lock of the folder ``root``; returns its file descriptor (for :func:`release`).
    :class:`CheckpointLockedError` (also a ``BlockingIOError``) if another process holds it;
    :class:`StorageAccessError` (also a ``PermissionError``) if the folder is read-only or not ours to write,
    :class:`StorageError` for any other failure to create the lock file."""
    path = os.path.join(root, layout.lock_name(rank))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except (PermissionError, OSError) as exc:
        denied = isinstance(exc, PermissionError) or exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        cls = StorageAccessError if denied else StorageError
        raise cls(f"cannot create the folder's lock file ({exc.strerror or exc}); the local tier needs a folder this "
                  "process can write", tier="local", path=path, transient=False) from exc
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


def held_by_other(root: str, rank: int) -> bool:
    """Whether another process holds rank ``rank``'s lock of ``root`` right now (a live manager or pull): tried
    with a shared, non-blocking lock that is released at once; False if the lock file does not exist."""
    path = os.path.join(root, layout.lock_name(rank))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def live_holders(root: str) -> list[int]:
    """The ranks whose lock of ``root`` another process holds now (see :func:`held_by_other`)."""
    ranks = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if name.startswith(layout.LOCK_PREFIX) and name[len(layout.LOCK_PREFIX):].isdigit():
            rank = int(name[len(layout.LOCK_PREFIX):])
            if held_by_other(root, rank):
                ranks.append(rank)
    return sorted(ranks)


__all__ = ["acquire", "held_by_other", "live_holders", "release"]
