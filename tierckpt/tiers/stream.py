"""One stored data file as a verified stream: read in chunks, decompressed where its record says so, every byte
hashed into the file's two-level checksum and matched against the rank manifest.

Every reader of a whole data file goes through here: ``verify`` (:func:`tierckpt.tiers.verify.verify_file`), the
uploader's read-back of what it wrote, ``tierckpt pull``, a restore's compressed files, and :func:`fetch_file`. The
restore's fast paths (vectored reads into tensors, bounce buffers, the undo log of :mod:`.reader`) do their own
I/O and feed a :class:`FileStream` the bytes they read, so the segment hashing and the comparison, and the errors
that name a damaged file, are the same everywhere.

Invariants:
- bytes come back in file order, never more than the record's ``size`` of them (decompressed), and nothing is
  written past the memory a caller hands in; a file that holds (or decompresses to) fewer bytes raises
  :class:`CorruptCheckpointError`, as does one that holds more (checked with ``exact``: one more read of an
  uncompressed file, one more decompressed byte of a compressed one);
- memory stays bounded whatever the file's size: at most ``read_concurrency + 1`` chunk buffers (one on a local
  disk) for an uncompressed file, one for a compressed one, unless the caller reads into memory of its own;
- a chunk handed to a ``sink`` has been hashed; the file as a whole is known intact only once :meth:`FileStream.verify`
  returned, so a sink that keeps bytes must be able to drop them (a pull writes into a file it aborts on error);
- every error names the step, the tier, the file's URL and its name (``bad_files``); a checksum mismatch also names
  the first tensor whose bytes differ, or the header.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Generator
from contextlib import closing
from functools import partial
from typing import Any

from ..errors import CorruptCheckpointError
from ..format import hashing, layout
from ..format.manifest import FileRecord, RankManifest, file_rel
from ..storage.base import Store, join
from ..storage.readahead import ReadAhead

log = logging.getLogger(__name__)

#: Bytes per read (and per decompressed chunk) unless the caller says otherwise.
READ_CHUNK = 8 << 20


def segment_ends(rm: RankManifest, file_index: int) -> list[int]:
    """Segment boundaries of a data file: the header, then each tensor's range in file order.

    Raises :class:`CorruptCheckpointError` when the tensors' ranges leave a gap, overlap or stop short of the
    file's end."""
    f = rm.files[file_index]
    ranges = sorted((t.offset, t.offset + t.nbytes) for t in rm.tensors if t.file == file_index)
    if f.cuts:
        return _cut_ends(rm, f, ranges)
    ends = [f.data_start]
    pos = f.data_start
    for start, end in ranges:
        if start != pos:
            raise CorruptCheckpointError(f"tensor ranges of {f.name} leave a gap or overlap", step=rm.step,
                                         bad_files=[f.name])
        ends.append(end)
        pos = end
    if pos != f.size:
        raise CorruptCheckpointError(f"tensor ranges of {f.name} do not reach its end", step=rm.step,
                                     bad_files=[f.name])
    return ends


def _cut_ends(rm: RankManifest, f: FileRecord, ranges: list[tuple[int, int]]) -> list[int]:
    """The segment ends of a file an incremental step references (its record's ``cuts``): every listed tensor must
    be exactly one of its segments."""
    ends = [f.data_start, *f.cuts]
    pos = f.data_start
    for start, end in ranges:
        if start == end:  # an empty tensor needs no bytes (an incremental step never references one)
            continue
        k = bisect_right(ends, start) - 1  # the last segment ending at ``start`` (empty segments come before it)
        if start < pos or k < 0 or ends[k] != start or k + 1 == len(ends) or ends[k + 1] != end:
            raise CorruptCheckpointError(f"tensor ranges of {f.name} do not match its segments", step=rm.step,
                                         bad_files=[f.name])
        pos = end
    return ends


def ends_early_error(store: Store, rm: RankManifest, index: int, at: int, *,
                     rel: str | None = None) -> CorruptCheckpointError:
    """File ``index`` holds fewer bytes than its record: it ends at byte ``at``. ``rel``: where it was read, when
    not in its step folder."""
    f = rm.files[index]
    return _ends_early(store, file_rel(rm.step, f) if rel is None else rel, f.name, rm.step, at)


def _ends_early(store: Store, rel: str, name: str, step: int | None, at: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{name} ends early at byte {at}", step=step, tier=store.tier,
                                  path=f"{store.url}/{rel}", bad_files=[name])


