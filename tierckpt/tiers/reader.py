"""Reading a committed step back: manifests first, then every byte verified as it is read.

Invariants:
- nothing is allocated before the files' real sizes (from the store) match the sizes the manifest claims, and a
  file whose size is not backed by stored bytes (a sparse file, a zstd bomb) matched its checksum, streamed through
  bounded buffers (:mod:`.backing`): a hostile or damaged manifest cannot make us allocate more than what is
  actually on disk;
- every byte that :func:`load_rank` hands back has been hashed and matched against the manifest; any mismatch raises
  :class:`CorruptCheckpointError` naming the step, tier, file and tensor, before the caller touches its state;
- all paths come from :func:`tierckpt.format.layout.check_file_name`-checked names joined under the step folder;
- ``direct`` reads (an in-place or guarded restore) put a file's bytes straight into the caller's tensors on stores
  with a local path; those bytes are hashed where they land and a mismatch still raises, but only after they were
  written there. Other stores read into the buffer, verify, then copy;
- with an ``undo`` log (a guarded default restore), every range of a caller's tensor is saved into the buffer, at
  its place in the file, before a read or copy writes it (:mod:`.undo`), so the caller can put the old bytes back
  once :class:`PendingLoad` has ended;
- on a ``direct_reads`` store, a file that is mostly not in the page cache (asked once per file) is read around it
  (:meth:`Store.readinto_direct`), so a restore after a restart neither fills the page cache nor pays for its copy:
  a file read whole goes into the (page-aligned) buffer, a scattered one through :mod:`.bounce` buffers (the
  caller's tensors are not aligned the way ``O_DIRECT`` needs), each copied out by the file's hashing task and
  given back only after that; a cached file is read from memory (scattered with vectored ``preadv``);
- with hashing threads, a file's reader hands each piece it read to its own hashing task and reads on; the file is
  verified only when that task has hashed every piece, and a read never returns (nor lets its memory go) while its
  hashing task may still touch it;
- a compressed file is decompressed straight into the buffer, never past its recorded size, and hashed as it goes
  (:class:`.stream.FileStream`); every file's segment hashing and comparison with the manifest, and the errors that
  name it, are those of :mod:`.stream`;
- :func:`start_load` returns while the reads run; whichever of :meth:`PendingLoad.result` and
  :meth:`PendingLoad.cancel` ends it returns only once no read or hash touches the buffer any more.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from functools import partial
from itertools import accumulate

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format import hashing, layout
from ..format.manifest import RankManifest, StepManifest, file_rel
from ..host.memory import buffer_address
from ..storage.base import Store
from ..storage.commit import read_rank_manifest, read_step_manifest
from ..storage.readahead import ReadAhead, each
from .backing import prove_backed
from .bounce import BounceBuffers
from .stream import FileStream, ends_early_error
from .stream import fetch_file as fetch_file  # the names below are part of this module's interface too
from .stream import mismatch_error as mismatch_error
from .stream import segment_ends as segment_ends
from .tasks import results, submit_all
from .undo import UndoLog

log = logging.getLogger(__name__)

READ_CHUNK = 8 << 20
#: Bytes copied out of a bounce buffer and hashed at a time (:func:`_copy_and_hash`): well inside a core's L2 cache.
FUSED_BLOCK = 256 << 10
#: Bytes per read of a file read whole around the page cache (``O_DIRECT``, straight into the staging buffer). A
#: fresh buffer's pages fault in inside each such read before its transfer starts, so a reader alternates between
#: faulting and waiting on the disk; 32 MiB reads made 2 GiB default cold restores into fresh buffers 0.59-0.85x as
#: long as 8 MiB ones on the benchmark VM (four interleaved A/B runs, 30 rounds).
#: Reads into memory faulted in before took the same time at either size.
DIRECT_READ_CHUNK = 32 << 20
#: Buffers per vectored read (well under every kernel's IOV_MAX of 1024).
MAX_IOV = 256


@dataclass(frozen=True)
class LoadedRank:
    manifest: StepManifest
    rank_manifest: RankManifest
    #: each file's bytes, in manifest order (views into the caller's buffer)
    files: tuple[memoryview, ...]
    #: each file's start within the caller's buffer
    offsets: tuple[int, ...]


def read_manifests(store: Store, step: int, *,
                   ranks: list[int] | None = None) -> tuple[StepManifest, list[RankManifest]]:
    """The verified step manifest and the requested ranks' manifests (by default every rank this copy holds: all,
    or for a node-local copy of a multi-rank step the ranks in its ``holds_ranks``)."""
    manifest = read_step(store, step)
    return manifest, read_ranks(store, manifest, ranks)


def read_step(store: Store, step: int) -> StepManifest:
    """The verified ``manifest.json`` of a committed step; ``CheckpointNotFoundError`` if there is none."""
    folder = layout.step_dir(step)
    manifest = read_step_manifest(store, folder, step)
    if manifest is None:
        raise CheckpointNotFoundError("no committed checkpoint", step=step, tier=store.tier,
                                      path=f"{store.url}/{folder}")
    return manifest


def read_ranks(store: Store, manifest: StepManifest, ranks: list[int] | None = None) -> list[RankManifest]:
    """The requested ranks' manifests of a step whose ``manifest`` was already read, each checked against it."""
    step = manifest.step
    folder = layout.step_dir(step)
    if ranks is None and manifest.holds_ranks is not None:
        ranks = list(manifest.holds_ranks)
    if ranks is not None and manifest.holds_ranks is not None and not set(ranks) <= set(manifest.holds_ranks):
        raise CheckpointNotFoundError(f"this copy holds ranks {list(manifest.holds_ranks)} only, not {ranks}",
                                      step=step, tier=store.tier, path=f"{store.url}/{folder}")
    return [read_rank_manifest(store, folder, ref, manifest) for ref in manifest.ranks
            if ranks is None or ref.rank in ranks]


