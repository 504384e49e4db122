"""The DCP storage writer and async stager of :mod:`tierckpt.dcp`."""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import threading
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import storage as _storage
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from ..errors import CheckpointError
from ..snapshot import hostcopy
from ._metadata import (
    DATA_KEY,
    META_KEY,
    UNCLAIMED_TIMEOUT_S,
    Record,
    _parse_step,
    _RankTag,
    metadata_to_json,
    storage_key,
)

if TYPE_CHECKING:
    from ..manager import CheckpointManager


# ------------------------------------------------------------------------------------------------ stager <-> writer
class _Staged:
    """One state staged by a :class:`Stager`, until a DCP save thread's writer has handed it to ``mgr.save``."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.staged_by = threading.current_thread()
        self.thread: threading.Thread | None = None  # the DCP save thread that took it
        self.created = time.monotonic()

    def wait(self) -> None:
        """Until the state was copied by ``mgr.save``, or the save thread that took it ended (a failed save)."""
        while not self.done.wait(0.05):
            if self.thread is not None and not self.thread.is_alive():
                return
            if self.thread is None and time.monotonic() - self.created > UNCLAIMED_TIMEOUT_S:
                raise RuntimeError(
                    f"tierckpt.dcp.Stager: the state staged {UNCLAIMED_TIMEOUT_S:.0f} s ago was never taken by a "
                    "tierckpt.dcp.StorageWriter's save thread: pass the Stager only with a tierckpt.dcp.StorageWriter "
                    "of the same manager, and with the default (thread) async checkpointer")


class _Tracker:
    """Per manager: the states staged and not yet handed to ``mgr.save`` (oldest first), and the thread of the
    newest DCP save that went through a :class:`StorageWriter` of this manager."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[_Staged] = []
        self.last: _Staged | None = None
        self.saving: threading.Thread | None = None

    def push(self) -> _Staged:
        s = _Staged()
        with self.lock:
            self.pending.append(s)
            self.last = s
        return s

    def claim(self) -> _Staged | None:
        """Called first thing by a DCP save of this manager, on the thread that runs it. Returns the oldest staged
        state for this save; None in the thread that staged it (a synchronous ``dcp.save`` there saves its own
        state). A save that takes a staged state runs on an ``async_save`` thread of its own: it first waits until
        the previous such thread has ended (its save done, DCP's last collective included), so that two saves'
        collectives never interleave on one process group and the saves reach ``mgr.save`` in order."""
        me = threading.current_thread()
        taken = None
        with self.lock:
            for i, s in enumerate(self.pending):
                if s.staged_by is not me:
                    del self.pending[i]
                    s.thread = me
                    taken = s
                    break
            prev = self.saving
            if taken is not None:
                self.saving = me
        if taken is not None and prev is not None and prev is not me:
            prev.join()  # a save thread of an earlier async_save with a Stager: it ends with its save
        return taken


_trackers: weakref.WeakKeyDictionary[Any, _Tracker] = weakref.WeakKeyDictionary()
_trackers_lock = threading.Lock()


def _tracker(mgr: CheckpointManager) -> _Tracker:
    with _trackers_lock:
        t = _trackers.get(mgr)
        if t is None:
            t = _trackers[mgr] = _Tracker()
        return t


