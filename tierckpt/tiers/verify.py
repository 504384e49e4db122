"""Verification of committed steps without loading them: stream every file, hash, compare with the manifests.

Used by ``tierckpt verify`` and by :meth:`CheckpointManager.restore` to pick the newest intact step. Memory stays
bounded (one chunk buffer per thread) whatever the checkpoint's size. Reports name every bad file; leftovers of
crashed saves are reported separately and are never counted as corruption.

A copy's shard index (``shards-<save id>.json``, :mod:`tierckpt.format.shard_index`), where it has one, is read once
(its size, its head, its blocks a few MiB at a time: O(index size)) and checked against the copy's
``manifest.json``: sealed, as long as its head says, each block's references those of the manifest, its meshes the
ranks' coordinates. A damaged or stale index is a bad file of the step like any other, though the step still
restores (from ``manifest.json``): deleting the index is a safe repair.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StorageAccessError, StorageError
from ..format import layout, shard_index
from ..format.manifest import RankManifest, StepManifest, file_rel
from ..storage.base import Store
from ..storage.commit import read_step_manifest
from ..storage.failures import with_deadline
from . import reader
from .listing import RootListing as RootListing  # the root's listing, imported from here too
from .listing import list_root as list_root
from .reader import read_manifests
from .sharded import index_head
from .stream import stream_file

T = TypeVar("T")


@dataclass
class StepReport:
    step: int
    ok: bool
    bytes: int = 0
    created: float | None = None
    world_size: int | None = None
    #: ranks whose shards this copy holds (all of them but on a node-local copy of a multi-rank step)
    ranks: list[int] = field(default_factory=list)
    bad_files: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    extra_files: list[str] = field(default_factory=list)
    #: the name of the copy's shard index, checked (None: the copy has none, or only some ranks were verified)
    index: str | None = None
    #: the step stopped being committed while it was checked (deleted by a live job's retention, or replaced
    #: by another save): not a finding about it, so ``ok`` stays True
    removed: bool = False

    def to_json(self) -> dict:
        return {
            "step": self.step, "ok": self.ok, "bytes": self.bytes, "created": self.created,
            "world_size": self.world_size, "ranks": self.ranks, "bad_files": self.bad_files, "errors": self.errors,
            "extra_files": self.extra_files, "removed": self.removed, "index": self.index,
        }


def verify_file(store: Store, rm: RankManifest, index: int, progress: Callable[[int], None] | None = None) -> None:
    """Stream data file ``index`` of ``rm`` and match it against the manifest (:func:`.stream.stream_file`);
    ``progress(n)`` gets the bytes read as they go (a compressed file's stored size once it is checked).

    Raises :class:`CorruptCheckpointError` naming the file when it is short, damaged or does not match."""
    f = rm.files[index]
    if f.compression:
        stream_file(store, rm, index, chunk=reader.READ_CHUNK)
        if progress:
            progress(f.stored_size or f.size)
        return
    # bounded memory: at most read_concurrency + 1 chunk buffers (one on a local disk); bytes past the recorded
    # size are not looked for (the restore checks every file's size before it reads)
    stream_file(store, rm, index, chunk=reader.READ_CHUNK, exact=False,
                sink=None if progress is None else (lambda view: progress(len(view))))


def verify_step(
    store: Store,
    step: int,
    *,
    executor: Executor | None = None,
    ranks: list[int] | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int = 4,
    deadline_s: float | None = None,
    seen_committed: bool = False,
) -> StepReport:
    """Check one committed step completely; never raises for corruption, reports it. Files are checked on
    ``executor``, or ``threads`` at a time; each is read with its store's ``read_concurrency`` reads in
    flight.

    A step that stops being committed while it is checked (a live job's retention deletes it: its
    ``manifest.json`` vanishes, the folder is renamed to ``.trash-``, or another save replaces it) is reported
    with ``removed`` set and ``ok`` True, not as corrupt: every failed check is followed by a look at whether
    the step is still the one that was checked. ``seen_committed``: the caller saw the step committed (a
    listing), so a ``manifest.json`` that is already gone when read also means removed. ``deadline_s``: the
    manifest reads are retried on transient failures for at most that long
    (:func:`~tierckpt.storage.failures.with_deadline`; None: as the store does).

    Raises :class:`~tierckpt.errors.StorageError` when the storage cannot be read (unreachable, silent,
    access denied) and the step is still there: that is not a finding about the step."""
    report = StepReport(step=step, ok=False)
    try:
        manifest, rms = _bounded(store, step, deadline_s, lambda: read_manifests(store, step, ranks=ranks))
    except CheckpointNotFoundError as exc:
        if seen_committed and not _still_committed(store, step, None, deadline_s):
            return _removed(report)
        report.errors.append(str(exc))
        return report
    except CorruptCheckpointError as exc:
        if not _still_committed(store, step, None, deadline_s):
            return _removed(report)
        report.bad_files = exc.bad_files or [layout.STEP_MANIFEST]
        report.errors.append(str(exc))
        return report
    report.bytes, report.created, report.world_size = manifest.total_bytes, manifest.created, manifest.world_size
    report.ranks = [rm.rank for rm in rms]
    own = executor is None
    pool = executor or ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-verify")
    failures: list[StorageError] = []
    try:
        jobs = [(rm, i) for rm in rms for i in range(len(rm.files))]

        def check(job: tuple[RankManifest, int]) -> str | StorageError | None:
            rm, i = job
            try:
                verify_file(store, rm, i, progress)
            except CorruptCheckpointError as exc:
                return str(exc)
            except StorageError as exc:  # could not read: not a finding about the file
                return exc
            except PermissionError as exc:
                return StorageAccessError(f"read: access denied ({exc})", tier=store.tier,
                                          path=f"{store.url}/{file_rel(step, rm.files[i])}",
                                          step=step, transient=False)
            except OSError as exc:  # a missing file, a disk's read error: the file cannot be restored
                return f"{rm.files[i].name}: unreadable: {exc}"
            return None

        for (rm, i), err in zip(jobs, pool.map(check, jobs)):
            if isinstance(err, StorageError):
                failures.append(err)
            elif err is not None:
                report.bad_files.append(rm.files[i].name)
                report.errors.append(err)
        if ranks is None:  # the whole copy: its index too (verifying some ranks checks what their restore reads)
            try:
                report.index = check_index(store, manifest)
            except StorageError as exc:
                failures.append(exc)
            except CorruptCheckpointError as exc:
                name = shard_index.index_name(manifest.save_id)
                report.index = name
                report.bad_files.append(name)
                report.errors.append(f"{exc}; the step still restores (from manifest.json, as without an index), "
                                     f"and deleting {name} is a safe repair")
    finally:
        if own:
            pool.shutdown()
    if (failures or report.errors) and not _still_committed(store, step, manifest.save_id, deadline_s):
        return _removed(report)
    if failures:
        raise failures[0]
    report.extra_files = _extra_files(store, manifest, rms if ranks is None else None)
    report.ok = not report.bad_files and not report.errors
    return report


def _bounded(store: Store, step: int, deadline_s: float | None, fn: Callable[[], T]) -> T:
    """``fn()``, a manifest read of ``step``: with retries for at most ``deadline_s`` seconds unless None."""
    if deadline_s is None:
        return fn()
    return with_deadline(fn, deadline_s=deadline_s, what="read manifest of", tier=store.tier,
                         url=f"{store.url}/{layout.step_dir(step)}")


def _still_committed(store: Store, step: int, save_id: str | None, deadline_s: float | None) -> bool:
    """Whether ``step`` is committed in ``store`` now (by save ``save_id``, unless None): its
    ``manifest.json`` is there, damaged or not. Raises :class:`~tierckpt.errors.StorageError` when that cannot
    be told."""
    try:
        now = _bounded(store, step, deadline_s,
                       lambda: read_step_manifest(store, layout.step_dir(step), step))
    except CorruptCheckpointError:
        return True
    return now is not None and (save_id is None or now.save_id == save_id)


def _removed(report: StepReport) -> StepReport:
    """``report`` turned into the report of a step removed while it was checked (no errors, ``ok``)."""
    return StepReport(step=report.step, ok=True, removed=True, bytes=report.bytes, created=report.created,
                      world_size=report.world_size, ranks=report.ranks)


def _extra_files(store: Store, manifest: StepManifest, rms: list[RankManifest] | None) -> list[str]:
    if rms is None:
        return []
    known = ({layout.STEP_MANIFEST, shard_index.index_name(manifest.save_id)} | {r.name for r in manifest.ranks}
             | {f.name for rm in rms for f in rm.files})
    return [n for n in store.list(layout.step_dir(manifest.step)) if n not in known]


#: Bytes of a shard index read at a time by :func:`check_index` (after its head).
INDEX_CHUNK = 8 << 20


def check_index(store: Store, manifest: StepManifest) -> str | None:
    """Check the shard index of ``store``'s copy of ``manifest``'s step whole: its head and every block parse and
    seal, the file is as long as its head says, each block's references equal ``manifest``'s and the head's meshes
    agree with the ranks' coordinates (:func:`.format.shard_index.check_head`,
    :func:`~.format.shard_index.check_block`). Returns the index's name, None where the copy has none. Reads the
    head as a restore does (:func:`.sharded.index_head`: 16 KiB, more only for a longer head), the file's size,
    then the rest :data:`INDEX_CHUNK` bytes at a time: O(index size), never more.

    Raises :class:`CorruptCheckpointError` naming the step, tier and file for a damaged, cut or stale index, and
    :class:`~tierckpt.errors.StorageError` when it cannot be read."""
    name = shard_index.index_name(manifest.save_id)
    rel = f"{layout.step_dir(manifest.step)}/{name}"
    where = f"{store.url}/{rel}"

    def io(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StorageError:
            raise
        except PermissionError as exc:
            raise StorageAccessError(f"read: access denied ({exc})", tier=store.tier, path=where,
                                     step=manifest.step, transient=False) from None
        except Exception as exc:  # a vanished file, a missing range, a folder of that name
            raise CorruptCheckpointError(f"shard index: unreadable: {exc}", step=manifest.step, tier=store.tier,
                                         path=where, bad_files=[name]) from None

    def read(offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = io(lambda: store.readinto(rel, offset, memoryview(buf)))
        if got != n:
            raise CorruptCheckpointError(f"shard index: {got} bytes at {offset}, {n} expected (changed while "
                                         "read?)", step=manifest.step, tier=store.tier, path=where, bad_files=[name])
        return bytes(buf)

    found = index_head(store, manifest)
    if found is None:
        return None
    _, head, prefix = found
    size = io(lambda: store.size(rel))
    shard_index.check_head(head, manifest.ranks, size, tier=store.tier, path=where)  # its size checked here
    refs = {r.rank: r for r in manifest.ranks}
    per_read = max(1, INDEX_CHUNK // head.block_bytes)
    blocks = -(-head.world_size // head.block_ranks)
    for first in range(0, blocks, per_read):
        at = head.block_span(first)[0]
        count = min(per_read, blocks - first)
        raw = prefix[at : at + count * head.block_bytes]
        if len(raw) < count * head.block_bytes:
            raw = read(at, count * head.block_bytes)
        for i in range(count):
            shard_index.check_block(raw[i * head.block_bytes : (i + 1) * head.block_bytes], head, first + i, refs,
                                    tier=store.tier, path=where)
    return name