def check_sizes(store: Store, rm: RankManifest) -> None:
    """Compare every file's size on the store with the manifest before anything is allocated (the sizes asked for
    together on an object store)."""

    def size(rel: str) -> int | None:
        try:
            return store.size(rel)
        except FileNotFoundError:
            return None

    rels = [file_rel(rm.step, f) for f in rm.files]
    for f, rel, actual in zip(rm.files, rels, each(size, rels, concurrency=store.read_concurrency)):
        if actual is None:
            raise CorruptCheckpointError("data file missing", step=rm.step, tier=store.tier, path=f"{store.url}/{rel}",
                                         bad_files=[f.name])
        want = f.stored_size if f.compression else f.size
        if actual != want:
            raise CorruptCheckpointError(f"data file is {actual} bytes, manifest says {want} (truncated or replaced)",
                                         step=rm.step, tier=store.tier, path=f"{store.url}/{rel}", bad_files=[f.name])


def _pieces(rm: RankManifest, index: int, out: memoryview, direct: dict[int, memoryview]) -> list[memoryview]:
    """Buffers that tile file ``index`` in order: each ``direct`` tensor's own memory, everything else in ``out``."""
    f = rm.files[index]
    pieces: list[memoryview] = []
    pos = 0
    for t in sorted((t for t in rm.tensors if t.file == index and t.index in direct), key=lambda t: t.offset):
        view = direct[t.index]
        if view.nbytes != t.nbytes:
            raise CorruptCheckpointError(f"tensor {t.path} is {t.nbytes} bytes in {f.name}, its destination "
                                         f"{view.nbytes}", step=rm.step, bad_files=[f.name])
        if t.offset > pos:
            pieces.append(out[pos : t.offset])
        pieces.append(view)
        pos = t.offset + t.nbytes
    if pos < f.size:
        pieces.append(out[pos : f.size])
    return pieces


def _batches(pieces: list[memoryview]) -> list[list[memoryview]]:
    """Group the pieces (cut to at most ``READ_CHUNK`` each) into vectored reads of about ``READ_CHUNK`` bytes."""
    out: list[list[memoryview]] = [[]]
    size = 0
    for piece in pieces:
        for start in range(0, piece.nbytes, READ_CHUNK):
            part = piece[start : start + READ_CHUNK]
            if out[-1] and (size + part.nbytes > READ_CHUNK or len(out[-1]) >= MAX_IOV):
                out.append([])
                size = 0
            out[-1].append(part)
            size += part.nbytes
    return out