# ------------------------------------------------------------------------------------------------ writer
class StorageWriter(_storage.StorageWriter):
    """DCP storage writer: one ``dcp.save``/``dcp.async_save`` = one tierckpt step ``step`` of ``mgr``.

    Every rank of DCP's group saves its items through ``mgr.save(step, ...)`` (so call it on every rank, as DCP
    requires anyway); ``write_data`` returns once the step is committed on the local tier (``handle.persisted``),
    the upload to the remote tier continuing in the background. ``metadata`` is passed to ``mgr.save`` (tierckpt's
    per-step user metadata). ``checkpoint_id=`` given to DCP, if any, must name the step (it replaces ``step``):
    an int, digits, or a path ending in ``step-<N>``. Use one writer per save."""

    def __init__(self, mgr: CheckpointManager, step: int, *, metadata: Any = None) -> None:
        super().__init__()
        self.mgr = mgr
        self.step = _parse_step(step)
        self.user_metadata = metadata
        self._staged: _Staged | None = None
        self.reset()

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self._claim()  # DCP calls this first, on the save's thread; a bad id then ends that thread
            self.step = _parse_step(checkpoint_id)
        self.is_coordinator = False
        self._rank: int | None = None
        self._plans: list[SavePlan] | None = None
        self._expected: dict[MetadataIndex, Record] | None = None

    def _claim(self) -> None:
        if self._staged is None:
            self._staged = _tracker(self.mgr).claim()

    def _release(self) -> None:
        if self._staged is not None:
            self._staged.done.set()

    def storage_meta(self) -> StorageMeta | None:
        self._claim()  # the first call of a DCP save on its thread (without checkpoint_id)
        return StorageMeta(checkpoint_id=f"{self.mgr.local.url}#step={self.step}", save_id=f"step-{self.step}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._claim()
        self.is_coordinator = is_coordinator
        self._rank = kwargs.get("rank")
        if kwargs.get("use_collectives", True) is False:
            self._release()
            raise ValueError("tierckpt.dcp.StorageWriter needs DCP's collectives (use_collectives=True): the "
                             "coordinator writes the global metadata into the step")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP from a checkpoint_id alone: pass storage_writer=

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = [dataclasses.replace(p, storage_data=_RankTag(i)) for i, p in enumerate(plans)]
        self._plans = plans
        return plans

    def _global_records(self, planner: SavePlanner) -> dict[MetadataIndex, Record]:
        plans = getattr(planner, "global_plan", None) or self._plans
        if plans is None:
            raise RuntimeError("tierckpt.dcp: the coordinator has no global plan")
        return {item.index: Record(rank, storage_key(item.index)) for rank, p in enumerate(plans) for item in p.items}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[_storage.WriteResult]]:
        try:
            return self._write(plan, planner)
        finally:
            self._release()

    def _write(self, plan: SavePlan, planner: SavePlanner) -> Future[list[_storage.WriteResult]]:
        tag = plan.storage_data
        rank = tag.rank if isinstance(tag, _RankTag) else (self._rank if self._rank is not None else 0)
        if rank != self.mgr.rank:
            raise ValueError(f"tierckpt.dcp: DCP rank {rank} is tierckpt rank {self.mgr.rank}: DCP's process group "
                             "must be the manager's world (the default process_group=None)")
        data: dict[str, Any] = {}
        results = []
        for item in plan.items:
            key = storage_key(item.index)
            value = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value.read())
                data[key] = raw
                size = len(raw)
            else:
                t = value.detach()
                data[key] = t
                size = t.numel() * t.element_size()
            results.append(_storage.WriteResult(index=item.index, size_in_bytes=size, storage_data=Record(rank, key)))
        state: dict[str, Any] = {DATA_KEY: data}
        if self.is_coordinator:
            md = getattr(planner, "metadata", None)
            if not isinstance(md, Metadata):
                raise TypeError("tierckpt.dcp needs a save planner that keeps the global Metadata in .metadata after "
                                "create_global_plan (DefaultSavePlanner does)")
            self._expected = self._global_records(planner)
            state[META_KEY] = metadata_to_json(md, self._expected)
        handle = self.mgr.save(self.step, state, metadata=self.user_metadata)
        handle.staged.result()  # the state is copied: a Stager may reuse its buffers
        self._release()
        handle.persisted.result()  # committed on the local tier on every rank: DCP's "saved"
        fut: Future[list[_storage.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[_storage.WriteResult]]) -> None:
        """Coordinator: check that what every rank stored is what the metadata in the step says; writes nothing
        (the step is already committed, metadata included). Fills ``metadata.storage_data`` for DCP's caller."""
        got = {wr.index: wr.storage_data for rs in results for wr in rs}
        if self._expected is not None and got != self._expected:
            extra = set(got) ^ set(self._expected)
            raise CheckpointError(f"tierckpt.dcp: the ranks stored items other than the global plan said "
                                  f"({len(extra)} differ, e.g. {next(iter(extra), None)}); step {self.step} holds "
                                  "the coordinator's metadata", step=self.step)
        metadata.storage_data = got