def mismatch_error(store: Store, rm: RankManifest, index: int, digests: list[bytes], *,
                   rel: str | None = None) -> CorruptCheckpointError:
    """File ``index`` does not hash to its checksum: the error names the first tensor whose segment digest
    (``digests``, in file order) differs from its record, or the header when every tensor matches."""
    f = rm.files[index]
    rel = file_rel(rm.step, f) if rel is None else rel
    tensors = sorted((t for t in rm.tensors if t.file == index), key=lambda t: (t.offset, t.offset + t.nbytes))
    what = "header"  # every tensor matching but the file not means the header segment differs
    if f.cuts:
        what = "header, or a tensor this step does not use"  # a referenced file: this step lists some of its tensors
        by_end = dict(zip(f.cuts, digests[1:]))
        digests = [b"", *(by_end.get(t.offset + t.nbytes, b"") for t in tensors)]
    for t, d in zip(tensors, digests[1:]):
        if d.hex() != t.checksum:
            what = f"tensor {t.path}"
            break
    return CorruptCheckpointError(f"checksum mismatch in {f.name} ({what})", step=rm.step, tier=store.tier,
                                  path=f"{store.url}/{rel}", bad_files=[f.name])


def stored_chunks(store: Store, rel: str, record: FileRecord, *, into: memoryview | None = None,
                  chunk: int = READ_CHUNK, check: Callable[[], None] | None = None, exact: bool = True,
                  step: int | None = None) -> Generator[memoryview, None, None]:
    """The bytes of the stored file ``rel`` (whose record is ``record``), decompressed, in order: each a view
    valid until the next one is asked for. Close the iterator (``contextlib.closing``) when stopping early, so
    that no read is left running into the caller's memory.

    ``into``: memory of exactly ``record.size`` bytes the chunks are read (or decompressed) into; else bounded
    reusable buffers. ``chunk``: bytes per read. ``check``: called before each read (it may raise to stop).
    ``exact``: also make sure the file holds nothing past its recorded size. ``step``: named by the errors.

    Raises :class:`CorruptCheckpointError` naming the file when it ends early, holds more than its record says,
    is not a valid zstd stream, or names an unknown compression."""
    where = f"{store.url}/{rel}"

    def corrupt(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{record.name}: {msg}", step=step, tier=store.tier, path=where,
                                      bad_files=[record.name])

    if into is not None:
        into = memoryview(into).cast("B")
    if into is not None and len(into) != record.size:
        raise ValueError(f"buffer of {len(into)} bytes for {record.name} of {record.size} bytes")
    if record.compression is None:
        return _plain(store, rel, record, into, chunk, check, exact, step, corrupt)
    if record.compression == "zstd":
        return _zstd(store, rel, record, into, chunk, check, corrupt)
    raise corrupt(f"unknown compression {record.compression!r}")


def _plain(store: Store, rel: str, record: FileRecord, into: memoryview | None, chunk: int,
           check: Callable[[], None] | None, exact: bool, step: int | None,
           corrupt: Callable[[str], CorruptCheckpointError]) -> Generator[memoryview, None, None]:
    size = record.size
    # without memory of the caller's, one byte past the record is asked for with the last chunk: a longer file
    # shows there without a read of its own
    end = size + 1 if exact and into is None else size
    pos = 0
    with ReadAhead(partial(store.readinto, rel), 0, end, chunk=chunk if into is not None else min(chunk, max(end, 1)),
                   window=store.read_concurrency, into=into, check=check) as chunks:
        for _, view in chunks:
            if pos + len(view) > size:
                raise corrupt(f"longer than its {size} bytes")
            pos += len(view)
            yield view
    if pos < size:
        raise _ends_early(store, rel, record.name, step, pos)
    if exact and into is not None and store.readinto(rel, size, memoryview(bytearray(1))):
        raise corrupt(f"longer than its {size} bytes")


def _zstd(store: Store, rel: str, record: FileRecord, into: memoryview | None, chunk: int,
          check: Callable[[], None] | None,
          corrupt: Callable[[str], CorruptCheckpointError]) -> Generator[memoryview, None, None]:
    import zstandard

    size = record.size
    buf = into if into is not None else memoryview(bytearray(max(1, min(chunk, size))))
    pos = 0
    try:
        with store.open_read(rel) as f:
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=chunk, read_across_frames=False)
            while pos < size:
                if check is not None:
                    check()
                n = min(chunk, size - pos)
                at = pos if into is not None else 0  # in the caller's memory at its place, else at the start
                view = buf[at : at + n]
                got = reader.readinto(view)
                if got <= 0:
                    raise corrupt(f"decompresses to {pos} bytes, fewer than {size}")
                pos += got
                yield view[:got]
            if reader.read(1):
                raise corrupt(f"decompresses to more than {size} bytes")
    except zstandard.ZstdError as exc:
        raise corrupt(f"damaged zstd stream: {exc}") from None