class _Hashing:
    """Feeds one file's pieces, in order, to its hasher: on a thread of ``executor`` (so the reader goes on reading
    while the last piece is hashed) or, without one, right away on the reader's thread. A piece may come with the
    address its bytes are to be copied from first (from a bounce buffer: see :func:`_copy_and_hash`) and the items
    with a ``release`` that always runs after (the bounce buffer goes back), even once an earlier piece failed:
    then nothing else is copied or hashed, and :meth:`finish` raises that first error. With ``undo`` (a guarded
    restore), a copied piece may come with the address its old bytes are saved to first."""

    def __init__(self, seg: hashing.SegmentHasher, executor: Executor | None, undo: UndoLog | None = None) -> None:
        self.seg = seg
        self._undo = undo
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue[_Item | None] | None = None
        self._task: Future[None] | None = None
        if executor is not None:
            self._queue = queue.SimpleQueue()
            self._task = executor.submit(self._drain)

    def _run(self, item: _Item) -> None:
        pieces, sources, saves, release = item
        try:
            if self._error is None:
                if sources is not None:
                    _copy_and_hash(self.seg, pieces, sources, saves, self._undo)
                else:
                    for piece in pieces:
                        self.seg.feed(piece)
        except BaseException as exc:
            self._error = exc
        finally:
            if release is not None:
                release()

    def _drain(self) -> None:
        assert self._queue is not None
        while (item := self._queue.get()) is not None:
            self._run(item)

    def feed(self, pieces: list[memoryview], *, sources: list[int] | None = None,
             saves: list[int | None] | None = None, release: Callable[[], None] | None = None) -> None:
        """Hash ``pieces`` (in file order); with ``sources``, first copy each piece's bytes from the address of
        the same index (its ``nbytes`` of them), and with ``saves``, before that save the piece's old bytes to the
        address of the same index where it is not None (into the undo log)."""
        if saves is not None and self._undo is None:
            raise ValueError("saving old bytes needs the undo log of a guarded restore")
        item = (pieces, sources, saves, release)
        if self._queue is None:
            self._run(item)
            if self._error is not None:
                raise self._error
        else:
            self._queue.put(item)

    def finish(self) -> None:
        """Wait until every piece fed is hashed (also on error: the memory may be released right after)."""
        if self._task is not None:
            assert self._queue is not None
            self._queue.put(None)
            self._task.result()
        if self._error is not None:
            raise self._error


def _copy_and_hash(seg: hashing.SegmentHasher, pieces: list[memoryview], sources: list[int],
                   saves: list[int | None] | None = None, undo: UndoLog | None = None) -> None:
    """Copy each piece's bytes in from its source address and hash them where they landed, one
    :data:`FUSED_BLOCK` at a time: the hash reads each block from the CPU cache right after the copy wrote it
    there, rather than the whole piece again from memory (copy and hash of 1 GiB on one core here: 0.071 s in
    256 KiB blocks against 0.096 s in 16 MiB pieces). With ``saves`` (a guarded restore), each block's old bytes
    are first saved into ``undo``, which also brings the block into the cache the copy then writes."""
    memmove, feed = ctypes.memmove, seg.feed  # foreign calls and xxhash both release the GIL meanwhile
    for j, (piece, src) in enumerate(zip(pieces, sources)):
        dst = buffer_address(piece)
        size = piece.nbytes
        if dst is None:
            if size:  # never from a reader: its pieces are writable memory
                raise ValueError(f"cannot copy into a read-only or non-contiguous piece of {size} bytes")
            continue
        saved_at = saves[j] if saves is not None else None
        for at in range(0, size, FUSED_BLOCK):
            n = min(FUSED_BLOCK, size - at)
            if saved_at is not None:
                assert undo is not None
                undo.save(dst + at, saved_at + at, n)
            memmove(dst + at, src + at, n)
            feed(piece[at : at + n])


_Item = tuple[list[memoryview], "list[int] | None", "list[int | None] | None", "Callable[[], None] | None"]


def read_file_into(store: Store, rm: RankManifest, index: int, out: memoryview,
                   direct: dict[int, memoryview] | None = None, *, hash_executor: Executor | None = None,
                   stop: threading.Event | None = None, bounce: BounceBuffers | None = None,
                   undo: UndoLog | None = None) -> None:
    """Read one data file into ``out`` (exactly its size), hashing as it goes; raises on any mismatch.

    ``direct``: record index -> memory the tensor's bytes go to instead of ``out`` (see the module docstring).
    ``hash_executor``: hash on a thread there while this one reads on (else read and hash take turns).
    ``stop``: once set, the read ends before its next chunk with :class:`LoadCancelled`.
    ``bounce``: buffers through which ``direct`` reads of a file not in the page cache go with ``O_DIRECT`` (on a
    ``direct_reads`` store; see :mod:`.bounce`); without them such reads are buffered.
    ``undo``: a guarded restore: the old bytes of each ``direct`` range are saved into it (at their place in
    ``out``) just before the range is written; such a file must scatter (a local, uncompressed file).
    """
    f = rm.files[index]
    stream = FileStream(store, rm, index)
    mine = {i: v for i, v in (direct or {}).items() if rm.tensors[i].file == index}
    scatter = bool(mine) and store.local_path is not None and not f.compression
    if undo is not None and mine and not scatter:
        raise ValueError(f"a guarded restore reads {f.name} in place, but it cannot be read straight into tensors")
    if f.compression:
        stream.run(into=out, chunk=READ_CHUNK)
    else:
        hasher = _Hashing(stream.seg, hash_executor, undo)
        try:
            _read_pieces(store, rm, index, stream.rel, out, mine if scatter else None, hasher, stop, bounce, undo)
        finally:
            hasher.finish()
    stream.verify()
    if mine and not scatter:  # verified in ``out``: now hand the tensors their bytes
        for i, view in mine.items():
            t = rm.tensors[i]
            view[:] = out[t.offset : t.offset + t.nbytes]


