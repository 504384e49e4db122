"""A Lightning ``CheckpointIO`` plug-in that saves through a :class:`~tierckpt.CheckpointManager` (docs/lightning.md).

```python
from tierckpt.lightning import TieredCheckpointIO
io = TieredCheckpointIO("/local_nvme/ckpt", remote="s3://bucket/run", keep_local=2)
trainer = L.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath=d, every_n_train_steps=50, save_last=True)])
trainer.fit(model, ckpt_path="last")
```

How Lightning's paths map to tierckpt steps:

- ``save_checkpoint(checkpoint, path)`` saves ``checkpoint`` as step ``checkpoint["global_step"]`` (asynchronously:
  it returns once the snapshot is copied; no ``AsyncCheckpointIO`` is needed) and writes a small JSON *marker* at
  ``path`` (``{"tierckpt_step": N, "root": ..., ...}``, never the weights), so that Lightning's own bookkeeping
  (``ckpt_path="last"`` looks for ``last*.ckpt`` files, ``ModelCheckpoint`` checks files exist) sees a file.
- A second save at the same step (Lightning saves the step's file and then ``last.ckpt``) makes no second
  checkpoint: it writes only its marker. What differs between the two calls' dicts in ``checkpoint["callbacks"]``
  (``ModelCheckpoint`` sets ``last_model_path`` before saving ``last.ckpt``) is kept in that marker, exactly (small
  tensors as their bytes), and put back when that path is loaded, so each path loads what Lightning gave for it.
- ``load_checkpoint(path)``: a path whose file name is ``last.ckpt`` / ``last-vN.ckpt`` loads the newest intact
  step (``mgr.load()``: a corrupt or missing copy falls back to the other tier, then to the next older step, with a
  warning naming the files). Any other path loads its marker's step (or, without a marker, the step this process
  saved under that path, or ``step=N`` parsed from the file name); when no copy of that step is intact, the newest
  intact older step is loaded, with a warning.
- ``remove_checkpoint(path)`` (``ModelCheckpoint``'s top-k deletions) removes the marker only; the step's data is
  left to tierckpt's retention (``keep_local`` / ``keep_remote``), which never deletes a tier's newest step nor a
  step not yet replicated beyond ``max_upload_backlog``. A marker whose step retention deleted no longer loads.
- Resuming from an older step than the newest committed one (an explicit path, ``"best"``) and training on: the
  first save after it calls ``mgr.rollback_to(<loaded step>)``, which sets the newer steps aside (kept, never
  restored) with a warning, as Lightning would overwrite their files.

What the checkpoint dict may hold: what :mod:`tierckpt.snapshot.tree` stores (no pickling). Lightning's own
entries (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks`` with keys such as
``"ModelCheckpoint{...}"``, ``pytorch-lightning_version``, ``hparams_name``, ``hyper_parameters``) store as they
are; ``AttributeDict`` and other ``Mapping`` subclasses come back as plain ``dict`` (Lightning reads them as
mappings). A value of any other type (an arbitrary object in ``save_hyperparameters()``) raises ``TypeError``
naming its key path.

Processes: Lightning calls ``save_checkpoint`` / ``remove_checkpoint`` on global rank 0 only (the replicas of DDP
hold the same state), so the manager is one single-rank manager (``rank=0, world_size=1``) in that process. Loading
(``load_checkpoint`` runs on every rank): rank 0 loads through its manager; every other rank reads what rank 0
saved without its folder lock (:mod:`tierckpt.readonly`): from the same local folder on rank 0's node, from the
remote tier on the other nodes (a multi-node DDP job needs ``remote``). FSDP and ModelParallel strategies bypass
``CheckpointIO`` for sharded checkpoints (they write torch.distributed.checkpoint folders themselves): use tierckpt's
own manager per rank with the DTensor state (docs/distributed.md) there.

Logging: the plug-in keeps each save's :class:`~tierckpt.handle.SaveRecord` (they arrive on a background thread once
the save is resolved in every tier); add :class:`TieredCheckpointLogger` to the Trainer's callbacks and it logs
``checkpoint/stall_s``, ``checkpoint/persist_s``, ``checkpoint/upload_s`` and ``checkpoint/upload_lag_steps``
through the Trainer's loggers, from the training thread, at the step each record belongs to.

End of the run: Lightning calls :meth:`TieredCheckpointIO.teardown` as ``fit`` ends, which closes the manager:
every save is committed locally, then the uploads are waited for while the remote answers. During an outage that
takes about one failed upload attempt (bounded by ``remote_timeout_s`` / ``upload_deadline_s``); the steps the
remote lacks are logged as an error, kept locally (the next start uploads them, or ``tierckpt sync``) and listed in
``final_health``, and ``fit`` returns normally, unless ``strict_uploads=True``, which raises the
:class:`~tierckpt.errors.UploadError`.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from .. import readonly
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, RollbackError
from ..handle import SaveRecord
from ..manager import CheckpointManager
from ..replication import Health
from ..replication.health import health_after_close
from ._marker import MARKER_KEY, copy_tree, decode, encode, equal, read_marker, write_marker

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
    from lightning_fabric.utilities.cloud_io import get_filesystem  # type: ignore[no-redef]
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

log = logging.getLogger(__name__)

__all__ = ["TieredCheckpointIO", "TieredCheckpointLogger"]

#: Tensors larger than this in a differing callback state are not kept in a marker (see :meth:`_overrides`).
MAX_OVERRIDE_TENSOR_BYTES = 1 << 16
_LAST_NAME = re.compile(r"^last(-v?\d+)?$")
_STEP_IN_NAME = re.compile(r"step=(\d+)")
#: records kept for a :class:`TieredCheckpointLogger` (the oldest are dropped when no logger takes them)
MAX_BUFFERED_RECORDS = 1000


class _ReadOnly:
    """What ``load_checkpoint`` needs of a manager (``load``, ``steps``), for a rank that does not own the folder."""

    def __init__(self, local_dir: str, remote: str | None, options: dict[str, Any]) -> None:
        self.local_dir, self.remote = local_dir, remote
        self.storage_options = options.get("storage_options")
        self.timeout_s = options.get("remote_timeout_s", 30.0)

    def load(self, step: int | None = None) -> Any:
        return readonly.load(self.local_dir, remote=self.remote, step=step, storage_options=self.storage_options,
                             timeout_s=self.timeout_s)

    def steps(self) -> list[Any]:
        found = readonly.committed_steps(self.local_dir, remote=self.remote, storage_options=self.storage_options,
                                         timeout_s=self.timeout_s)
        return [SimpleNamespace(step=s) for s in found]


class TieredCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` saving asynchronously to tierckpt's local and remote tiers.

    Args:
        local_dir, remote, **manager_options: as :class:`~tierckpt.CheckpointManager`; the manager is created on
            first use (and again after :meth:`teardown`). ``rank`` / ``world_size`` default to 0 / 1: Lightning
            saves from global rank 0 only.
        strict_uploads: whether an upload error at the end of the run (:meth:`teardown`, which Lightning calls as
            ``fit`` ends) is raised from ``fit``. False (the default): the run finishes; the steps the remote lacks
            are logged as an error, kept locally (the next start uploads them, or ``tierckpt sync``) and listed in
            :attr:`final_health`. True: ``fit`` raises the first :class:`~tierckpt.errors.UploadError` (every
            step is committed locally all the same). A :class:`~tierckpt.errors.RunConflictError` is always raised.

    Attributes:
        final_health: the manager's :meth:`~tierckpt.CheckpointManager.health` when :meth:`teardown` closed it
            (None before): ``waiting`` holds the committed steps the remote lacked, ``last_error`` the remote's last
            error, ``ok`` False when it was failing then.
    """

    def __init__(self, local_dir: str | os.PathLike[str], remote: str | os.PathLike[str] | None = None, *,
                 strict_uploads: bool = False, **manager_options: Any) -> None:
        super().__init__()
        if not isinstance(strict_uploads, bool):
            raise TypeError(f"strict_uploads must be a bool, got {strict_uploads!r}")
        self.local_dir = os.fspath(local_dir)
        self.remote = None if remote is None else os.fspath(remote) if isinstance(remote, os.PathLike) else remote
        self.strict_uploads = strict_uploads
        self.manager_options = dict(manager_options)
        self.final_health: Health | None = None
        self._mgr: CheckpointManager | None = None
        self._paths: dict[str, int] = {}  # path -> step, saved by this process
        self._last: tuple[int, dict] | None = None  # (step, copy of the callbacks state of its first save)
        self._loaded_step: int | None = None
        self.last_handle = None  # the SaveHandle of the newest save (tests, callers wanting handle.persisted)
        # records of resolved saves, for TieredCheckpointLogger (filled on the manager's background thread)
        self._records: collections.deque[SaveRecord] = collections.deque(maxlen=MAX_BUFFERED_RECORDS)
        self._unresolved: set[int] = set()  # steps saved whose record has not arrived
        self._early: set[int] = set()  # steps whose record arrived before save_checkpoint noted the save
        self._records_cond = threading.Condition()

    # ------------------------------------------------------------------------------------------------ manager
    @property
    def manager(self) -> CheckpointManager:
        """The manager, created on first use."""
        if self._mgr is None:
            opts = dict(self.manager_options)
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0:
                raise CheckpointError(
                    f"TieredCheckpointIO: rank {dist.get_rank()} asked for the checkpoint folder's manager, which "
                    "global rank 0 owns (Lightning saves from rank 0 only; the other ranks load read-only)",
                    path=self.local_dir)
            opts.setdefault("rank", 0)
            opts.setdefault("world_size", 1)
            self._mgr = CheckpointManager(self.local_dir, self.remote, **opts)
            self._mgr.add_on_record(self._keep_record)
        return self._mgr

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the strategy and its plug-ins
        state = dict(self.__dict__)
        state["_records_cond"] = None
        state["_records"] = list(self._records)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._records = collections.deque(state["_records"], maxlen=MAX_BUFFERED_RECORDS)
        self._records_cond = threading.Condition()

    # ------------------------------------------------------------------------------------------------ records
    def _keep_record(self, rec: SaveRecord) -> None:
        with self._records_cond:
            self._records.append(rec)
            if rec.step in self._unresolved:
                self._unresolved.discard(rec.step)
            else:
                self._early.add(rec.step)
            self._records_cond.notify_all()

    def take_records(self) -> list[SaveRecord]:
        """The records of the saves resolved since the last call (in the order they resolved), for loggers."""
        with self._records_cond:
            out = list(self._records)
            self._records.clear()
        return out

    def wait_records(self, timeout: float | None = None) -> bool:
        """Wait until every save of this plug-in has its record (each save resolved in every tier); True if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._records_cond:
            while self._unresolved:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._records_cond.wait(left)
        return True

    # ------------------------------------------------------------------------------------------------ save
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]`` and write the JSON marker at ``path``; returns
        once the snapshot is copied (:attr:`last_handle` follows the write and the upload). A second call at the
        same step writes only its marker. A save below a newer committed step after resuming from an older one
        calls ``rollback_to(<the loaded step>)`` first, with a warning.

        Raises:
            TypeError: ``storage_options`` given (set the manager's ``storage_options`` instead), or a value of
                the checkpoint that tierckpt cannot store (nothing is pickled).
            ValueError: ``global_step`` is not a non-negative int.
            CheckpointError: what :meth:`CheckpointManager.save` raises (a closed manager, a step not after the
                last one, a failed local save, a rollback not following a resume).
        """
        if storage_options is not None:
            raise TypeError("TieredCheckpointIO.save_checkpoint does not take storage_options (set the manager's "
                            "storage_options when creating the plug-in)")
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ValueError(f"the checkpoint's global_step must be a non-negative int, got {step!r}")
        path = _norm(path)
        overrides: dict[str, Any] = {}
        if self._last is not None and self._last[0] == step:
            overrides = self._overrides(self._last[1], checkpoint.get("callbacks"), path)
        else:
            mgr = self.manager
            metadata = {"lightning_path": path, "global_step": step, "epoch": _json_int(checkpoint.get("epoch"))}
            try:
                handle = mgr.save(step, checkpoint, metadata=metadata)
            except RollbackError:
                if self._loaded_step is None or step <= self._loaded_step:
                    raise
                log.warning("TieredCheckpointIO: training resumed from step %d and saves step %d; the newer steps of "
                            "the abandoned run are set aside (kept, never restored)", self._loaded_step, step)
                mgr.rollback_to(self._loaded_step)
                handle = mgr.save(step, checkpoint, metadata=metadata)
            except TypeError as exc:
                raise TypeError(f"TieredCheckpointIO: Lightning's checkpoint for {path} holds a value tierckpt "
                                f"cannot store (nothing is pickled): {exc}") from exc
            self.last_handle = handle
            with self._records_cond:
                if step in self._early:  # its record arrived before this line
                    self._early.discard(step)
                else:
                    self._unresolved.add(step)
            self._last = (step, copy_tree(checkpoint.get("callbacks")))
        self._paths[path] = step
        marker = {MARKER_KEY: step, "root": os.path.abspath(self.local_dir), "remote": self.remote}
        if overrides:
            marker["callbacks"] = overrides
        write_marker(path, marker)

    def _overrides(self, first: Any, now: Any, path: str) -> dict[str, Any]:
        """The entries of ``callbacks`` that differ from the first save of this step, encoded for the marker."""
        if not isinstance(now, Mapping) or not isinstance(first, Mapping):
            return {}
        out = {}
        for key, value in now.items():
            if key in first and equal(first[key], value):
                continue
            try:
                out[str(key)] = encode(value, MAX_OVERRIDE_TENSOR_BYTES)
            except (TypeError, ValueError) as exc:
                log.warning("TieredCheckpointIO: the state of callback %s differs in the second save at this step "
                            "(%s) and cannot be kept in its marker (%s); loading %s gives the step's first one", key,
                            path, exc, path)
        return out

    # ------------------------------------------------------------------------------------------------ load
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict saved for ``path``: the newest intact step for a ``last.ckpt`` / ``last-vN.ckpt``
        name; else the marker's step (without a marker: the step this process saved under ``path``, or ``step=N``
        in the file name), or the newest intact older step, with a warning, when no tier holds that one intact.
        Tensors are on the CPU unless ``map_location`` names a device; ``weights_only`` is ignored (nothing is
        unpickled). Ranks other than 0 of a multi-process job read what rank 0 saved without its folder lock.

        Raises:
            FileNotFoundError: ``path`` is no marker, holds no ``step=N`` and was not saved by this process.
            CheckpointError: no tier holds the step or an older one intact (a ``CheckpointNotFoundError`` for a
                ``last.ckpt`` name when nothing is committed).
            StorageError: a tier could not be listed and no other holds the step.
        """
        path = _norm(path)
        marker = read_marker(path)
        mgr = self._loader()
        stem = os.path.splitext(os.path.basename(path))[0]
        if _LAST_NAME.match(stem):
            result = mgr.load()  # the newest intact step, with the other tier / older step fallback
        else:
            if marker is not None:
                step = marker[MARKER_KEY]
            elif path in self._paths:
                step = self._paths[path]
            else:
                m = _STEP_IN_NAME.search(os.path.basename(path))
                if m is None:
                    raise FileNotFoundError(f"TieredCheckpointIO: {path} is neither a tierckpt marker file nor a name "
                                            "with step=N, and no save of this process used it")
                step = int(m.group(1))
            result = self._load_at_or_below(mgr, step, path)
        state = result.state
        if marker is not None and marker.get(MARKER_KEY) == result.step and marker.get("callbacks"):
            callbacks = state.setdefault("callbacks", {})
            for key, value in marker["callbacks"].items():
                callbacks[key] = decode(value)
        if isinstance(map_location, (str, torch.device)):
            state = _to(state, torch.device(map_location))
        self._loaded_step = result.step
        return state

    def _loader(self) -> CheckpointManager | _ReadOnly:
        """Rank 0 (or a single process) loads through its manager; the other ranks of a multi-process job read
        what rank 0 saved without its folder lock (:mod:`tierckpt.readonly`): the same local folder on rank 0's
        node, the remote tier elsewhere."""
        dist = torch.distributed
        if (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0
                and "rank" not in self.manager_options):
            return _ReadOnly(self.local_dir, self.remote, self.manager_options)
        return self.manager

    @staticmethod
    def _load_at_or_below(mgr: CheckpointManager | _ReadOnly, step: int, path: str):
        try:
            return mgr.load(step)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            first = exc
        older = sorted((s.step for s in mgr.steps() if s.step < step), reverse=True)
        for s in older:
            try:
                result = mgr.load(s)
            except (CorruptCheckpointError, CheckpointNotFoundError):
                continue
            log.warning("TieredCheckpointIO: %s points to step %d, which no tier holds intact (%s); loaded step %d "
                        "instead", path, step, first, s)
            return result
        raise CheckpointError(f"{path} points to step {step}, which no tier holds intact ({first}), and no older "
                              "step loads", step=step, path=path) from first

    # ------------------------------------------------------------------------------------------------ remove, teardown
    def remove_checkpoint(self, path: Any) -> None:
        """Remove the marker file only; the step's data is left to tierckpt's retention."""
        path = _norm(path)
        self._paths.pop(path, None)
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def teardown(self) -> None:
        """Close the manager (a later use opens it again): every save is committed locally, the uploads are waited
        for while the remote answers (once it fails, after at most about one upload attempt, the steps it lacks are
        logged as an error and kept locally), the folder is released, and :attr:`final_health` is set.

        Raises:
            UploadError: with ``strict_uploads=True``, an upload failed (the steps stay committed locally).
            RunConflictError: the remote holds another run's checkpoints (whatever ``strict_uploads``).
            CheckpointError: a local save failed.
        """
        mgr, self._mgr = self._mgr, None
        self._last = None
        if mgr is not None:
            try:
                mgr.close(raise_upload_errors=self.strict_uploads)
            finally:
                self.final_health = health_after_close(mgr.health, "TieredCheckpointIO")
                with self._records_cond:
                    self._unresolved.clear()
                    self._early.clear()
                    self._records_cond.notify_all()


def _tiered_io(trainer: Any) -> TieredCheckpointIO | None:
    """The trainer's TieredCheckpointIO, looking through wrappers such as ``AsyncCheckpointIO``."""
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    for _ in range(8):
        if io is None or isinstance(io, TieredCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


class TieredCheckpointLogger(Callback):
    """Logs the checkpoint stall next to the loss: each save's ``checkpoint/stall_s``, ``checkpoint/persist_s``,
    ``checkpoint/upload_s`` (absent when not uploaded: no remote tier, failed, skipped) and
    ``checkpoint/upload_lag_steps`` (``health()`` when the record is logged), through ``trainer.loggers``, at
    the step of the save (its ``global_step``). Needs the Trainer's plug-in to be a :class:`TieredCheckpointIO`.

    Records arrive once a save is resolved in every tier, on a background thread; they are logged from the training
    thread at the next ``on_train_batch_end``, so a save's values show up a few steps after it, at its own step.
    At ``on_train_end`` the callback waits (``wait_on_train_end``, at most ``timeout_s``) for the pending saves'
    records so the last ones are logged too; the plug-in's teardown would wait for those saves anyway.

    Args:
        prefix: the metric name prefix.
        wait_on_train_end: wait for the records of pending saves at the end of training.
        timeout_s: the longest that wait (None: as long as the saves take).
    """

    def __init__(self, prefix: str = "checkpoint/", *, wait_on_train_end: bool = True,
                 timeout_s: float | None = None) -> None:
        self.prefix = prefix
        self.wait_on_train_end = wait_on_train_end
        self.timeout_s = timeout_s
        self._warned = False

    def _io(self, trainer: Any) -> TieredCheckpointIO | None:
        io = _tiered_io(trainer)
        if io is None and not self._warned:
            self._warned = True
            log.warning("TieredCheckpointLogger: the Trainer's checkpoint_io is not a TieredCheckpointIO; nothing "
                        "is logged")
        return io

    def metrics(self, rec: SaveRecord, lag_steps: int | None) -> dict[str, float]:
        """What is logged for one record (the values that are known)."""
        values = {"stall_s": rec.stall_s, "persist_s": rec.persist_s, "upload_s": rec.upload_s,
                  "upload_lag_steps": lag_steps}
        return {self.prefix + k: float(v) for k, v in values.items() if v is not None}

    def log_records(self, trainer: Any) -> int:
        """Log the records resolved since the last call; returns how many."""
        io = self._io(trainer)
        if io is None:
            return 0
        records = io.take_records()
        if not records or not trainer.loggers:
            return len(records)
        lag: int | None = None
        if io._mgr is not None:
            try:
                lag = io._mgr.health().upload_lag_steps
            except Exception as exc:  # never let metrics stop training
                log.debug("TieredCheckpointLogger: health() failed: %s", exc)
        for rec in records:
            values = self.metrics(rec, lag)
            for logger in trainer.loggers:
                logger.log_metrics(values, step=rec.step)
        for logger in trainer.loggers:
            logger.save()
        return len(records)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the records resolved since the last batch (see :meth:`log_records`)."""
        self.log_records(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Log the records left, first waiting for the pending saves' records when ``wait_on_train_end``."""
        io = self._io(trainer)
        if io is None:
            return
        if self.wait_on_train_end and not io.wait_records(self.timeout_s):
            log.warning("TieredCheckpointLogger: saves still unresolved after %s s at the end of training; their "
                        "records are not logged", self.timeout_s)
        self.log_records(trainer)


# ---------------------------------------------------------------------------------------------------- helpers

def _norm(path: Any) -> str:
    path = os.fspath(path)
    return path if "://" in path else os.path.normpath(path)


def _json_int(value: Any) -> int | None:
    return value if type(value) is int else None


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _to(v, device)
        return obj
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to(v, device) for v in obj)
    return obj