def fetch_file(store: Store, folder: str, record: FileRecord, out: memoryview, *, chunk: int = READ_CHUNK) -> None:
    """Read the whole file ``record`` of step folder ``folder`` into ``out`` (``len(out) == record.size``),
    decompressing zstd transparently. Never writes past ``out``; a file that holds (or decompresses to) more or fewer
    bytes than ``record.size`` raises :class:`CorruptCheckpointError` naming it. Checksums are the caller's job
    (:class:`FileStream` checks them as it reads). Raises ``ValueError`` when ``out`` is not of the record's size."""
    with closing(stored_chunks(store, join(folder, record.name), record, into=out, chunk=chunk,
                               step=layout.parse_step_dir(folder))) as chunks:
        for _ in chunks:
            pass


class FileStream:
    """File ``index`` of rank manifest ``rm`` on ``store``, checked against the manifest as its bytes go by.

    :meth:`run` streams the file itself (see :func:`stored_chunks`); a reader doing its own I/O calls
    :meth:`feed` with the file's bytes in order instead. Either way :meth:`verify` (or :meth:`matches`) ends it.
    ``record`` and ``rel``: the stored form and place of the file when they are not those of the manifest in its
    step folder (a copy just uploaded to a staging folder, perhaps compressed there).

    Call order: construct → :meth:`run` or :meth:`feed`… → :meth:`verify`.
    """

    def __init__(self, store: Store, rm: RankManifest, index: int, *, record: FileRecord | None = None,
                 rel: str | None = None) -> None:
        self.store, self.rm, self.index = store, rm, index
        self.record = rm.files[index] if record is None else record
        self.rel = file_rel(rm.step, self.record) if rel is None else rel
        #: the file's segment hasher (raises ``ValueError`` when fed more bytes than the segments cover)
        self.seg = hashing.SegmentHasher(segment_ends(rm, index))

    def feed(self, data: Any) -> None:
        """Hash the file's next bytes."""
        self.seg.feed(data)

    def run(self, *, sink: Callable[[memoryview], Any] | None = None, into: memoryview | None = None,
            chunk: int = READ_CHUNK, check: Callable[[], None] | None = None, exact: bool = True) -> None:
        """Stream the whole file, hashing every chunk and then handing it to ``sink`` (valid only during that call).
        ``into``, ``chunk``, ``check``, ``exact``: see :func:`stored_chunks`, whose errors it raises; the checksum
        is compared by :meth:`verify`."""
        with closing(stored_chunks(self.store, self.rel, self.record, into=into, chunk=chunk, check=check,
                                   exact=exact, step=self.rm.step)) as chunks:
            for view in chunks:
                self.feed(view)
                if sink is not None:
                    sink(view)

    def ends_early(self, at: int) -> CorruptCheckpointError:
        """The error for a file that ended at byte ``at``, before its recorded size."""
        return ends_early_error(self.store, self.rm, self.index, at, rel=self.rel)

    def matches(self) -> bool:
        """Whether every byte was fed and they hash to the file's checksum."""
        return self.seg.done() and self.seg.file_checksum() == self.record.checksum

    def verify(self) -> None:
        """Raise :class:`CorruptCheckpointError` (naming the file and the first tensor that differs) unless
        :meth:`matches`."""
        if not self.matches():
            raise mismatch_error(self.store, self.rm, self.index, self.seg.digests, rel=self.rel)


def stream_file(store: Store, rm: RankManifest, index: int, *, sink: Callable[[memoryview], Any] | None = None,
                into: memoryview | None = None, chunk: int = READ_CHUNK, check: Callable[[], None] | None = None,
                exact: bool = True) -> None:
    """Stream file ``index`` of ``rm`` from its step folder on ``store``, verified against the manifest: each
    chunk is hashed, then handed to ``sink``; returns once the whole file matched its checksum. ``into``: memory
    of the file's size to read it into instead of reusable buffers. See :class:`FileStream`.

    Raises :class:`CorruptCheckpointError` naming the step, tier, path and file when the file is short, long,
    damaged or does not match."""
    stream = FileStream(store, rm, index)
    stream.run(sink=sink, into=into, chunk=chunk, check=check, exact=exact)
    stream.verify()