class LoadCancelled(Exception):
    """A read ended early because :meth:`PendingLoad.cancel` asked it to (never seen by callers of ``cancel``)."""


def _read_pieces(store: Store, rm: RankManifest, index: int, rel: str, out: memoryview,
                 scatter: dict[int, memoryview] | None, hasher: _Hashing, stop: threading.Event | None,
                 bounce: BounceBuffers | None = None, undo: UndoLog | None = None) -> None:
    """Read file ``index`` in order (vectored into ``scatter`` tensors and ``out``, or all into ``out``), handing
    each piece read to ``hasher``; checks ``stop`` before every read. On a ``direct_reads`` store, a file that is
    mostly not in the page cache (asked once, before its first read) is read around the cache: straight into
    ``out``, or, when it scatters, through ``bounce`` (if given). ``undo``: see :func:`read_file_into`."""
    f = rm.files[index]
    pos = 0

    def check() -> None:
        if stop is not None and stop.is_set():
            raise LoadCancelled(f"reading {f.name} of step {rm.step} was cancelled at byte {pos}")

    if scatter:
        pieces = _pieces(rm, index, out, scatter)
        if bounce is not None and store.reads_direct(rel, 0, f.size):
            _read_bounced(store, rm, index, rel, pieces, bounce, hasher, check, out if undo is not None else None)
            return
        for batch in _batches(pieces):
            check()
            want = sum(b.nbytes for b in batch)
            if undo is not None:
                undo.keep(batch, pos, out)
            n = store.readinto_many(rel, pos, batch)
            if n != want:
                raise ends_early_error(store, rm, index, pos + n)
            hasher.feed(batch)
            pos += n
        return
    direct = store.reads_direct(rel, 0, f.size)
    read = store.readinto_direct if direct else store.readinto
    # one chunk at a time on a local disk; ``read_concurrency`` ranged reads in flight on an object store
    with ReadAhead(partial(read, rel), 0, f.size, chunk=DIRECT_READ_CHUNK if direct else READ_CHUNK,
                   window=store.read_concurrency, into=out[: f.size], check=check) as chunks:
        for _, view in chunks:
            hasher.feed([view])
            pos += len(view)
    if pos < f.size:
        raise ends_early_error(store, rm, index, pos)


def _read_bounced(store: Store, rm: RankManifest, index: int, rel: str, pieces: list[memoryview],
                  bounce: BounceBuffers, hasher: _Hashing, check: Callable[[], None],
                  saved_in: memoryview | None = None) -> None:
    """Read file ``index`` with ``O_DIRECT`` into bounce buffers, one buffer a read; the file's hashing task copies
    each buffer out into ``pieces`` (which tile the file in order), hashes the bytes where they landed and gives the
    buffer back, while this thread reads on into the next one. ``saved_in``: a guarded restore's buffer for the
    file, where the hashing task first saves the old bytes of each live piece (:meth:`UndoLog.place`)."""
    f = rm.files[index]
    starts = list(accumulate((p.nbytes for p in pieces), initial=0))  # piece j is bytes [starts[j], starts[j+1])
    pos, j = 0, 0
    while pos < f.size:
        check()
        want = min(bounce.size, f.size - pos)
        buf = bounce.acquire()
        handed = False
        try:
            n = store.readinto_direct(rel, pos, buf[:want])
            if n != want:
                raise ends_early_error(store, rm, index, pos + n)
            end = pos + n
            src = buffer_address(buf)
            assert src is not None  # a bounce buffer: writable and never empty
            views: list[memoryview] = []
            sources: list[int] = []
            saves: list[int | None] | None = None if saved_in is None else []
            while j < len(pieces) and starts[j] < end:
                a, b = max(starts[j], pos), min(starts[j + 1], end)
                if b > a:
                    views.append(pieces[j][a - starts[j] : b - starts[j]])
                    sources.append(src + a - pos)
                    if saves is not None:
                        assert saved_in is not None
                        saves.append(UndoLog.place(views[-1], a, saved_in))
                if starts[j + 1] > end:
                    break  # this piece goes on in the next buffer
                j += 1
            handed = True  # from here the hashing side gives the buffer back, whatever happens
            hasher.feed(views, sources=sources, saves=saves, release=lambda buf=buf: bounce.release(buf))
        finally:
            if not handed:
                bounce.release(buf)
        pos = end


