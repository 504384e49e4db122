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
  against that manifest's checksums as a disk copy's is (:class:`MemoryStore` serves the copy to the ordinary
  reader); anything else falls back to the disk with a log line naming the step, the tier and the path.

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
import hashlib
import io
import json
import logging
import mmap
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from ..errors import CheckpointError, StorageError
from ..format import hashing, layout
from ..format.manifest import RankManifest, StepManifest
from ..host.libc import libc_function
from ..host.memory import HUGE_PAGE, buffer_address
from ..storage import folder_lock
from ..storage.base import Store, WriteStream, join
from ..storage.files import open_regular

if TYPE_CHECKING:
    from collections.abc import Callable

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

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "step": self.step, "save_id": self.save_id, "rank": self.rank, "slot": self.slot,
            "created": self.created, "step_manifest": base64.b64encode(self.step_manifest).decode(),
            "rank_manifest_name": self.rank_manifest_name,
            "rank_manifest": base64.b64encode(self.rank_manifest).decode(),
            "rank_manifest_checksum": hashing.digest(self.rank_manifest).hex(),
            "files": [[f.name, f.offset, f.size, f.checksum] for f in self.files]}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> MemoryCopy:
        """Parse a memory manifest; ``ValueError`` (or ``KeyError``/``TypeError``) if it is not one."""
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown memory manifest format {d.get('format')!r}")
        rank_manifest = base64.b64decode(d["rank_manifest"])
        if hashing.digest(rank_manifest).hex() != d["rank_manifest_checksum"]:
            raise ValueError("the rank manifest does not match its checksum")
        files = tuple(MemoryFile(layout.check_file_name(n), int(o), int(s), str(c)) for n, o, s, c in d["files"])
        return cls(int(d["slot"]), int(d["step"]), str(d["save_id"]), int(d["rank"]),
                   base64.b64decode(d["step_manifest"]), layout.check_file_name(d["rank_manifest_name"]),
                   rank_manifest, files, path, float(d.get("created", 0.0)))


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

    def commit_slot(self, local: Store, index: int, base: int, step: int, file_views: list[memoryview]) -> None:
        """Commit slot ``index`` (its buffer at address ``base``) as the memory copy of ``step``, which the local
        tier has just committed from it; ``file_views``: each data file's bytes in the slot, in part order. A step
        whose files are not the slot's bytes as they are (an incremental step referencing earlier steps) is not
        committed. Never raises: a failure only logs (the save itself succeeded)."""
        from .reader import read_ranks, read_step  # the reader imports nothing of this module

        try:
            folder = layout.step_dir(step)
            manifest = read_step(local, step)
            ref = next(r for r in manifest.ranks if r.rank == self.rank)
            rank_raw = local.read_bytes(join(folder, ref.name), max_size=_MAX_MANIFEST)
            (rm,) = read_ranks(local, manifest, [self.rank])
            files = _slot_files(rm, base, file_views)
            if files is None:
                log.debug("tier memory: step %d is not the slot's bytes as they are (incremental): not committed "
                          "(%s)", step, self.dir)
                return
            raw = local.read_bytes(join(folder, layout.STEP_MANIFEST), max_size=_MAX_MANIFEST)
            copy = MemoryCopy(index, step, manifest.save_id, self.rank, raw, ref.name, rank_raw, files,
                              self.slot_path(index), time.time())
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


class MemoryStore(Store):
    """A committed memory copy as a read-only store holding one step folder, for the ordinary reader (every byte
    hashed and matched against the rank manifest). The slot file is mapped privately (copy on write: nothing here
    ever changes the shared copy). :meth:`staging_buffer` hands the mapping itself to a restore as its staging
    buffer where the files lie at the offsets a restore's buffer would put them; :meth:`readinto` into that same
    memory copies nothing."""

    tier = "memory"
    read_concurrency = 1

    def __init__(self, copy: MemoryCopy, on_close: Callable[[], None] | None = None) -> None:
        self.copy = copy
        self._on_close = on_close
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
        # map every page now, in one call, rather than one fault per 4 KiB page as the reads touch them (read
        # faults only: no page is copied); where the kernel lacks the advice the pages fault in on use
        if _madvise is not None and need:
            _madvise(self._base, need, _MADV_POPULATE_READ)
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
            return self.copy.step_manifest
        if rel == join(self._folder, self.copy.rank_manifest_name):
            return self.copy.rank_manifest
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
        """Unmap (once no view of the mapping is left: a restore's buffer keeps it otherwise until dropped) and give
        the slot back to the pool (idempotent)."""
        self._view = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view still exists: the mapping goes with the last one
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


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
    from ..errors import CheckpointNotFoundError, CorruptCheckpointError
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
            store = MemoryStore(copy, on_close=release)
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


__all__ = ["MemoryCopy", "MemoryStore", "MemoryTier", "job_copies", "job_dir", "open_tier", "reclaim_stale",
           "shm_root", "steps_in_memory", "try_memory"]
