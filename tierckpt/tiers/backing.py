"""Data files whose claimed size is not backed by stored bytes, verified before a reader allocates that much.

:func:`.reader.check_sizes` makes sure every file on the store has the size its manifest records before anything of
that size is allocated. A size is not data, though: a sparse file (its holes read as zeros) or a zstd file that
decompresses to far more than it stores can match a manifest claiming gigabytes while holding next to nothing, and
a reader would allocate all of it, and fill it with zeros, before the checksum told it apart (a sparse file claiming
1 GiB made ``load`` and ``export`` grow by 1 GiB of RSS). So before such an allocation (:func:`prove_backed`), a file
whose claim is not backed is streamed once through bounded buffers (:func:`.stream.stream_file`: at most a few
chunks of :data:`.stream.READ_CHUNK` in memory) and must match its checksum first.

Not backed means: on a store with a local path, more than :data:`HOLE_PROOF_BYTES` of the file are holes (asked
with ``lseek(SEEK_DATA/SEEK_HOLE)``, which costs a few system calls per file and reports no holes where a file
system cannot tell); or, compressed, the file decompresses to more than :data:`COMPRESSION_PROOF_RATIO` times its
stored size. Files that tierckpt writes are never sparse and checkpoint data compresses far less than that, so a
restore, load or export of a genuine checkpoint reads nothing twice; one of all-zero tensors on a file system that
stores zeros as holes (ZFS with compression) is read once more, and is then loaded as usual.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable

from ..format.manifest import FileRecord, RankManifest, file_rel
from ..storage.base import Store
from .stream import stream_file

log = logging.getLogger(__name__)

#: A file with more bytes in holes than this is verified before memory of its size is allocated.
HOLE_PROOF_BYTES = 1 << 20
#: A compressed file that decompresses to more than this many times its stored size (plus
#: :data:`HOLE_PROOF_BYTES`) is verified before memory of its size is allocated.
COMPRESSION_PROOF_RATIO = 8


def hole_bytes(path: str, size: int, *, enough: int = HOLE_PROOF_BYTES) -> int:
    """How many bytes of ``[0, size)`` of the file at ``path`` are holes (no data stored), counted until more than
    ``enough`` are found; 0 where it cannot be told (no ``SEEK_HOLE`` on this platform or file system, or the file
    cannot be opened: the read that follows reports that)."""
    if not hasattr(os, "SEEK_DATA"):
        return 0
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return 0
    holes = pos = 0
    try:
        while pos < size and holes <= enough:  # each round past the first finds at least one block of hole
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                return holes + size - pos if exc.errno == errno.ENXIO else 0  # ENXIO: holes up to the end
            holes += min(data, size) - pos
            pos = os.lseek(fd, data, os.SEEK_HOLE)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return holes


def unbacked(store: Store, rm: RankManifest, f: FileRecord) -> str | None:
    """Why file ``f`` of ``rm`` in its step folder of ``store`` holds far fewer bytes than it claims (for the log),
    or None when its claim is backed (or that cannot be told)."""
    if f.compression is not None:
        stored = f.stored_size or 0
        if f.size > COMPRESSION_PROOF_RATIO * stored + HOLE_PROOF_BYTES:
            return f"{stored} bytes that decompress to {f.size}"
        return None
    if store.local_path is None:
        return None
    path = os.path.join(store.local_path, *file_rel(rm.step, f).split("/"))
    holes = hole_bytes(path, f.size)
    if holes > HOLE_PROOF_BYTES:
        return f"a sparse file: more than {holes >> 20} MiB of its {f.size >> 20} MiB are holes"
    return None


def prove_backed(store: Store, rm: RankManifest, indices: Iterable[int]) -> None:
    """Before memory of their sizes is allocated: stream and verify every file of ``indices`` (positions in
    ``rm.files``) whose claimed size is not backed by stored bytes (see the module docstring).

    Raises :class:`~tierckpt.errors.CorruptCheckpointError` naming the file when one does not match its checksum;
    what :func:`.stream.stream_file` raises otherwise."""
    for i in indices:
        f = rm.files[i]
        why = unbacked(store, rm, f)
        if why is None:
            continue
        log.info("step %d, tier %s: %s claims %d bytes but is %s; verifying it before allocating that much", rm.step,
                 store.tier, f.name, f.size, why)
        stream_file(store, rm, i)


__all__ = ["COMPRESSION_PROOF_RATIO", "HOLE_PROOF_BYTES", "hole_bytes", "prove_backed", "unbacked"]
