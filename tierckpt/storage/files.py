"""Files that tierckpt opens by name in a folder it writes (a tier root's lock and ``saves.jsonl``, an export's
temporaries), opened so that nothing planted at that name can redirect the write.

Invariants:
- a symbolic link at the name is never followed (``O_NOFOLLOW``), dangling or not, so no file outside the folder
  is created, truncated or appended to through one; anything else that is not a regular file (a FIFO, a device, a
  folder) is refused before a byte is written, and opening never blocks on it (``O_NONBLOCK``);
- a temporary is created under a fresh random name, exclusively (``O_EXCL``: an existing file or link there fails
  the open instead of being reused), and only ``os.replace`` gives it its final name: a link at the final name is
  replaced, not followed;
- modes are those asked for (0644 by default) less the process umask, as for every other file tierckpt writes;
- each refusal is a :class:`~tierckpt.errors.StorageAccessError` (also a ``PermissionError``) naming the path.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable

from ..errors import StorageAccessError

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
#: What ``open(2)`` sets when ``O_NOFOLLOW`` met a symbolic link (ELOOP on Linux, EMLINK on FreeBSD).
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
#: Random names tried for a temporary before giving up (each clash means a file already sits at the name).
_TEMP_TRIES = 64


def refused(path: str, why: str, *, tier: str | None) -> StorageAccessError:
    """The error for a name tierckpt will not open: ``why`` it is refused, and the path."""
    return StorageAccessError(f"{why}; tierckpt never writes through a symbolic link or a special file there",
                              tier=tier, path=path, transient=False)


def open_regular(path: str, flags: int, mode: int = 0o644, *, tier: str | None = None) -> int:
    """``os.open(path, flags, mode)`` that never follows a symbolic link at ``path`` and opens regular files only;
    returns the descriptor (close-on-exec). ``flags`` may include ``O_CREAT`` (a missing file is created with
    ``mode`` less the umask).

    Raises :class:`StorageAccessError` naming ``path`` when it is a symbolic link or not a regular file; other
    ``OSError`` as ``os.open`` raises them (a missing folder, a read-only file system, ...)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS and os.path.islink(path):
            raise refused(path, "the name is a symbolic link", tier=tier) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refused(path, "the name is not a regular file", tier=tier)
        if _NONBLOCK:  # only there so that opening a FIFO cannot hang; a regular file's I/O ignores it anyway
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def append_line(path: str, line: str, *, tier: str | None = None) -> None:
    """Append ``line`` (a whole line, its newline included) to the regular file ``path``, creating it (0644 less
    the umask) if missing, in one ``write`` call of an ``O_APPEND`` descriptor. Raises as :func:`open_regular`."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, tier=tier)
    try:
        data = memoryview(line.encode())
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def create_temporary(folder: str, prefix: str, *, mode: int = 0o644,
                     tier: str | None = None) -> tuple[int, str]:
    """A new, empty regular file in ``folder`` under a random name starting with ``prefix``, created exclusively
    (``O_EXCL | O_NOFOLLOW``); returns its write-only descriptor and path. ``mode``: less the umask.

    Raises :class:`StorageAccessError` when every random name tried was taken (something keeps planting files
    there), ``OSError`` as ``os.open`` raises it otherwise."""
    for _ in range(_TEMP_TRIES):
        path = os.path.join(folder, f"{prefix}{secrets.token_hex(8)}.tmp")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode), path
        except FileExistsError:
            continue
    raise StorageAccessError(f"could not create a temporary file: {_TEMP_TRIES} random names were all taken",
                             tier=tier, path=folder, transient=False)


def write_replace(path: str, write: Callable[[int], None], *, mode: int = 0o644, tier: str | None = None) -> None:
    """Write the file ``path`` whole: ``write(fd)`` fills a fresh temporary beside it (:func:`create_temporary`),
    which is ``fsync``-ed and renamed over ``path`` (a link at ``path`` is replaced, never followed). On any
    error the temporary is removed and ``path`` is left as it was; the folder's ``fsync`` is the caller's."""
    folder = os.path.dirname(path) or "."
    fd, tmp = create_temporary(folder, f".{os.path.basename(path)}.", mode=mode, tier=tier)
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


__all__ = ["append_line", "create_temporary", "open_regular", "refused", "write_all", "write_replace"]