def load_rank(
    store: Store,
    step: int,
    rank: int,
    alloc: Callable[[int], memoryview],
    *,
    executor: Executor,
    world_size: int | None = None,
) -> LoadedRank:
    """Read and verify one rank's files into a buffer from ``alloc(total_bytes)``."""
    manifest, rms = read_manifests(store, step, ranks=[rank])
    if world_size is not None and manifest.world_size != world_size:
        raise CorruptCheckpointError(
            f"checkpoint was saved by {manifest.world_size} ranks, this job has {world_size}",
            step=step, tier=store.tier)
    if not rms:
        raise CheckpointNotFoundError(f"rank {rank} is not in the checkpoint", step=step, tier=store.tier)
    views, offsets = load_files(store, rms[0], alloc, executor=executor)
    return LoadedRank(manifest, rms[0], views, offsets)


def load_files(
    store: Store, rm: RankManifest, alloc: Callable[[int], memoryview], *, executor: Executor,
    direct: dict[int, memoryview] | None = None, hash_executor: Executor | None = None,
    bounce: BounceBuffers | None = None,
) -> tuple[tuple[memoryview, ...], tuple[int, ...]]:
    """Read and verify every data file of a rank into one buffer from ``alloc``; returns views and offsets.

    ``direct`` tensors' bytes go to their own memory instead (their ranges of the buffer are left unwritten).
    ``hash_executor``: at least as many threads as ``executor``; files are hashed there while they are read."""
    return start_load(store, rm, alloc, executor=executor, direct=direct, hash_executor=hash_executor,
                      bounce=bounce).result()


class PendingLoad:
    """The reads of one rank's files, running on the io threads (from :func:`start_load`).

    Call order: :func:`start_load` → (the caller works meanwhile) → exactly one of :meth:`result` (wait, raise the
    first error) or :meth:`cancel` (give up); either returns only when no read or hash touches the buffer any more,
    so the caller may release it right after.
    """

    def __init__(self, futures: list[Future[None]], views: tuple[memoryview, ...], offsets: tuple[int, ...],
                 stop: threading.Event) -> None:
        self._futures, self._stop = futures, stop
        self.views, self.offsets = views, offsets

    def result(self) -> tuple[tuple[memoryview, ...], tuple[int, ...]]:
        """Every file read and verified: their views in the buffer and their offsets; else the first error."""
        results(self._futures)
        return self.views, self.offsets

    def cancel(self) -> None:
        """Stop every read at its next chunk (files not started are not read) and wait for all; errors are dropped."""
        self._stop.set()
        for f in self._futures:
            f.cancel()
        wait(self._futures)


def buffer_layout(rm: RankManifest) -> tuple[list[int], int]:
    """Where each file of ``rm`` starts in a restore's buffer (each on a 4 KiB boundary), and the buffer's size."""
    offsets = []
    total = 0
    for f in rm.files:
        offsets.append(total)
        total += -(-f.size // 4096) * 4096
    return offsets, total


def start_load(
    store: Store, rm: RankManifest, alloc: Callable[[int], memoryview], *, executor: Executor,
    direct: dict[int, memoryview] | None = None, hash_executor: Executor | None = None,
    bounce: BounceBuffers | None = None, undo: UndoLog | None = None,
) -> PendingLoad:
    """:func:`load_files`, returning as soon as the sizes are checked, the buffer allocated and the reads queued.
    ``undo``: a guarded restore (see :func:`read_file_into` and :mod:`.undo`)."""
    check_sizes(store, rm)
    prove_backed(store, rm, range(len(rm.files)))
    offsets, total = buffer_layout(rm)
    buf = alloc(total)
    views = tuple(buf[o : o + f.size] for o, f in zip(offsets, rm.files))
    stop = threading.Event()
    futures = submit_all(executor, lambda i: read_file_into(store, rm, i, views[i], direct, hash_executor=hash_executor,
                                                            stop=stop, bounce=bounce, undo=undo),
                         range(len(rm.files)))
    return PendingLoad(futures, views, tuple(offsets), stop)
