"""The local tier's per-rank lock: one writer per rank and folder (a ``CheckpointManager`` or ``tierckpt pull``).

Invariants:
- whoever holds ``<root>/.lock-r<rank>`` (an exclusive, non-blocking ``flock``) is the only process that writes,
  recovers or deletes that rank's steps in the folder; a second taker fails at once instead of waiting;
- the lock belongs to the process that took it, not to its children: an ``flock`` lives as long as any descriptor
  of its open file description, and a forked child (``os.fork``, a multiprocessing or DataLoader worker) inherits
  one, so every child closes its inherited copies right after the fork (``os.register_at_fork``), without
  unlocking (that would release the parent's lock too). A job killed while its workers linger thus restarts at
  once, and a child that drops its copy of the manager never unlocks the parent's folder; a child that needs the
  folder takes the lock itself, and fails while its parent holds it;
- the kernel drops the lock when its holder dies, so a crash never leaves the folder locked; the file keeps the
  last holder's pid, for people;
- the lock file is never opened through a symbolic link or as anything but a regular file (:mod:`.files`): a link
  planted at its name is refused, so the pid is never written into a file outside the folder.

Why ``flock`` and not an open file description lock (``F_OFD_SETLK``): both are tied to the open file description
(so the child's copy must be closed either way), and on Linux the two kinds do not see each other, so a change
would let a manager of an earlier version and one of this version write the same folder at once.
"""

from __future__ import annotations

import errno
import fcntl
import os

from ..errors import CheckpointLockedError, StorageAccessError, StorageError
from ..format import layout
from .files import open_regular

#: Lock descriptors this process holds -> the pid that took them. A forked child inherits the dict with the
#: descriptors; :func:`_forget_inherited` closes them there and empties it.
_held: dict[int, int] = {}


def _forget_inherited() -> None:
    """In a freshly forked child: close the lock descriptors inherited from the parent (never unlock them: the
    parent's lock is the same open file description). Runs before any other code of the child; takes no lock."""
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited)


def acquire(root: str, rank: int) -> int:
    """Take rank ``rank``'s lock of the folder ``root``; returns its file descriptor (for :func:`release`).
    :class:`CheckpointLockedError` (also a ``BlockingIOError``) if another process holds it;
    :class:`StorageAccessError` (also a ``PermissionError``) if the folder is read-only or not ours to write, or
    the lock file's name holds a symbolic link or anything else than a regular file;
    :class:`StorageError` for any other failure to create the lock file."""
    path = os.path.join(root, layout.lock_name(rank))
    try:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644, tier="local")
    except StorageError:
        raise
    except OSError as exc:
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
    except BaseException:
        os.close(fd)
        raise
    _held[fd] = os.getpid()
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(fd: int) -> None:
    """Give the lock back and close its descriptor. A no-op in a forked child for a lock its parent took (the
    descriptor was closed at the fork, and its number may name another file by now)."""
    if _held.pop(fd, None) != os.getpid():
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def held_by_other(root: str, rank: int) -> bool:
    """Whether another process holds rank ``rank``'s lock of ``root`` right now (a live manager or pull): tried
    with a shared, non-blocking lock that is released at once; False if the lock file does not exist, or its name
    holds a symbolic link or something else than a regular file (no manager can lock such a folder)."""
    path = os.path.join(root, layout.lock_name(rank))
    try:
        fd = open_regular(path, os.O_RDONLY)
    except (FileNotFoundError, StorageAccessError):
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
