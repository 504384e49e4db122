"""The memory tier: the staging slots of a rank live in shared memory that outlives the process, so a restart after a
crash on a healthy node restores the newest local step from memory instead of reading it from disk.

Where: ``<root>/tierckpt-<h>/rank-<r>/`` with ``<root>`` ``/dev/shm`` (or ``$TIERCKPT_SHM_DIR``) and ``<h>`` a hash
of the real path of the job's local folder. Each staging slot ``i`` is the file ``slot-<i>`` there, mapped
``MAP_SHARED`` as the slot's buffer (:meth:`MemoryTier.map_slot`, called by
:class:`~tierckpt.snapshot.staging.StagingPool`); its space is reserved with ``posix_fallocate`` so that a full
tmpfs fails the allocation (the slot then falls back to private memory) instead of killing the copy with SIGBUS.

Commit protocol of one slot (invariants):

- the slot's memory manifest ``slot-<i>.manifest.json`` is removed before anything may write the slot (the pool
  calls :meth:`MemoryTier.invalidate` whenever it hands the slot out or grows it): a copy that a crash or the next
  save tears is never committed, so never chosen;
- it is written (temporary name, then a rename; tmpfs needs no fsync) only once the step the slot holds is committed
  on the local disk (:meth:`MemoryTier.commit_slot`, from the persist thread, before the slot is released): the
  memory copy only ever holds a step the local tier also holds, and the ranks' agreement on the step to restore
  never depends on it;
- a restore uses it only for the step already chosen from the local tier, and only if its rank manifest is the one
  the local ``manifest.json`` names (the same save, checked by checksum), and every byte it loads is verified
  against that manifest's checksums as a disk copy's is (:class:`~.memory_restore.MemoryStore` serves the copy to
  the ordinary reader); anything else falls back to the disk with a log line naming the step, the tier and the path;
- an incremental step (its files reference earlier steps, so they are not the slot's images) is committed with a
  *slot manifest* (:func:`slot_manifest`): the committed tensor records at their places in the slot, so that the
  restore verifies the slot's bytes against the checksums the local tier committed
  (:func:`~.memory_restore.served_manifest`).

Lifetime: the rank's folder is locked (:mod:`tierckpt.storage.folder_lock`) while a manager uses it.
``close()`` of the manager removes it (a job that finished needs no memory copy); a crashed process leaves it, and
the next manager of the same local folder on the node adopts it. A tier no live process holds whose local folder
is gone, or that nobody adopted for :data:`STALE_AFTER_S`, is removed by the next manager that opens a memory tier
on the node. At most the staging buffers' memory: one file per slot, of the slot's size.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CheckpointError, StorageError
from ..format import hashing, layout
from ..format.manifest import FileRecord, RankManifest
from ..format.tensors import TensorRecord
from ..host.libc import libc_function
from ..host.memory import HUGE_PAGE, buffer_address
from ..storage import folder_lock
from ..storage.base import Store, join
from ..storage.files import open_regular
from .incremental import shard_key

if TYPE_CHECKING:
    from .writer import LeafMeta, StagedFile

log = logging.getLogger(__name__)

_madvise = (libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
            if sys.platform.startswith("linux") else None)
#: ``madvise`` advice (Linux 5.14+): fault a range's pages in for reading, without copying a private mapping's
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

#: Environment variable naming the shared-memory folder (default ``/dev/shm``).
ROOT_ENV = "TIERCKPT_SHM_DIR"
DEFAULT_ROOT = "/dev/shm"
JOB_PREFIX = "tierckpt-"
#: A tier no process holds is kept this long after its last use for a restart of its job, then reclaimed by the next
#: job that opens a memory tier on the node (at once if its local folder is gone).
STALE_AFTER_S = 600.0
#: Version of the memory manifest.
FORMAT = 1
_MANIFEST_SUFFIX = ".manifest.json"
_OWNER = "owner.json"
_MAX_MANIFEST = 64 << 20


def shm_root() -> str:
    """The folder the memory tiers of this node live in."""
    return os.environ.get(ROOT_ENV) or DEFAULT_ROOT


def job_dir(local_root: str, root: str | None = None) -> str:
    """The memory tier folder of the job whose local folder is ``local_root`` (every rank of the node shares it)."""
    key = hashlib.sha256(os.path.realpath(local_root).encode()).hexdigest()[:16]
    return os.path.join(root or shm_root(), JOB_PREFIX + key)


@dataclass(frozen=True)
class MemoryFile:
    """One data file of a memory copy: its name, where its bytes start in the slot, its size and checksum."""

    name: str
    offset: int
    size: int
    checksum: str


@dataclass(frozen=True)
class MemoryCopy:
    """A committed memory copy: the step a slot holds (see the module docstring)."""

    slot: int
    step: int
    save_id: str
    rank: int
    #: the step's ``manifest.json`` as the local tier committed it, and this rank's manifest (name and bytes)
    step_manifest: bytes
    rank_manifest_name: str
    rank_manifest: bytes
    files: tuple[MemoryFile, ...]
    #: the slot file
    path: str
    created: float = 0.0
    #: an incremental step's slot manifest (the slot's files as a rank manifest, :func:`slot_manifest`); empty where
    #: the slot's files are the step's own
    slot_manifest: bytes = b""

    def to_bytes(self) -> bytes:
        d = {"format": FORMAT, "step": self.step, "save_id": self.save_id, "rank": self.rank, "slot": self.slot,
             "created": self.created, "step_manifest": base64.b64encode(self.step_manifest).decode(),
             "rank_manifest_name": self.rank_manifest_name,
             "rank_manifest": base64.b64encode(self.rank_manifest).decode(),
             "rank_manifest_checksum": hashing.digest(self.rank_manifest).hex(),
             "files": [[f.name, f.offset, f.size, f.checksum] for f in self.files]}
        if self.slot_manifest:
            d["slot_manifest"] = base64.b64encode(self.slot_manifest).decode()
            d["slot_manifest_checksum"] = hashing.digest(self.slot_manifest).hex()
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> MemoryCopy:
        """Parse a memory manifest; ``ValueError`` (or ``KeyError``/``TypeError``) if it is not one."""
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown memory manifest format {d.get('format')!r}")
        rank_manifest = base64.b64decode(d["rank_manifest"])
        if hashing.digest(rank_manifest).hex() != d["rank_manifest_checksum"]:
            raise ValueError("the rank manifest does not match its checksum")
        slot = base64.b64decode(d.get("slot_manifest", ""))
        if slot and hashing.digest(slot).hex() != d["slot_manifest_checksum"]:
            raise ValueError("the slot manifest does not match its checksum")
        files = tuple(MemoryFile(layout.check_file_name(n), int(o), int(s), str(c)) for n, o, s, c in d["files"])
        return cls(int(d["slot"]), int(d["step"]), str(d["save_id"]), int(d["rank"]),
                   base64.b64decode(d["step_manifest"]), layout.check_file_name(d["rank_manifest_name"]),
                   rank_manifest, files, path, float(d.get("created", 0.0)), slot)


class MemoryTier:
    """One rank's memory tier on this node (see the module docstring). Use :func:`open_tier`."""

    def __init__(self, local_root: str, rank: int, *, root: str | None = None) -> None:
        self.local_root = os.path.realpath(local_root)
        self.rank = rank
        self.job_dir = job_dir(self.local_root, root)
        self.dir = os.path.join(self.job_dir, f"rank-{rank}")
        parent = os.path.dirname(self.job_dir)
        reclaim_stale(parent, keep=self.job_dir)
        for d in (self.job_dir, self.dir):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(d)
            if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid():
                raise StorageError("the memory tier's folder is not a folder of this user", tier="memory", path=d,
                                   transient=False)
        self._lock = folder_lock.acquire(self.dir, rank)
        self._write_small(os.path.join(self.job_dir, _OWNER),
                          json.dumps({"local": self.local_root, "pid": os.getpid(), "time": time.time()}).encode())
        self.closed = False
        #: the steps restored from this tier by this process, in order (diagnostics and tests)
        self.restored: list[int] = []

    # ---------------------------------------------------------------------------------------------- slots
    def slot_path(self, index: int) -> str:
        return os.path.join(self.dir, f"slot-{index}")

    def manifest_path(self, index: int) -> str:
        return self.slot_path(index) + _MANIFEST_SUFFIX

    def map_slot(self, index: int, size: int) -> memoryview:
        """Slot ``index``'s file, ``size`` bytes reserved (``posix_fallocate``), mapped shared and writable.
        Invalidates the slot's copy first. Raises ``OSError`` where the space cannot be had (a full tmpfs)."""
        self.invalidate(index)
        fd = open_regular(self.slot_path(index), os.O_RDWR | os.O_CREAT, 0o600, tier="memory")
        try:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)
            whole = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if _madvise is not None and size >= HUGE_PAGE:  # huge pages where the kernel gives them to shmem
                _madvise(ctypes.addressof(ctypes.c_char.from_buffer(whole)), size - size % HUGE_PAGE,
                         _MADV_HUGEPAGE)
        except OSError:
            os.close(fd)
            self._remove(self.slot_path(index))
            raise
        os.close(fd)
        return memoryview(whole)[:size]

    def invalidate(self, index: int) -> None:
        """Remove slot ``index``'s memory manifest: what the slot holds is no longer a committed copy."""
        self._remove(self.manifest_path(index))

    def commit_slot(self, local: Store, index: int, base: int, step: int, file_views: list[memoryview], *,
                    staged: tuple[list[StagedFile], list[LeafMeta]] | None = None) -> None:
        """Commit slot ``index`` (its buffer at address ``base``) as the memory copy of ``step``, which the local
        tier has just committed from it; ``file_views``: each data file's bytes in the slot, in part order.
        ``staged``: the snapshot's files and tensors, so that a step whose files are not the slot's bytes as they
        are (an incremental step referencing earlier steps) is committed with a slot manifest
        (:func:`slot_manifest`); without it such a step is not committed. Never raises: a failure only logs (the
        save itself succeeded)."""
        from .reader import read_ranks, read_step  # the reader imports nothing of this module

        try:
            folder = layout.step_dir(step)
            manifest = read_step(local, step)
            ref = next(r for r in manifest.ranks if r.rank == self.rank)
            rank_raw = local.read_bytes(join(folder, ref.name), max_size=_MAX_MANIFEST)
            (rm,) = read_ranks(local, manifest, [self.rank])
            files = _slot_files(rm, base, file_views)
            slot_raw = b""
            if files is None:
                made = None if staged is None else slot_manifest(rm, base, *staged)
                if made is None:
                    log.info("tier memory: step %d is not the slot's bytes as they are: not committed (%s)", step,
                             self.dir)
                    return
                files, slot_raw = made
            raw = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=_MAX_MANIFEST)
            copy = MemoryCopy(index, step, manifest.save_id, self.rank, raw, ref.name, rank_raw, files,
                              self.slot_path(index), time.time(), slot_raw)
            self._write_small(self.manifest_path(index), copy.to_bytes())
        except Exception as exc:  # noqa: BLE001 - the memory copy is an optimisation: the save stands
            log.warning("tier memory: step %d not committed in %s: %s", step, self.dir, exc)
            return
        log.debug("tier memory: step %d committed in %s", step, self.slot_path(index))

    # ---------------------------------------------------------------------------------------------- reading
    def copies(self) -> dict[int, MemoryCopy]:
        """The committed memory copies of this rank, by step (a manifest that cannot be parsed is left out)."""
        return read_copies(self.dir)

    def find(self, step: int) -> MemoryCopy | None:
        return self.copies().get(step)

    def close(self, *, remove: bool = True) -> None:
        """Release the tier; with ``remove`` delete its files (the memory goes once nothing maps it)."""
        if self.closed:
            return
        self.closed = True
        try:
            if remove:
                shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            folder_lock.release(self._lock)
        if remove and not _live_ranks(self.job_dir):
            _remove_job(self.job_dir)

    # ---------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    @staticmethod
    def _write_small(path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, tier="memory")
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)


