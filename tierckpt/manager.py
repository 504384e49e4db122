"""CheckpointManager: the public entry point. Data flows one way: state -> snapshot -> local tier -> remote tier.

Threads: the caller's thread flattens the state and copies it into a staging slot (the only time training waits);
one *persist* thread writes each snapshot to the local tier (with ``writer_threads`` file writers, which start on
each file's first bytes while the copy goes on, and as many hashing threads) and commits it;
one *upload* thread replicates committed steps to the remote tier. Steps move through each stage in order.

Invariants:
- ``save()`` returns only after every tensor's bytes are in manager-owned host memory, and always takes its
  snapshot unless the call itself is refused (bad arguments, a closed manager, a rollback not made explicit, or an
  earlier save that failed on the *local* tier): a failing remote never costs a local checkpoint;
- a step is visible in a tier only once committed there (see :mod:`tierckpt.storage.commit`);
- retention in a tier runs only after a newer step committed there and never deletes that tier's newest step;
  local retention keeps at most ``keep_local + max_upload_backlog`` steps, deleting an unreplicated one only as
  :class:`~tierckpt.replication.policy.ReplicationPolicy` allows;
- construction does no remote I/O: the :class:`~tierckpt.replication.replicator.Replicator` lists the remote and
  resumes unfinished uploads on its own thread; every listing a restore waits for is bounded by
  ``remote_timeout_s``, and a tier that cannot be listed is never taken for an empty one;
- an error in a background thread fails that save's futures and is logged with step/tier/path; a local one is
  re-raised once by the caller's next ``save()``, ``wait()`` or ``close()``, an upload's by ``wait()`` or
  ``close()`` only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .distributed import Coordinator, rank_and_world
from .engine import lifecycle as _lifecycle
from .engine import load as _load
from .engine import reads as _reads
from .engine import rollback as _rollback
from .engine import uploads as _uploads
from .engine.core import Components, Engine
from .engine.pipeline import SavePipeline
from .engine.records import BackgroundErrors, SaveLog, record_hooks
from .errors import CheckpointError
from .handle import SaveHandle, SaveRecord
from .host import gcpause as _gc
from .host.memory import huge_pages_available
from .options import (
    DistributedOptions,
    LocalTierOptions,
    Options,
    RemoteTierOptions,
    check_metadata,
    check_storage_options,
)
from .policy import DEFAULT_SIGNALS, Clock, Preemption, SavePolicy, SlowSaveMonitor
from .replication import Health, ReplicationPolicy, Replicator
from .snapshot import staging
from .status import StepInfo
from .storage import folder_lock
from .storage.base import Store
from .storage.local import LocalStore
from .storage.open import open_store
from .tiers import identity, uploader
from .tiers import memory as _memory
from .tiers.verify import list_root

log = logging.getLogger(__name__)


class CheckpointManager:
    """Asynchronous tiered checkpointing: the one object a training loop uses (docs/getting-started.md is the guide).

    Every option of the groups below (``keep_local`` ... ``create_bucket``) is also a keyword of its own, with the
    default its group documents (the documentation's tuning page says when to change each and what it costs);
    ``remote_direct_io`` and ``overlap_writes`` are internal heuristics (:class:`~tierckpt.options.Heuristics`).

    Args:
        local_dir: node-local folder (NVMe) for the fast tier; created if missing.
        remote: fsspec URL or path of the durable tier, or None.
        storage_options: passed to fsspec for ``remote``.
        local_tier / remote_tier / distributed: the options of one tier, or of multi-rank jobs, as a group
            (:class:`~tierckpt.options.LocalTierOptions`, :class:`~tierckpt.options.RemoteTierOptions`,
            :class:`~tierckpt.options.DistributedOptions`), in place of their keywords.
        save_every_steps / save_every_seconds: the interval policy behind :meth:`should_save`.
        on_record: a callable, or a list of them, given each save's :class:`SaveRecord` (stall, persist and
            upload seconds, bytes, error, why an upload was skipped) once the save is resolved in every tier, in
            the order the saves resolve: where a metrics exporter or a trainer's logger takes them. It runs on a
            background thread, so keep it short; an exception it raises is logged and never affects a save.
            ``saves.jsonl`` is written either way (``log_records``).
        rank / world_size: default from torch.distributed when initialised, else 0 / 1.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        remote: str | os.PathLike[str] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_local: int = Options.keep_local,
        keep_remote: int | None = Options.keep_remote,
        keep_every: int | None = Options.keep_every,
        writer_threads: int = Options.writer_threads,
        staging_buffers: int = Options.staging_buffers,
        file_size_mb: int = Options.file_size_mb,
        upload_threads: int = Options.upload_threads,
        upload_bandwidth_mbps: float | None = Options.upload_bandwidth_mbps,
        upload_deadline_s: float | None = Options.upload_deadline_s,
        upload_part_mb: int = Options.upload_part_mb,
        remote_compression: str | None = Options.remote_compression,
        verify_uploads: bool = Options.verify_uploads,
        remote_read_concurrency: int = Options.remote_read_concurrency,
        remote_write_concurrency: int = Options.remote_write_concurrency,
        cache_remote_restores: bool = Options.cache_remote_restores,
        pin_memory: bool | None = Options.pin_memory,
        log_records: bool = Options.log_records,
        lazy_snapshot: bool = Options.lazy_snapshot,
        direct_io: bool = Options.direct_io,
        remote_direct_io: bool | None = Options.remote_direct_io,
        overlap_writes: bool | None = Options.overlap_writes,
        huge_pages: bool | None = Options.huge_pages,
        memory_tier: bool = Options.memory_tier,
        incremental: bool = Options.incremental,
        full_every: int | None = Options.full_every,
        collective_timeout_s: float = Options.collective_timeout_s,
        peer_replicas: int = Options.peer_replicas,
        remote_timeout_s: float = Options.remote_timeout_s,
        max_upload_backlog: int = Options.max_upload_backlog,
        create_bucket: bool = Options.create_bucket,
        continue_remote_run: bool = Options.continue_remote_run,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        on_record: Callable[[SaveRecord], None] | Sequence[Callable[[SaveRecord], None]] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_tier: LocalTierOptions | None = None,
        remote_tier: RemoteTierOptions | None = None,
        distributed: DistributedOptions | None = None,
    ) -> None:
        self.options = Options.from_keywords(
            locals(), {"local_tier": local_tier, "remote_tier": remote_tier, "distributed": distributed})
        if not isinstance(local_dir, (str, os.PathLike)) or not os.fspath(local_dir):
            raise ValueError(f"local_dir must be a non-empty path, got {local_dir!r}")
        hooks = record_hooks(on_record)
        self._policy = SavePolicy(every_steps=save_every_steps, every_seconds=save_every_seconds)
        self._clock = Clock()
        self._preemption = Preemption()
        self._slow = SlowSaveMonitor()
        self.rank, self.world_size = rank_and_world(rank, world_size)
        huge = self.options.huge_pages
        self._huge = huge_pages_available() if huge is None else huge
        self.local: LocalStore = LocalStore(local_dir, tier="local", direct_io=self.options.direct_io,
                                            huge_pages=self._huge)
        self._coord = None
        if self.world_size > 1:  # every rank constructs its manager: the groups are created collectively here
            self._coord = Coordinator(self.local.root, timeout_s=self.options.collective_timeout_s)
        self._lock_fd = folder_lock.acquire(self.local.root, self.rank)
        self.remote = None
        try:
            _lifecycle.recover_local(self.local, self._coord)
            if remote is not None:
                # No start-up cleanup on the remote: it is shared (other nodes, `tierckpt sync`) and holds no lock of
                # ours, so another writer's upload in progress must not be mistaken for a leftover. Leftovers there
                # are never checkpoints; `tierckpt prune` removes them.
                self.remote = open_store(remote, storage_options=check_storage_options(storage_options), tier="remote",
                                         **_lifecycle.remote_store_options(self.options, self._huge))
            # what a restart finds committed locally: resumed by the replicator, and the floor below which save()
            # refuses a step (a rollback must be explicit)
            local_steps = sorted(list_root(self.local).steps)
            run = identity.local_identity(self.local)
            if self._coord is not None:  # a multi-rank step needs every rank's shard: resume what all still have
                local_steps = self._coord.reduce(local_steps, self._coord.main_lane, _common_steps,
                                                 what="the steps every rank holds")
            self._peers = _lifecycle.start_peers(self.local, self._coord, self.options)
        except BaseException:
            self._unlock()
            raise
        self._committed_floor: int | None = local_steps[-1] if local_steps else None
        pin = torch.cuda.is_available() if self.options.pin_memory is None else self.options.pin_memory
        self._io = ThreadPoolExecutor(self.options.writer_threads, thread_name_prefix="tierckpt-io")
        self._hash = ThreadPoolExecutor(self.options.writer_threads, thread_name_prefix="tierckpt-hash")
        self._engine = Engine(local=self.local, remote=self.remote, rank=self.rank, world_size=self.world_size,
                              options=self.options, io=self._io, hash=self._hash, huge=self._huge, coord=self._coord,
                              pool=staging.StagingPool(slots=self.options.staging_buffers, pin=pin, huge=self._huge,
                                                       memory=_memory.open_tier(self.local.root, self.rank)
                                                       if self.options.memory_tier else None))
        self._engine.identity = run
        self._engine.peers = self._peers
        if self._peers is not None:
            self._peers.busy = lambda: self._pipeline.persisting  # copies pause while a save is written locally
        self._log = SaveLog(hooks, log_to=self.local.root if self.options.log_records else None)
        self._errors = BackgroundErrors()
        self._pipeline = SavePipeline(self._engine, track=self._track, background_error=self._errors.add,
                                      committed=self._committed, failed=self._log.write)
        self._last_step: int | None = None
        self._pending: set[Future] = set()
        self._closed = False
        self._retention = ReplicationPolicy(keep_local=self.options.keep_local, keep_remote=self.options.keep_remote,
                                            keep_every=self.options.keep_every,
                                            max_backlog=self.options.max_upload_backlog)
        self._bucket = None if self.options.upload_bandwidth_mbps is None else uploader.TokenBucket(
            self.options.upload_bandwidth_mbps * 1e6, burst=self.options.upload_bandwidth_mbps * 1e5)
        self._replicator: Replicator | None = None
        if self.remote is not None:
            self._replicator = _lifecycle.build_replicator(self._engine, self._retention, self._bucket,
                                                           resume=local_steps, on_done=self._log.write,
                                                           track=self._track)
            self._replicator.start()

    @property
    def components(self) -> Components:
        """The manager's components (staging pool, save pipeline, engine, replicator, coordinator), for
        diagnostics and tests; see :class:`~tierckpt.engine.core.Components`."""
        return Components(staging=self._engine.pool, pipeline=self._pipeline, engine=self._engine,
                          replicator=self._replicator, coordinator=self._coord)

    @property
    def remote(self) -> Store | None:
        """The remote tier's store (None: local only)."""
        return self._remote

    @remote.setter
    def remote(self, store: Store | None) -> None:
        self._remote = store
        replicator = getattr(self, "_replicator", None)
        if replicator is not None and store is not None:
            replicator.remote = store
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.remote = store

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any], metadata: Any = None) -> SaveHandle:
        """Snapshot ``state`` into host buffers and return; persisting and uploading continue in the background.

        Remote errors are never raised here (see :meth:`wait`, :meth:`health`).

        Returns:
            a :class:`SaveHandle` whose futures resolve as the step is staged, committed locally and uploaded.

        Raises:
            ValueError: ``step`` is not a non-negative int.
            CheckpointError: ``step`` is not after the last step saved, or an earlier step's local save failed
                (raised once).
            RollbackError: a newer step is committed and :meth:`rollback_to` was not called.
            TypeError: a value cannot be stored (named by its key path).
        """
        # a save builds a few objects per tensor and none in cycles: no collection pass in the middle (host/gcpause.py)
        with _gc.paused():
            return self._save(step, state, metadata)

    def _save(self, step: int, state: Mapping[str, Any], metadata: Any) -> SaveHandle:
        self._check_open()
        self._raise_background_error(local_only=True)
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise CheckpointError(f"step {step} is not after the last step this manager saved ({self._last_step})",
                                  step=step, tier="local", path=self.local.url)
        remote_steps = self._replicator.remote_steps() if self._replicator is not None else None
        _rollback.check(step, _rollback.newest_committed(self._committed_floor, remote_steps, self._last_step),
                        self.local.url)
        if metadata is not None:
            metadata = check_metadata(metadata)
        handle = SaveHandle(step)
        self._pipeline.submit(handle, state, metadata)
        self._last_step = step
        self._clock.saved(step)
        log.debug("save step %d: %s in %.3f s", step, "queued" if self.options.lazy_snapshot else "staged",
                  handle._record.stall_s)
        return handle

    def reserve_staging(self, state: Mapping[str, Any]) -> Future[float]:
        """Allocate the staging buffer that saving ``state`` needs and fault in its pages, on a background thread,
        so that the first ``save()`` blocks training no longer than later ones (otherwise that allocation is part
        of its stall: 2 GiB cost 0.1-1 s more on the reference VM, 3-6 s in a fresh process there, as after an
        in-place restore at a restart; pinning a large GPU state's buffer takes longer). Optional; call it once the
        state has its final layout: after the optimizer's first step (AdamW creates its moments there) or after
        ``restore()``. Returns a future of the seconds it took; a ``save()`` that comes first waits for it, and one
        whose state has grown since grows the buffer itself.

        Raises:
            CheckpointError: the manager is closed.
            TypeError: a value of ``state`` cannot be stored."""
        self._check_open()
        return self._pipeline.reserve(state)

    def snapshot_barrier(self) -> None:
        """Lazy snapshots: block until every snapshot taken so far is in host memory, so the state's tensors may
        change. Called automatically before ``optimizer.step()`` of every optimizer found in a saved state, and by
        ``restore()``; a no-op in the default (eager) mode."""
        self._pipeline.barrier()

    def _committed(self, handle: SaveHandle) -> None:
        """The pipeline committed ``handle``'s step locally: replicate it, or (local only) resolve and retain."""
        self._slow.observe(handle.step, handle._record.persist_s, handle._record.bytes, "local")
        copying = self._peers.committed(handle.step) if self._peers is not None else None
        if copying is not None:  # wait() covers the peer copy too; its failures are logged, never raised
            self._track(copying)
        if self._replicator is None:
            handle.uploaded.set_result(None)
            self._log.write(handle)
            _uploads.apply_local_retention(self._engine, self._retention)
        else:
            self._replicator.apply_local_retention()  # first: the local tier is trimmed when the upload resolves
            self._track(self._replicator.submit(handle.step, handle))

    # ------------------------------------------------------------------------------------------------ remote
    def health(self) -> Health:
        """Where both tiers stand: newest committed step per tier, upload lag in steps and seconds, the step being
        uploaded and those waiting, and the remote's failure streak with its last error. Cheap (one listing of the
        local folder, no remote request): meant for logs, dashboards and a training loop's periodic check."""
        health = _uploads.health(self._engine, self._replicator)
        peers = self._peers
        if peers is None:
            return health
        return dataclasses.replace(health, peer_step=peers.pushed, peer_failures=peers.failures,
                                   peer_last_error=peers.last_error)

    # ------------------------------------------------------------------------------------------------ policy
    def install_signal_handlers(self, signals=DEFAULT_SIGNALS) -> None:
        """On SIGTERM/SIGUSR1 (Slurm's ``--signal``), make :attr:`preempted` and :meth:`should_save` true, so the
        loop takes one last checkpoint at its next step boundary; ``close()`` then makes it durable.

        Raises:
            RuntimeError: when called off the main thread (Python installs signal handlers there only)."""
        self._preemption.install(signals)

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived."""
        return self._preemption.event.is_set()

    def should_save(self, step: int) -> bool:
        """True when the interval policy says ``step`` is due, or a preemption signal arrived."""
        return self.preempted or self._clock.due(self._policy, step)

    # ------------------------------------------------------------------------------------------------ waiting
    def _track(self, fut: Future) -> None:
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is durable on every configured tier; re-raise background errors once.

        Raises:
            TimeoutError: work is still pending after ``timeout`` seconds.
            CheckpointError: a background save failed, or an upload (:class:`UploadError`; the local copy is
                kept)."""
        _lifecycle.wait_for(self._pending, timeout)
        self._raise_background_error()

    def _raise_background_error(self, *, local_only: bool = False) -> None:
        """Re-raise the first background error not raised yet. ``local_only``: only failures to write the local
        tier; upload errors stay for ``wait()``/``close()``."""
        uploads = self._replicator.take_errors() if not local_only and self._replicator is not None else None
        self._errors.raise_first(uploads)

    # ------------------------------------------------------------------------------------------------ restore
    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *, source: str = "auto",
                strict: bool = True, in_place: bool = False) -> int | None:
        """Load the newest intact step (or exactly ``step``) into ``state`` in place; returns the step or None.

        By default a failed restore leaves the state as it was: from local files the large CPU tensors are read
        in place after each range's old bytes are saved into a staging buffer, and put back if anything fails
        (guarded); remote or compressed files are verified in the staging buffer before the state changes
        (staged). ``in_place=True`` reads CPU tensors' bytes straight into them and saves nothing (no state-sized
        buffer; the lean choice at start-up): still verified before this returns, a corrupt copy is still replaced
        by the next one, but if no copy verifies, those tensors are left partly overwritten. All read files that
        are not in the page cache around it (``direct_io``).

        Returns:
            the step restored, the same on every rank, or None when no tier holds a checkpoint.

        Raises:
            StateMismatchError: ``state`` does not match the checkpoint (a key, shape or dtype, named).
            CheckpointNotFoundError: ``step`` is given and no tier holds it.
            CorruptCheckpointError: no copy of any step verifies.
            StorageError: a tier that may hold the checkpoint could not be read (never None then).
            ValueError: a bad argument.
        """
        if not isinstance(in_place, bool):
            raise ValueError(f"in_place must be a bool, got {in_place!r}")
        tiers = self._read_tiers(step, source)
        return _reads.restore(self._engine, self._replicator, state, step, tiers, strict=strict, in_place=in_place)

    def load(self, step: int | None = None, *, source: str = "auto",
             keys: Sequence[str] | None = None) -> _load.LoadResult:
        """The newest intact step (or exactly ``step``) as plain Python values, with no state to load into.

        Returns a :class:`LoadResult` (a frozen dataclass: ``result.step``, ``result.tier``, ``result.state``,
        ``result.metadata``; it does not unpack as a tuple). ``state`` holds what ``save()`` was given, as it was
        saved: nested dicts (OrderedDicts stay OrderedDicts), lists, tuples, sets, Python scalars and bytes, numpy
        arrays, and CPU tensors (a ``torch.nn.Parameter`` comes back as a plain tensor, a CPU ``torch.Generator``
        as a generator); every object saved through ``state_dict()`` (a module, an optimizer) comes back as that
        ``state_dict()`` tree, not as an object. Each tensor and array is a fresh one that owns its memory (never
        a view of a buffer this manager reuses); one tensor saved under several keys (tied parameters) comes back
        as the same tensor object under each. Nothing is unpickled.

        ``step``: load exactly this step; :class:`CheckpointNotFoundError` if no allowed tier has it committed.
        ``source``: ``"auto"`` (the local tier, then the remote), ``"local"`` or ``"remote"``, as in
        :meth:`restore`. ``keys``: top-level keys of the saved state (e.g. ``["model"]``): only those sub-trees are
        returned and only the files and byte ranges that hold their tensors are read.

        Every returned byte is checksummed first, as in :meth:`restore`: a corrupt or missing copy in one tier is
        logged (naming the files) and the other tier's copy is tried, then, with ``step=None``, the next older
        step. Memory: one copy of the returned tensors; while a remote file is read, at most one compressed file
        or a few MiB per io thread more.

        Multi-rank jobs: each rank loads its own saved tree, independently (no collective call, so calling this on
        one rank or on all cannot deadlock; pass ``step`` so that every rank loads the same one). A DTensor entry
        comes back as the local shard this rank saved, as a plain tensor; one whose shard this rank did not store
        (a ``Replicate`` placement is stored by one rank only) comes back as None, with a warning. No global tensor
        is assembled (use :meth:`restore` into a sharded state for that). A rank the saving job did not have gets
        rank 0's tree, as in :meth:`restore`.

        Raises:
            CheckpointNotFoundError: no allowed tier holds a committed step (or ``step``).
            CorruptCheckpointError: copies exist, but none verifies.
            StorageError: a tier could not be listed and no other tier holds the step asked for (or any step).
            KeyError: a key of ``keys`` is not a top-level key of the loaded step (a :class:`StateMismatchError`
                naming it and the keys the step holds).
            ValueError: bad arguments.
        """
        _reads.check_keys(keys)
        return _reads.load(self._engine, self._replicator, step, self._read_tiers(step, source), keys)

    def _read_tiers(self, step: int | None, source: str) -> list[Store]:
        """The tiers a restore or load of ``step`` from ``source`` reads, once the saves made so far committed
        locally (the uploads go on). Raises ``ValueError`` for a bad ``step`` or ``source``."""
        self._check_open()
        _reads.check_source(step, source, self.remote)
        self.wait_persisted()  # a save still being written locally is loadable once it commits
        return [s for s in (self.local, self.remote) if s is not None and source in ("auto", s.tier)]

    def wait_persisted(self) -> None:
        """Block until every save made so far is committed on the local tier (uploads go on in the background):
        what :meth:`restore` and :meth:`load` do first, so that a save still being written is loadable once it
        commits. Framework plug-ins that read the tiers themselves call it too. Raises :class:`CheckpointError`
        if the manager is closed; a save that failed does not raise here (``wait()`` and the next ``save()`` do)."""
        self._check_open()
        self._pipeline.wait_persisted()

    def latest_step(self) -> int | None:
        """The newest committed step in any tier (committed = manifest present; restore verifies), or None when
        every tier answered and none holds a step. A tier that cannot be listed within ``remote_timeout_s`` is
        skipped with a warning where another tier holds a step, and raises :class:`StorageError` where none does
        (None would mean "start from scratch")."""
        self._check_open()
        tiers = [s for s in (self.local, self.remote) if s is not None]
        return _reads.latest_step(self._engine, self._replicator, tiers)

    def steps(self) -> list[StepInfo]:
        """Every step known in either tier, with where it is and its state. When the remote tier cannot be listed
        within ``remote_timeout_s`` (or is known to be failing: then it is not asked again), the local tier's steps
        are returned with a warning, failed uploads marked ``upload-failed``, or, if it holds none,
        :class:`StorageError` is raised."""
        self._check_open()
        return _uploads.steps(self._engine, self._replicator)

    # ------------------------------------------------------------------------------------------------ rollback
    def rollback_to(self, step: int) -> list[int]:
        """Make ``step`` the newest checkpoint of this run: every committed step after it, in every tier, is set
        aside: no longer a checkpoint (never restored, listed or deleted by retention), its data kept for
        inspection. Call it after restoring ``step`` to abandon a run (a loss spike), before the next ``save()``;
        every rank of a multi-rank job calls it.

        Local folders (and a remote given as a path) are renamed to ``aside-step-<N>-<id>``; on an object store
        the step's ``manifest.json`` moves to ``manifest.aside.json`` in its folder (``tierckpt prune
        --leftovers`` removes such folders once they are older than its ``--min-age``). Returns the steps set
        aside. Raises :class:`StorageError` if the remote cannot be listed within ``remote_timeout_s`` (nothing
        is then set aside anywhere)."""
        self._check_open()
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._pipeline.wait_persisted()
        newer = _rollback.set_aside_newer(self._engine, self._replicator, step)
        self._committed_floor = step if self._committed_floor is None else min(self._committed_floor, step)
        self._last_step = None if self._last_step is None or self._last_step <= step else step
        return newer

    def add_on_record(self, hook: Callable[[SaveRecord], None]) -> None:
        """Add an ``on_record`` hook after construction (a metrics exporter attached later); a hook already there
        is not added twice. ``ValueError`` if ``hook`` is not callable."""
        self._log.add_hook(hook)

    def records(self) -> list[SaveRecord]:
        """Records of this manager's saves, oldest first."""
        return self._log.records()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            folder_lock.release(fd)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (then every other call raises :class:`CheckpointError`)."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed", path=self.local.url)

    def close(self, *, timeout: float | None = None, raise_upload_errors: bool = True) -> None:
        """Wait for pending work, stop the background threads and release the folder. Idempotent.

        Every save is committed locally first. Then the uploads: while the remote answers, close waits for the
        steps still queued (each bounded by ``upload_deadline_s`` and, for a silent remote, ``remote_timeout_s``);
        once the remote fails, or if it was failing already, no further step is tried: close returns after the
        upload in progress, logs once which committed steps the remote lacks (kept locally: the next start resumes
        them, or ``tierckpt sync``), and raises the first upload error, or only logs it with
        ``raise_upload_errors=False`` (what the Lightning and Hugging Face plug-ins do unless ``strict_uploads``).

        Raises:
            CheckpointError: a local save failed; :class:`UploadError` as above; :class:`RunConflictError` always
                (the threads stop and the folder is released all the same).
            TimeoutError: work is still pending after ``timeout`` seconds."""
        if self._closed:
            return
        try:
            if self._replicator is None:
                self.wait(timeout)
            else:
                self._replicator.begin_close()
                _lifecycle.wait_for(self._pending, timeout)
                self._errors.raise_first()
                _uploads.report_unfinished(self._engine, self._replicator, self._replicator.take_errors(),
                                           raise_errors=raise_upload_errors)
        finally:
            self._closed = True
            _lifecycle.stop(self._engine, self._replicator, self._pipeline, self._preemption, timeout)
            self._unlock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_exc:  # do not mask the training loop's exception
            log.error("closing the checkpoint manager after an error also failed: %s", close_exc)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False and getattr(self, "_lock_fd", -1) >= 0:
            try:
                self._unlock()
            except Exception:
                pass


def _common_steps(everyone: list[list[int]]) -> list[int]:
    """The steps every rank holds (rank 0 computes it at start-up): the only ones a multi-rank job resumes."""
    return sorted(set(everyone[0]).intersection(*map(set, everyone[1:])))
