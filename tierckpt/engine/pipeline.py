"""The save path of a :class:`~tierckpt.CheckpointManager`: snapshot into a staging slot, persist to the local tier,
hand the committed step on.

:class:`SavePipeline` owns the save's machinery: the snapshot plan (cached per state layout), the copy stream, the
snapshot thread (lazy snapshots), the persist thread, and the optimizer hooks that make a lazy snapshot finish
before ``optimizer.step()``. The manager validates each save (step order, rollback, metadata) and owns what follows
a commit (replication, retention, records), which the pipeline reaches through the callbacks it was built with.

Order of calls: :meth:`SavePipeline.submit` once per save, from the caller's thread; :meth:`barrier` before the
state's tensors may change (lazy snapshots); :meth:`wait_persisted` before reading the tiers; :meth:`reserve` at
any time; :meth:`close` once, after the manager waited for the pending work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from .. import faults
from ..format import layout
from ..format.plan import SnapshotPlan, make_plan
from ..handle import SaveHandle
from ..host import gcpause as _gc
from ..snapshot import capture, copier, staging, tree
from ..tiers import writer
from . import sharded as _sharded
from .core import Engine

log = logging.getLogger(__name__)


class SavePipeline:
    """Snapshots and persists the saves of one manager (see the module docstring).

    ``track``: registers a future the manager's ``wait()`` waits for. ``background_error``: records an error for
    the manager's next call to raise. ``committed(handle)``: the step is committed locally (the manager replicates
    and retains). ``failed(handle)``: the step's local save failed (its futures already hold the error)."""

    def __init__(self, eng: Engine, *, track: Callable[[Future[Any]], None],
                 background_error: Callable[[BaseException, str], None],
                 committed: Callable[[SaveHandle], None], failed: Callable[[SaveHandle], None]) -> None:
        self._eng = eng
        self._track, self._background_error = track, background_error
        self._committed, self._failed = committed, failed
        opts = eng.options
        overlap = opts.overlap_writes
        self._overlap = copier.overlap_pays(opts.writer_threads) if overlap is None else overlap
        self._copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        #: the single threads that persist each step and take each lazy snapshot, in order
        self.persist_thread = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-persist")
        self.snapshot_thread = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-snapshot")
        self._lazy_pending: set[Future[Any]] = set()
        self._persisting: set[Future[Any]] = set()
        self._hooks: dict[int, Any] = {}
        self._plan: SnapshotPlan | None = None
        self._locations: list[tuple[int, int]] = []

    @property
    def overlap(self) -> bool:
        """Whether the persist job writes each file while the rest of the snapshot is still being copied."""
        return self._overlap

    @property
    def persisting(self) -> bool:
        """Whether a save is being written to the local tier now (the peer copies yield to it)."""
        return bool(self._persisting)

    @property
    def plan(self) -> SnapshotPlan | None:
        """The snapshot plan of the last state saved or reserved (kept while its layout does not change)."""
        return self._plan

    # --------------------------------------------------------------------------------------------- saving
    def submit(self, handle: SaveHandle, state: Mapping[str, Any], metadata: Any) -> None:
        """Take the snapshot of ``state`` for ``handle``'s step: copied now (eager), or captured now and copied on
        the snapshot thread (``lazy_snapshot``); either way persisted on the persist thread. Sets the record's
        stall. Raises what the snapshot raises on the caller's thread (``TypeError`` for a value it cannot
        store, a staging failure); a background failure fails the handle's futures instead."""
        if self._eng.options.lazy_snapshot:
            # only what may change once save() returns is taken now; the snapshot thread does the rest
            job = (handle, capture.capture(state), capture.capture({"m": metadata})["m"])
            self._watch_optimizers(state)
            owner = self.snapshot_thread.submit(self._lazy_snapshot, *job)
            self._lazy_pending.add(owner)
            owner.add_done_callback(self._lazy_pending.discard)
            self._track(owner)
            handle._record.stall_s = handle.elapsed()
            return
        # steady state: the memo of the last flatten and the plan's cached records make this cost little per tensor
        stage, progress = self._start(handle, self._flatten(state), metadata, layout_checked=True)
        try:
            stage()
            handle._record.stall_s = handle.staged.result()
        finally:
            progress.release()  # training no longer waits: hashing may use the CPU now

    def reserve(self, state: Mapping[str, Any]) -> Future[float]:
        """Allocate and fault in the staging slot a save of ``state`` needs, on a background thread (see
        :meth:`CheckpointManager.reserve_staging`); returns a future of the seconds it took."""
        self.barrier()  # a lazy snapshot being planned on the snapshot thread sees the plan it made
        flat = self._flatten(state)
        flat.values.clear()  # only the layout is needed: hold no reference to the caller's tensors
        fut = self._eng.pool.reserve(self._plan_for(flat).buffer_bytes)
        self._track(fut)
        return fut

    def barrier(self) -> None:
        """Block until every lazy snapshot taken so far is in host memory (a no-op in the eager mode)."""
        pending = list(self._lazy_pending)
        if pending:
            wait_futures(pending)

    def wait_persisted(self) -> None:
        """Block until every save submitted so far is committed locally or failed."""
        self.barrier()
        wait_futures(list(self._persisting))

    def close(self) -> None:
        """Stop the snapshot and persist threads (after their queued work) and remove the optimizer hooks."""
        self.snapshot_thread.shutdown(wait=True)
        self.persist_thread.shutdown(wait=True)
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()

    # --------------------------------------------------------------------------------------------- internals
    def _start(self, handle: SaveHandle, flat: tree.FlatState, metadata: Any, *,
               layout_checked: bool) -> tuple[Callable[[], None], staging.CopyProgress]:
        """Plan the snapshot of ``flat``, take a staging slot (waiting for one: back-pressure) and hand the persist
        job its files; returns the copy into the slot (``stage``, for the caller to run) and its progress.
        ``layout_checked``: ``flat`` was flattened right now on this thread (see ``copier.copy_into``)."""
        plan, locations = self._plan_for(flat), self._locations
        leaves_meta, file_leaves = _leaf_records(plan, locations, flat)
        pool = self._eng.pool
        slot = pool.acquire(plan.buffer_bytes)
        values = flat.values
        # with overlap, the persist job writes each file while the rest is still being copied (pipelined copy)
        progress = staging.CopyProgress([f.size for f in plan.files])
        writers = self._eng.options.writer_threads

        def stage() -> None:
            try:
                faults.point("staging")
                copier.copy_into(slot, plan, locations, flat, copy_stream=self._copy_stream,
                                  executor=pool.copy_executor(), progress=progress if self._overlap else None,
                                  waves=writers, layout_checked=layout_checked)
            except BaseException as exc:
                progress.fail(exc)  # the persist job gives up on these bytes and releases the slot
                raise
            finally:
                values.clear()  # drop references to the caller's tensors
            handle.staged.set_result(handle.elapsed())  # before the persist job can report this step durable
            progress.finish()

        rec = handle._record
        try:  # until a background job owns the slot, a failure here must give it back
            files = [writer.StagedFile(f.part, view, f.data_start, order, progress.waiter(f.part))
                     for f, view, order in zip(plan.files, slot.file_views(plan), file_leaves)]
            rec.bytes, rec.tensors, rec.files = plan.total_bytes, len(leaves_meta), len(files)
            job = self.persist_thread.submit(self._persist_job, handle, slot, files, leaves_meta, flat.tree, metadata,
                                       progress)
            self._track(job)
            self._persisting.add(job)
            job.add_done_callback(self._persisting.discard)
        except BaseException:
            values.clear()
            pool.release(slot)
            raise
        return stage, progress

    def _flatten(self, state: Mapping[str, Any]) -> tree.FlatState:
        return tree.flatten(state, None if self._plan is None else self._plan.cache.get("flatten"))

    def _plan_for(self, flat: tree.FlatState) -> SnapshotPlan:
        """The snapshot plan (files, offsets) of a flattened state: the last one when the layout is unchanged."""
        if self._plan is None or self._plan.signature != flat.specs:
            opts = self._eng.options
            self._plan = make_plan(flat.specs, file_bytes=opts.file_size_mb << 20, min_files=opts.writer_threads)
            self._locations = staging.leaf_locations(self._plan)
        self._plan.cache["flatten"] = flat.memo
        return self._plan

    def _lazy_snapshot(self, handle: SaveHandle, state: dict[str, Any], metadata: Any) -> None:
        """The snapshot thread's part of a lazy save: flatten what ``save()`` captured, plan, take a slot, start the
        persist job and copy, while training goes on until the next barrier. A failure fails the save's futures
        and is re-raised by the manager's next call."""
        try:
            with _gc.paused():
                stage, progress = self._start(handle, self._flatten(state), metadata, layout_checked=False)
            stage()
            progress.release()
        except BaseException as exc:
            self._background_error(exc, f"snapshot of step {handle.step} failed")
            for f in (handle.staged, handle.persisted, handle.uploaded):
                if not f.done():
                    f.set_exception(exc)

    def _watch_optimizers(self, state: Any, depth: int = 0) -> None:
        if depth > 3:
            return
        values = state.values() if isinstance(state, Mapping) else state if isinstance(state, (list, tuple)) else ()
        for v in values:
            if isinstance(v, torch.optim.Optimizer):
                if id(v) not in self._hooks:
                    self._hooks[id(v)] = v.register_step_pre_hook(lambda *_a, **_k: self.barrier())
            elif isinstance(v, (Mapping, list, tuple)):
                self._watch_optimizers(v, depth + 1)

    def _persist_job(self, handle: SaveHandle, slot: staging.Slot, files: list[writer.StagedFile],
                     leaves_meta: list[writer.LeafMeta], tree_json: Any, metadata: Any,
                     progress: staging.CopyProgress) -> None:
        """Write, commit and hand on one step. Runs while the snapshot is still being copied in (its files wait for
        their bytes); if that copy fails, the stage reports it, and this job only cleans up and releases the slot."""
        eng, step = self._eng, handle.step
        released = []

        def release() -> None:  # exactly once: the slot may be re-acquired by the next save() right after
            if not released:
                released.append(True)
                eng.pool.release(slot)

        try:
            sid = layout.new_save_id() if eng.coord is None else _sharded.save_id(eng.coord.topology.run_id, step)
            snap = writer.RankSnapshot(step, eng.rank, eng.world_size, sid, files, leaves_meta, tree_json, metadata,
                                       progress.wait_released)
            if eng.coord is None:
                writer.persist(eng.local, snap, eng.io, eng.hash, eng.incremental)
            else:  # with a memory tier the slot stays held until the step is committed: it becomes the memory copy
                _sharded.persist(eng, snap, release=release if not slot.shared else lambda: None)
        except BaseException as exc:
            release()
            if progress.failed is not None:  # save() raised it (eager) or _lazy_snapshot reported it (lazy)
                log.debug("tier local: step %d not written: its snapshot failed (%s)", step, progress.failed)
                return
            handle._record.error = str(exc)
            self._background_error(exc, f"saving step {step} to the local tier failed")
            handle.persisted.set_exception(exc)
            if not handle.uploaded.done():
                handle.uploaded.set_exception(exc)
            self._failed(handle)
            return
        memory = eng.pool.memory
        if memory is not None and slot.shared and slot.buffer is not None:  # committed locally: commit the memory copy
            memory.commit_slot(eng.local, slot.index, slot.buffer.data_ptr(), step, [f.data for f in files],
                               staged=(files, leaves_meta))
        release()
        handle._record.persist_s = handle.elapsed()
        handle.persisted.set_result(handle._record.persist_s)
        self._committed(handle)


def _leaf_records(plan: SnapshotPlan, locations: list[tuple[int, int]],
                  flat: tree.FlatState) -> tuple[list[writer.LeafMeta], list[tuple[int, ...]]]:
    """Every leaf's record and every file's leaf order for a snapshot of ``flat`` under ``plan``.

    A save of a state laid out like the previous one (same plan, key paths, kinds and shards) gets the previous
    lists back: they are never mutated (the persist thread only reads them), and rebuilding them costs a few
    microseconds per tensor.
    """
    cached = plan.cache.get("records")
    if cached is not None and cached[0] == flat.paths and cached[1] == flat.kinds and cached[2] == flat.shards:
        return cached[3], cached[4]
    meta = [writer.LeafMeta(s.name, p, s.dtype, s.shape, k, loc[0], loc[1], s.nbytes, sh)
            for s, p, k, sh, loc in zip(flat.specs, flat.paths, flat.kinds, flat.shards, locations)]
    file_leaves = [tuple(t.leaf for t in f.tensors) for f in plan.files]
    plan.cache["records"] = (flat.paths, flat.kinds, flat.shards, meta, file_leaves)
    return meta, file_leaves