# ------------------------------------------------------------------------------------------------ stager
class Stager(AsyncStager):
    """``async_stager`` for ``dcp.async_save``: ``stage`` copies the state into host buffers that it keeps and
    reuses (one per tensor path, reused while the shape and dtype stay the same; pinned when the source is on a GPU),
    so each async save costs one copy, not an allocation and a copy. CPU tensors of 1 MiB and more are copied by
    tierckpt's native copy where it is built. A DTensor is staged as a DTensor (same mesh, placements and global
    shape) over a staged local shard; non-tensor values are deep-copied; containers are rebuilt.

    Before it overwrites its buffers, ``stage`` waits until the previous staged state of the same manager was copied
    by ``mgr.save`` in its DCP save thread (or that thread ended), and each save thread that took a staged state
    starts its collectives only once the previous one has ended: back-to-back ``async_save`` calls are safe (their
    collectives never interleave on one process group), and the saves reach ``mgr.save`` in the order they were
    staged. The state then travels through DCP's planning in the save thread and is copied once more by
    ``mgr.save`` into the manager's staging buffer; that copy is off the training thread. ``stage`` returns a state
    dict (not a future): ``async_save`` returns when the copy is done."""

    _synchronize_after_execute = False

    def __init__(self, mgr: CheckpointManager) -> None:
        self.mgr = mgr
        self._buffers: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            tracker = _tracker(self.mgr)
            prev = tracker.last
            if prev is not None:
                prev.wait()
            keep: dict[tuple, Any] = {}
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            out = self._stage(state_dict, (), keep, pairs)
            self._copy(pairs)
            self._buffers = keep
            tracker.push()
            return out

    def _stage(self, value: Any, path: tuple, keep: dict, pairs: list) -> Any:
        DTensor = _dtensor_type()
        if isinstance(value, DTensor):
            local = value.to_local().detach()
            old = self._buffers.get(path)
            if (isinstance(old, DTensor) and old.shape == value.shape and old.dtype == value.dtype
                    and old.placements == value.placements and old.device_mesh == value.device_mesh
                    and old.to_local().shape == local.shape):
                staged = old
            else:
                staged = _dtensor_over(value, self._buffer(local))
            keep[path] = staged
            pairs.append((staged._local_tensor, local))
            return staged
        if isinstance(value, torch.Tensor):
            old = self._buffers.get(path)
            src = value.detach()
            if (isinstance(old, torch.Tensor) and old.shape == src.shape and old.dtype == src.dtype
                    and old.is_pinned() == src.is_cuda):
                buf = old
            else:
                buf = self._buffer(src)
            keep[path] = buf
            pairs.append((buf, src))
            return buf
        if isinstance(value, Mapping):
            items = [(k, self._stage(v, (*path, k), keep, pairs)) for k, v in value.items()]
            return collections.OrderedDict(items) if isinstance(value, collections.OrderedDict) else dict(items)
        if isinstance(value, list):
            return [self._stage(v, (*path, i), keep, pairs) for i, v in enumerate(value)]
        if isinstance(value, tuple) and type(value) is tuple:
            return tuple(self._stage(v, (*path, i), keep, pairs) for i, v in enumerate(value))
        if value is None or isinstance(value, (int, float, str, bytes, bool, torch.dtype, torch.device)):
            return value
        return copy.deepcopy(value)

    @staticmethod
    def _buffer(src: torch.Tensor) -> torch.Tensor:
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=bool(src.is_cuda))

    @staticmethod
    @torch.no_grad()
    def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        cpu = [(d, s) for d, s in pairs if not s.is_cuda]
        for d, s in cuda:
            d.copy_(s, non_blocking=True)
        if cpu:
            rest_d, rest_s = hostcopy.copy_pairs([d for d, _ in cpu], [s for _, s in cpu])
            for d, s in zip(rest_d, rest_s):
                d.copy_(s)
        for dev in {s.device for _, s in cuda}:
            torch.cuda.current_stream(dev).synchronize()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once its copy is done."""

    def close(self) -> None:
        """Drop the buffers (the next ``stage`` allocates again)."""
        with self._lock:
            self._buffers = {}


def _dtensor_over(value: Any, local: torch.Tensor) -> Any:
    """A DTensor like ``value`` (mesh, placements, global shape and stride) whose local shard is ``local``, built
    without moving ``local`` to the mesh's device."""
    return _dtensor_type()(local, value._spec, requires_grad=False)


def _dtensor_type() -> type:
    try:
        from torch.distributed.tensor import DTensor  # torch >= 2.5
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor
    return DTensor


