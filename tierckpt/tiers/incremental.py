"""Incremental steps: a save references the stored bytes of an earlier committed step instead of writing them again.

A tensor is *unchanged* when its name, dtype, shape and size equal those of a tensor of the baseline (the newest
step this manager committed to the tier, or found there after a restart) and the xxh3-128 digest of its bytes
equals the baseline's recorded checksum of that tensor. The new step then lists the baseline's file that holds the
tensor (:attr:`~tierckpt.format.manifest.FileRecord.in_step`: that file's own step, never a chain of references)
with the tensor's range in it; only the changed tensors go into the step's own files. A step thus lists every byte
it needs and where, and restore and ``verify`` read and hash those files like the step's own.

Odds that a change goes unnoticed: the digests are 128 bits wide and compared only between tensors of the same
name, dtype and size, so a changed tensor is taken for unchanged only if its new bytes collide with its old ones:
about 2^-128 per tensor per save for accidental changes (xxh3 is not a cryptographic hash: bytes crafted to
collide are not guarded against; checksums here guard against accidents, as everywhere in the format).

Safety of the referenced bytes (see :mod:`.steps`): a step is never deleted while a committed step of the same tier
references it, nor while a save or upload is about to (:func:`pins`: in memory for this process, and on a tier other
than the local one also in a lease that other processes read, :mod:`.leases`). A save pins its baseline's steps
before it checks that they are still committed, and unpins them once its own manifest, which names them, is
committed or the save failed; a kill in between leaves only the save's temporary folder (a leftover) and, on a
remote, a lease that expires.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import layout
from ..format.manifest import FileRecord, RankManifest, StepManifest, file_rel, shared_steps
from ..storage.base import Store
from ..storage.commit import read_step_manifest
from . import leases

log = logging.getLogger(__name__)

#: Guards the pins below and the steps being deleted (:func:`.steps.delete_steps` claims them): a pin taken before a
#: deletion's claim holds the step; a save that would pin a claimed step waits until the deletion ends, and then
#: finds the step gone. Never held across a request.
LOCK = threading.RLock()
_CHANGED = threading.Condition(LOCK)
_PINS: Counter[tuple[str, int]] = Counter()
_DELETING: set[tuple[str, int]] = set()
#: the longest a save waits for a deletion of a step it would reference
PIN_WAIT_S = 120.0


def pinned(store: Store, step: int) -> bool:
    """Whether a save in this process is about to reference ``step`` of ``store`` (call under :data:`LOCK`)."""
    return _PINS[(store.url, step)] > 0


def claim(store: Store, steps: list[int]) -> tuple[list[int], list[int]]:
    """Claim ``steps`` of ``store`` for a deletion: returns (the steps claimed, the steps pinned, which a deletion
    must keep). Release with :func:`unclaim`."""
    with LOCK:
        held = [s for s in steps if pinned(store, s)]
        claimed = [s for s in steps if s not in held]
        _DELETING.update((store.url, s) for s in claimed)
    return claimed, held


def unclaim(store: Store, steps: list[int]) -> None:
    """The deletion of ``steps`` of ``store`` ended (see :func:`claim`): saves waiting to pin them go on."""
    with _CHANGED:
        _DELETING.difference_update((store.url, s) for s in steps)
        _CHANGED.notify_all()


@contextmanager
def pins(store: Store, steps: tuple[int, ...]) -> Iterator[None]:
    """Hold ``steps`` of ``store`` against deletion while the block runs: in this process, and on a tier other
    than the local one also by a lease on it (written before the block starts). Waits while a deletion of one of
    them runs in this process (at most :data:`PIN_WAIT_S`; raises :class:`~tierckpt.errors.CheckpointError` past
    that)."""
    end = time.monotonic() + PIN_WAIT_S
    with _CHANGED:
        while any((store.url, s) in _DELETING for s in steps):
            left = end - time.monotonic()
            if left <= 0:
                raise CheckpointError(f"steps {list(steps)} of {store.url} were still being deleted after "
                                      f"{PIN_WAIT_S:.0f} s", tier=store.tier)
            _CHANGED.wait(left)
        for s in steps:
            _PINS[(store.url, s)] += 1
    leased = tuple(steps) if store.tier != "local" else ()
    try:
        leases.hold(store, leased)
        yield
    finally:
        with LOCK:
            for s in steps:
                _PINS[(store.url, s)] -= 1
                if _PINS[(store.url, s)] <= 0:
                    del _PINS[(store.url, s)]
        leases.release(store, leased)


def shard_key(shard: dict[str, Any] | None) -> str:
    """A distributed tensor's shard description in one comparable form ("" for a whole tensor)."""
    return "" if shard is None else json.dumps(shard, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Match:
    """Where an unchanged tensor's bytes are stored: a file record (``in_step`` set) and the range in it."""

    file: FileRecord
    offset: int


@dataclass(frozen=True)
class Baseline:
    """The committed step a save may reference: ``step``, and by tensor name its record and where its bytes are."""

    step: int
    #: by name: dtype, shape, size, checksum, where the bytes are, and the shard's place (a distributed tensor's
    #: shard, canonical JSON; "" for a whole tensor)
    tensors: dict[str, tuple[str, tuple[int, ...], int, str, Match, str]]
    #: every step whose folder holds one of the baseline's files (the baseline's own step included)
    steps: tuple[int, ...]

    @classmethod
    def of(cls, rm: RankManifest) -> Baseline:
        """The baseline a committed rank manifest ``rm`` offers: each of its files as a record naming its folder."""
        from .stream import segment_ends

        files = [f if f.in_step is not None else replace(f, in_step=rm.step, cuts=tuple(segment_ends(rm, k)[1:]))
                 for k, f in enumerate(rm.files)]
        tensors = {t.name: (t.dtype, t.shape, t.nbytes, t.checksum, Match(files[t.file], t.offset), shard_key(t.shard))
                   for t in rm.tensors if t.checksum and t.nbytes}
        return cls(rm.step, tensors, shared_steps(files))

    def match(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, checksum: str,
              shard: dict[str, Any] | None = None) -> Match | None:
        """Where the baseline stores these exact bytes (of a distributed tensor: the same shard of it), or None."""
        hit = self.tensors.get(name)
        if hit is None or hit[:4] != (dtype, shape, nbytes, checksum) or hit[5] != shard_key(shard):
            return None
        return hit[4]

    def still_stored(self, store: Store) -> bool:
        """Whether every step and file the baseline's bytes live in is still committed on ``store`` with its size
        (call with :func:`pins` held on :attr:`steps`). A re-saved or deleted step makes this False."""
        try:
            for s in self.steps:
                if read_step_manifest(store, layout.step_dir(s), s) is None:
                    return False
            seen = set()
            for _d, _s, _n, _c, m, _k in self.tensors.values():
                if m.file.name in seen:
                    continue
                seen.add(m.file.name)
                size = store.size(file_rel(self.step, m.file))
                if size != (m.file.stored_size if m.file.compression else m.file.size):
                    return False
        except Exception as exc:  # damaged or unreadable: write this save in full
            log.info("tier %s: baseline step %d not usable for an incremental save: %s", store.tier, self.step, exc)
            return False
        return True


@dataclass
class Incremental:
    """A manager's incremental-save state for one tier: the baseline and when to write a full step.

    ``full_every``: every that many saves, a step is written whole (no references), so that older steps stop being
    held; None: never. ``hash_first``: per data file (by part) whether its tensors are hashed before the file is
    written (to skip the unchanged ones) or, where the last save found nothing to skip in it, written while they are
    hashed, as in a full save, so that a state where everything changes pays nothing for the detection.
    """

    full_every: int | None = None
    #: this rank and the job's world size: a multi-rank job's rank references its own earlier shard files only
    rank: int = 0
    world_size: int = 1
    baseline: Baseline | None = None
    since_full: int = 0
    hash_first: dict[int, bool] = field(default_factory=dict)
    looked: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def baseline_for(self, store: Store, step: int) -> Baseline | None:
        """The baseline a save of ``step`` may reference (None: write it whole). After a restart, the newest
        committed step of the tier below ``step`` is read once: its rank manifest of this rank, if the step was
        saved with this job's world size (a resharded restart writes its first step whole)."""
        with self.lock:
            if self.full_every is not None and self.since_full + 1 >= self.full_every:
                return None
            if self.baseline is None and not self.looked:
                self.looked = True
                self.baseline = _newest(store, step, self.rank, self.world_size)
            b = self.baseline
        return b if b is not None and b.step < step else None

    def committed(self, rm: RankManifest, full: bool) -> None:
        """Step ``rm.step`` committed (``full``: with no references): it is the next save's baseline."""
        try:
            baseline: Baseline | None = Baseline.of(rm)
        except Exception as exc:  # the step is committed either way: the next save is then written whole
            log.warning("step %d: not a baseline for incremental saves: %s", rm.step, exc)
            baseline = None
        with self.lock:
            self.baseline = baseline
            self.looked = True
            self.since_full = 0 if full else self.since_full + 1


def _newest(store: Store, below: int, rank: int = 0, world_size: int = 1) -> Baseline | None:
    from .reader import read_ranks, read_step  # reader imports this module's users

    try:
        steps = sorted((s for s in (layout.parse_step_dir(n) for n in store.list("")) if s is not None and s < below),
                       reverse=True)
        for s in steps:
            try:
                manifest = read_step(store, s)
            except CheckpointNotFoundError:
                continue  # not committed
            if manifest.world_size != world_size:
                return None  # saved by another world size (resharded restart): its shards are cut differently
            if manifest.holds_ranks is not None and rank not in manifest.holds_ranks:
                continue
            rms = read_ranks(store, manifest, [rank])
            if len(rms) == 1 and rms[0].rank == rank:
                return Baseline.of(rms[0])
    except Exception as exc:  # nothing to reference: the first save is written whole
        log.info("tier %s: no baseline for incremental saves found: %s", store.tier, exc)
    return None


def step_refs(rms: list[RankManifest]) -> tuple[tuple[int, ...], int]:
    """The steps ``rms`` reference and the bytes they hold of them (a step manifest's ``refs``, ``shared_bytes``)."""
    steps = sorted({s for rm in rms for s in shared_steps(rm.files)})
    return tuple(steps), sum(rm.shared_bytes for rm in rms)


def with_refs(manifest: StepManifest, rms: list[RankManifest]) -> StepManifest:
    """``manifest`` with its ``refs`` and ``shared_bytes`` recomputed from its rank manifests ``rms``."""
    refs, shared = step_refs(rms)
    return replace(manifest, refs=refs, shared_bytes=shared)
