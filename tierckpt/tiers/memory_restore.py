"""The restore side of the memory tier (:mod:`.memory`): a committed memory copy served as a read-only store to the
ordinary reader (:class:`MemoryStore`), and the choice between it and the local disk (:func:`try_memory`).

A memory copy of an incremental step (one whose rank manifest references earlier steps' files) holds the slot's
bytes as the snapshot laid them out, not the step's files: its memory manifest carries, besides the rank manifest
the local tier committed, a *slot manifest* describing the slot's files (the same tensors, the same checksums, at
their offsets in the slot; :func:`tierckpt.tiers.memory.slot_manifest`). A restore serves it only after checking
that it describes the very tensors of the committed rank manifest (name, path, dtype, shape, size, checksum, shard;
the same tree and metadata), so every byte it loads is still verified against the checksums the local tier
committed (:func:`served_manifest`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import logging
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, BinaryIO

from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..format import hashing, layout
from ..format.manifest import RankManifest, StepManifest
from ..host.memory import buffer_address
from ..storage.base import Store, WriteStream, join
from ..storage.files import open_regular
from .memory import _MADV_POPULATE_READ, MemoryCopy, MemoryFile, MemoryTier, _madvise, same_tensor

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)


class MemoryStore(Store):
    """A committed memory copy as a read-only store holding one step folder, for the ordinary reader (every byte
    hashed and matched against the rank manifest). The slot file is mapped privately (copy on write: nothing here
    ever changes the shared copy). :meth:`staging_buffer` hands the mapping itself to a restore as its staging
    buffer where the files lie at the offsets a restore's buffer would put them; :meth:`readinto` into that same
    memory copies nothing."""

    tier = "memory"
    read_concurrency = 1

    def __init__(self, copy: MemoryCopy, on_close: Callable[[], None] | None = None, *,
                 manifest: StepManifest | None = None) -> None:
        """``manifest``: the step manifest served (default: the one the local tier committed, as the copy holds
        it); the copy's slot manifest, where it has one, is served as the rank manifest (:func:`served_manifest`)."""
        self.copy = copy
        self._on_close = on_close
        self._step_manifest = copy.step_manifest if manifest is None else manifest.to_bytes()
        self._rank_manifest = copy.slot_manifest or copy.rank_manifest
        self.url = copy.path
        self._folder = layout.step_dir(copy.step)
        fd = open_regular(copy.path, os.O_RDONLY, tier="memory")
        try:
            size = os.fstat(fd).st_size
            need = max((f.offset + f.size for f in copy.files), default=0)
            if size < need:
                raise OSError(f"the slot file holds {size} bytes, its manifest needs {need}")
            self._map = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view: memoryview | None = memoryview(self._map)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        # the pages are mapped chunk by chunk as the reader reaches them (:meth:`readinto`), on its io threads, so
        # that mapping one chunk overlaps hashing the one before and the files map in parallel
        self._files = {join(self._folder, f.name): f for f in copy.files}
        offsets, total = [], 0
        for f in copy.files:
            offsets.append(total)
            total += -(-f.size // 4096) * 4096
        if offsets != [f.offset for f in copy.files] or total > size:
            self._map.close()
            raise OSError("the files do not lie where a restore's buffer puts them")

    def staging_buffer(self, n: int) -> memoryview | None:
        """The mapping's first ``n`` bytes (the files at the offsets of reader.buffer_layout), to serve as a
        restore's staging buffer; None once closed or where ``n`` is larger than the slot."""
        if self._view is None or n > len(self._map):
            return None
        return self._view[:n]

    def _small(self, rel: str) -> bytes | None:
        if rel == join(self._folder, layout.STEP_MANIFEST):
            return self._step_manifest
        if rel == join(self._folder, self.copy.rank_manifest_name):
            return self._rank_manifest
        return None

    def list(self, rel: str = "") -> list[str]:
        if rel in ("", "."):
            return [self._folder]
        if rel.strip("/") == self._folder:
            return [layout.STEP_MANIFEST, self.copy.rank_manifest_name, *(f.name for f in self.copy.files)]
        return []

    def exists(self, rel: str) -> bool:
        return rel == self._folder or self._small(rel) is not None or rel in self._files

    def size(self, rel: str) -> int:
        small = self._small(rel)
        if small is not None:
            return len(small)
        if rel in self._files:
            return self._files[rel].size
        raise FileNotFoundError(rel)

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        small = self._small(rel)
        if small is None:
            f = self._file(rel)
            small = bytes(self._map[f.offset : f.offset + min(f.size, max_size + 1)])
        if len(small) > max_size:
            raise CheckpointError(f"file larger than {max_size} bytes", tier=self.tier, path=f"{self.url}/{rel}")
        return small

    def _file(self, rel: str) -> MemoryFile:
        try:
            return self._files[rel]
        except KeyError:
            raise FileNotFoundError(rel) from None

    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        f = self._file(rel)
        n = max(0, min(buf.nbytes, f.size - offset))
        if n == 0:
            return 0
        src = self._base + f.offset + offset
        if _madvise is not None:  # map the chunk's pages in one call (read faults only: no page is copied), rather
            # than one fault per few pages as the hash or the copy touch them; without the advice they fault in on use
            start = src - src % mmap.PAGESIZE
            _madvise(start, src + n - start, _MADV_POPULATE_READ)
        dst = buffer_address(buf)
        if dst == src:  # the restore's buffer is this mapping: the bytes are where they are read to
            return n
        if dst is None:
            buf[:n] = self._map[f.offset + offset : f.offset + offset + n]
        else:
            ctypes.memmove(dst, src, n)
        return n

    def open_read(self, rel: str) -> BinaryIO:
        f = self._file(rel)
        return io.BytesIO(self._map[f.offset : f.offset + f.size])

    def makedirs(self, rel: str) -> None:
        raise self._read_only(rel)

    def open_write(self, rel: str, *, size_hint: int | None = None) -> WriteStream:
        raise self._read_only(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        raise self._read_only(rel)

    def remove(self, rel: str) -> None:
        raise self._read_only(rel)

    def _read_only(self, rel: str) -> StorageError:
        return StorageError("the memory tier is read-only here", tier=self.tier, path=f"{self.url}/{rel}",
                            transient=False)

    def close(self) -> None:
        """Give the slot back to the pool and unmap the copy on a thread of its own (:func:`_unmap`), once no view
        of the mapping is left (a restore's buffer is dropped right after the restore): unmapping a GiB of 4 KiB
        pages takes about 0.1 s, which the caller need not wait for (idempotent)."""
        if self._view is not None:
            self._view = None
            threading.Thread(target=_unmap, args=(self._map,), name="tierckpt-unmap", daemon=True).start()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


#: The longest :func:`_unmap` waits for the last view of a mapping to go; past it, the mapping goes with that view.
UNMAP_WAIT_S = 60.0


def _unmap(m: mmap.mmap) -> None:
    """Close ``m`` as soon as nothing exports its memory any more (polled, backing off to 50 ms)."""
    deadline = time.monotonic() + UNMAP_WAIT_S
    delay = 0.001
    while True:
        try:
            m.close()
            return
        except BufferError:  # a view still exists
            if time.monotonic() > deadline:
                return
            time.sleep(delay)
            delay = min(2 * delay, 0.05)


def served_manifest(copy: MemoryCopy, disk: StepManifest, src: int) -> StepManifest:
    """The step manifest a restore from ``copy`` reads: ``disk`` (the local tier's, whose reference to rank ``src``
    names ``copy``'s rank manifest, checked by the caller) where the slot holds the step's own files; for a copy
    with a slot manifest (an incremental step), ``disk`` naming the slot manifest instead, without references, once
    the slot manifest is found to describe exactly the committed rank manifest's tensors (each record's name, path,
    dtype, shape, size, checksum and shard; the same step, rank, save, tree and metadata; no reference, no
    compression): the reader then verifies the slot's bytes against checksums the local tier committed. Raises
    :class:`CorruptCheckpointError` where it does not."""
    if not copy.slot_manifest:
        return disk
    where = copy.path
    committed = RankManifest.from_bytes(copy.rank_manifest, step=disk.step, path=where)
    slot = RankManifest.from_bytes(copy.slot_manifest, step=disk.step, path=where)
    same = ((slot.step, slot.rank, slot.world_size, slot.save_id, slot.tree, slot.metadata)
            == (committed.step, committed.rank, committed.world_size, committed.save_id, committed.tree,
                committed.metadata)
            and len(slot.tensors) == len(committed.tensors)
            and all(same_tensor(a, b) for a, b in zip(slot.tensors, committed.tensors))
            and not any(f.in_step is not None or f.compression for f in slot.files)
            and [f.name for f in slot.files] == [f.name for f in copy.files])
    if not same:
        raise CorruptCheckpointError("the slot manifest does not describe the committed rank manifest's tensors",
                                     step=disk.step, tier=MemoryStore.tier, path=where)
    refs = tuple(dataclasses.replace(r, size=len(copy.slot_manifest), checksum=hashing.digest(copy.slot_manifest).hex())
                 if r.rank == src else r for r in disk.ranks)
    return dataclasses.replace(disk, ranks=refs, refs=(), shared_bytes=0)


def try_memory(memory: MemoryTier, local: Store, step: int, given: StepManifest | None,
               load: Callable[[MemoryStore, StepManifest], object], src: int,
               hold: Callable[[int], Callable[[], None] | None], *, what: str = "restore") -> object | None:
    """``load(store, manifest)`` from this rank's memory copy of ``step`` (the step already chosen from the local
    tier), where there is one of the same save as the local copy; None (logged: step, tier, path) where there is
    none, it is of another save, or it fails verification, so that the caller reads the local disk. What ``load``
    raises for any other reason (a state that does not match the checkpoint) is raised. ``hold(slot)`` keeps saves
    of this process off the slot until the store is closed (None: a save holds it). ``load`` must close the store
    once done with its bytes (a restore's staging buffer does, on release); it is closed here if ``load`` raises.
    ``what``: the caller, in the log lines (``"restore"`` or ``"load"``)."""
    from ..errors import CheckpointNotFoundError
    from .reader import read_step

    copy = memory.find(step)
    if copy is None:
        log.info("%s: step %d is not in tier memory (%s): reading the local disk", what, step, memory.dir)
        return None
    try:
        disk = given if given is not None else read_step(local, step)
        ref = next((r for r in disk.ranks if r.rank == src), None)
        if ref is None or src != memory.rank or ref.name != copy.rank_manifest_name \
                or ref.checksum != hashing.digest(copy.rank_manifest).hex():
            log.warning("%s: step %d in tier memory (%s) is another save than the local copy: reading the "
                        "local disk", what, step, copy.path)
            return None
        release = hold(copy.slot)
        if release is None:
            log.info("%s: step %d in tier memory (%s) is being overwritten by a save: reading the local disk",
                     what, step, copy.path)
            return None
        try:
            disk = served_manifest(copy, disk, src)
            store = MemoryStore(copy, on_close=release, manifest=disk if copy.slot_manifest else None)
        except BaseException:
            release()
            raise
    except (OSError, CheckpointError, StopIteration) as exc:
        log.warning("%s: step %d in tier memory (%s) cannot be read (%s): reading the local disk", what, step,
                    copy.path, exc)
        return None
    try:
        out = load(store, disk)
    except (CorruptCheckpointError, CheckpointNotFoundError, StorageError, OSError) as exc:
        store.close()
        log.warning("%s: step %d in tier memory (%s) is corrupt or incomplete (%s; files: %s): reading the "
                    "local disk", what, step, copy.path, exc, ", ".join(getattr(exc, "bad_files", ())) or "?")
        return None
    except BaseException:
        store.close()
        raise
    log.info("%s: step %d from tier memory (%s)", what, step, copy.path)
    memory.restored.append(step)
    return out


__all__ = ["MemoryStore", "served_manifest", "try_memory"]