def _slot_files(rm: RankManifest, base: int, file_views: list[memoryview]) -> tuple[MemoryFile, ...] | None:
    """Each data file of the rank manifest with its offset in the slot, or None where a file is not the slot's
    image of the same part (a reference into an earlier step, another size)."""
    if len(rm.files) != len(file_views):
        return None
    out = []
    for f, view in zip(rm.files, file_views):
        addr = buffer_address(view)
        if f.in_step is not None or f.compression is not None or addr is None or view.nbytes != f.size:
            return None
        out.append(MemoryFile(f.name, addr - base, f.size, f.checksum))
    return tuple(out)


def same_tensor(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether two records describe the same tensor with the same bytes (wherever they are stored)."""
    return (a.index, a.name, a.path, a.dtype, tuple(a.shape), a.nbytes, a.checksum, a.kind, shard_key(a.shard)) == \
        (b.index, b.name, b.path, b.dtype, tuple(b.shape), b.nbytes, b.checksum, b.kind, shard_key(b.shard))


def slot_manifest(rm: RankManifest, base: int, files: list[StagedFile],
                  leaves: list[LeafMeta]) -> tuple[tuple[MemoryFile, ...], bytes] | None:
    """The slot's files (each staged file's image, header included, at its offset in the slot) and a rank
    manifest of them, for the memory copy of ``rm``, a step whose files are not the slot's images (incremental):
    the tensor records of ``rm`` with their place in the slot, each file's checksum made of its header's digest
    and those records' checksums (docs/format.md section 7), no references. A restore verifies the slot's bytes
    against it (:func:`.memory_restore.served_manifest` checks first that it describes ``rm``'s tensors). None where
    the snapshot does not match ``rm`` tensor for tensor, or a file is not in the slot."""
    if len(rm.tensors) != len(leaves):
        return None
    index = {f.part: k for k, f in enumerate(files)}
    tensors = []
    for rec, m in zip(rm.tensors, leaves):
        if m.part not in index:
            return None
        mine = TensorRecord(rec.index, m.name, m.path, m.dtype, tuple(m.shape), index[m.part], m.offset, m.nbytes,
                            rec.checksum, m.kind, m.shard)
        if not rec.checksum or not same_tensor(rec, mine):
            return None
        tensors.append(mine)
    records, placed = [], []
    for f in files:
        addr = buffer_address(f.data)
        if addr is None or addr < base:
            return None
        name = layout.data_file_name(rm.rank, f.part, rm.save_id)
        digests = [hashing.digest(f.data[: f.data_start])] + [bytes.fromhex(tensors[i].checksum) for i in f.leaves]
        checksum = hashing.file_checksum(digests)
        records.append(FileRecord(name=name, size=f.data.nbytes, checksum=checksum, data_start=f.data_start))
        placed.append(MemoryFile(name, addr - base, f.data.nbytes, checksum))
    slot = dataclasses.replace(rm, files=tuple(records), tensors=tuple(tensors))
    return tuple(placed), slot.to_bytes()


def read_copies(folder: str) -> dict[int, MemoryCopy]:
    """The committed memory copies in a rank's memory tier folder, by step (the newest slot's for a step held
    twice)."""
    out: dict[int, MemoryCopy] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        if not (name.startswith("slot-") and name.endswith(_MANIFEST_SUFFIX)):
            continue
        path = os.path.join(folder, name)
        try:
            fd = open_regular(path, os.O_RDONLY, tier="memory")
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    raw = f.read(_MAX_MANIFEST + 1)
            finally:
                os.close(fd)
            copy = MemoryCopy.from_bytes(raw, path[: -len(_MANIFEST_SUFFIX)])
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
            log.warning("tier memory: ignoring %s: %s", path, exc)
            continue
        if copy.step not in out or copy.created > out[copy.step].created:
            out[copy.step] = copy
    return out


def job_copies(local_root: str, root: str | None = None) -> dict[int, dict[int, MemoryCopy]]:
    """Every rank's committed memory copies of the job whose local folder is ``local_root``: rank -> step -> copy
    (for ``tierckpt ls``)."""
    jd = job_dir(local_root, root)
    out: dict[int, dict[int, MemoryCopy]] = {}
    try:
        names = os.listdir(jd)
    except OSError:
        return out
    for name in names:
        if name.startswith("rank-") and name[5:].isdigit():
            found = read_copies(os.path.join(jd, name))
            if found:
                out[int(name[5:])] = found
    return out


def steps_in_memory(local_root: str, root: str | None = None) -> dict[int, list[int]]:
    """step -> the ranks whose committed memory copy of it this node holds, for the job whose local folder is
    ``local_root`` (``tierckpt ls``); empty where there is none or it cannot be read."""
    out: dict[int, list[int]] = {}
    for rank, copies in sorted(job_copies(local_root, root).items()):
        for step in copies:
            out.setdefault(step, []).append(rank)
    return out


def _live_ranks(jd: str) -> bool:
    """Whether a live process holds a rank folder of job folder ``jd``."""
    try:
        names = os.listdir(jd)
    except OSError:
        return False
    return any(folder_lock.held_by_other(os.path.join(jd, n), int(n[5:]))
               for n in names if n.startswith("rank-") and n[5:].isdigit())


def _last_change(jd: str) -> float:
    """When anything in job folder ``jd`` or its rank folders last changed (a commit renames a manifest there)."""
    newest = 0.0
    for d in [jd, *(os.path.join(jd, n) for n in os.listdir(jd) if n.startswith("rank-"))]:
        with contextlib.suppress(OSError):
            newest = max(newest, os.stat(d).st_mtime)
    return newest


def _remove_job(jd: str) -> None:
    try:
        names = os.listdir(jd)
    except OSError:
        return
    if not any(n.startswith("rank-") for n in names):
        shutil.rmtree(jd, ignore_errors=True)


def reclaim_stale(parent: str, *, keep: str | None = None, now: float | None = None) -> list[str]:
    """Remove the memory tiers under ``parent`` that no live process holds and whose local folder is gone or whose
    owner record is older than :data:`STALE_AFTER_S` (``keep``: a job folder never removed); returns their paths.
    Only folders of this user are touched."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        jd = os.path.join(parent, name)
        if not name.startswith(JOB_PREFIX) or jd == keep:
            continue
        try:
            st = os.lstat(jd)
            if not os.path.isdir(jd) or os.path.islink(jd) or st.st_uid != os.getuid():
                continue
            try:
                with open(os.path.join(jd, _OWNER), "rb") as f:
                    owner = json.loads(f.read(1 << 16))
                local, last = str(owner.get("local", "")), float(owner.get("time", 0.0))
            except (OSError, ValueError, TypeError, AttributeError):
                local, last = "", st.st_mtime
            last = max(last, _last_change(jd))
            if _live_ranks(jd):
                continue
            if local and os.path.isdir(local) and now - last < STALE_AFTER_S:
                continue
        except OSError:
            continue
        shutil.rmtree(jd, ignore_errors=True)
        log.info("tier memory: reclaimed the stale memory tier %s (local folder %s)", jd, local or "?")
        removed.append(jd)
    return removed


def open_tier(local_root: str, rank: int) -> MemoryTier | None:
    """The rank's memory tier, or None (logged) where shared memory cannot be had here."""
    try:
        return MemoryTier(local_root, rank)
    except (OSError, CheckpointError) as exc:
        log.warning("tier memory: unavailable under %s (%s): saves and restores use the local disk only",
                    shm_root(), exc)
        return None


__all__ = ["FORMAT", "MemoryCopy", "MemoryFile", "MemoryTier", "job_copies", "job_dir", "open_tier", "reclaim_stale",
           "same_tensor", "shm_root", "slot_manifest", "steps_in_memory"]
