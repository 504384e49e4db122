"""Hugging Face ``transformers.Trainer`` integration: asynchronous tiered checkpoints and resume through tierckpt.

Use (docs/huggingface.md):

```python
cb = TieredCheckpointCallback("/local_nvme/ckpt", remote="s3://bucket/run", save_steps=500)
trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])   # args.save_strategy="no"
tierckpt.hf.train(trainer)       # resumes from the newest intact tierckpt step in any tier, else starts fresh
```

Saving: every ``save_steps`` optimizer steps (and at the last step) the callback hands the model, optimizer, LR
scheduler, the ``TrainerState`` (as JSON) and the Python/numpy/torch RNG states to
:meth:`CheckpointManager.save`, which returns once they are copied to host buffers; the writes and the upload go on
in the background. The save is taken where HF would take its own checkpoint of that step: after the step's log and
evaluation, so ``log_history`` and the RNG state are those of HF's ``checkpoint-N`` folder.

Resuming: HF skips the batches already trained on (``steps_trained_in_current_epoch``) only when
``train(resume_from_checkpoint=folder)`` gets a checkpoint folder, and it reads that folder at several points
(weights before ``accelerator.prepare``, optimizer and scheduler after, RNG after the skipped batches).
:meth:`TieredCheckpointCallback.prepare_resume` loads the newest intact step (verified, falling back to the other
tier or an older step), writes only its ``trainer_state.json`` into a temporary folder, and makes that trainer's
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler`` and ``_load_rng_state`` take their
values from the loaded step when called with that folder (any other folder goes to HF's own methods). Nothing is
unpickled: HF's ``torch.load`` of ``optimizer.pt``/``rng_state.pth`` is never reached.

Logging: each save's :class:`~tierckpt.handle.SaveRecord` arrives on a background thread once the save is resolved
in every tier; the callback keeps it and adds ``checkpoint/stall_s``, ``checkpoint/persist_s``, ``checkpoint/upload_s``,
``checkpoint/upload_lag_steps`` and ``checkpoint/step`` (the save they belong to) to the next logs HF writes (see
:meth:`TieredCheckpointCallback.checkpoint_logs`), so they land in ``log_history`` next to the loss.

End of training: ``on_train_end`` closes the manager. Every save is committed locally, then the uploads are waited
for while the remote answers; during an outage that takes about one failed upload attempt (bounded by
``remote_timeout_s`` / ``upload_deadline_s``), the steps the remote lacks are logged as an error, kept locally (the
next start uploads them, or ``tierckpt sync``) and listed in ``final_health``, and ``train()`` returns normally,
unless ``strict_uploads=True``, which raises the :class:`~tierckpt.errors.UploadError`.

Not covered: DeepSpeed and FSDP trainers (their checkpoints are sharded by their own engines; ``prepare_resume``
refuses them), SageMaker model parallel and XLA/TPU RNG states.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import warnings
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from .errors import CheckpointNotFoundError
from .handle import SaveRecord
from .manager import CheckpointManager
from .replication import Health
from .replication.health import health_after_close

log = logging.getLogger(__name__)

__all__ = ["TieredCheckpointCallback", "train", "accelerate_state"]

_TRAINER_STATE_NAME = "trainer_state.json"
#: records kept until the next log (the oldest are dropped beyond this)
MAX_BUFFERED_RECORDS = 1000


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # a different number of visible devices: this process's device only, as HF does
            torch.cuda.set_rng_state(cuda[min(torch.cuda.current_device(), len(cuda) - 1)])


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


class TieredCheckpointCallback(TrainerCallback):
    """Saves a ``Trainer``'s state through a :class:`~tierckpt.CheckpointManager` every ``save_steps`` steps.

    Args:
        local_dir / remote: the manager's tiers.
        save_steps: save every this many optimizer steps (None: ``args.save_steps``, as HF resolves it; a ratio
            below 1 is a fraction of ``max_steps``). The last step of a run is saved too.
        strict_uploads: whether an upload error at the end of training (:meth:`close`, called from
            ``on_train_end``) is raised from ``trainer.train()``. False (the default): training finishes; the steps
            the remote lacks are logged as an error, kept locally (the next start uploads them, or
            ``tierckpt sync``) and listed in :attr:`final_health`. True: ``train()`` raises the first
            :class:`~tierckpt.errors.UploadError` (every step is committed locally all the same). A
            :class:`~tierckpt.errors.RunConflictError` is always raised.
        **manager_options: any other :class:`~tierckpt.CheckpointManager` keyword (``keep_local``,
            ``keep_remote``, ``storage_options``, ...).

    Attributes:
        last_handle: the :class:`~tierckpt.SaveHandle` of the newest save (``persisted``/``uploaded`` futures).
        resumed_step / resumed_tier: what :meth:`prepare_resume` loaded (None before, or on a fresh start).
        final_health: the manager's :meth:`~tierckpt.CheckpointManager.health` when :meth:`close` closed it (None
            before): ``waiting`` holds the committed steps the remote lacked, ``last_error`` the remote's last
            error, ``ok`` False when it was failing then.

    Logs: each resolved save's seconds and the upload lag are added to the next logs HF writes
    (:meth:`checkpoint_logs`). With :func:`train` (or :meth:`prepare_resume`) the callback knows the trainer and
    adds them before HF records the logs, so they reach ``log_history`` and every ``report_to`` integration; with a
    plain ``trainer.train()`` they are added in ``on_log``: to that ``log_history`` entry and to the ``logs`` the
    callbacks after this one see (the ``report_to`` integrations, registered before it, do not see them).

    Switch HF's own synchronous checkpoints off (``TrainingArguments(save_strategy="no")``); the callback warns
    once when they are on. At the end of training the manager is closed (:meth:`close`): every save is committed
    locally and the uploads are waited for while the remote answers; during an outage the end of training takes
    about one failed upload attempt, not more (see ``strict_uploads``). Resume with :func:`train` (or
    :meth:`prepare_resume`).
    """

    def __init__(self, local_dir: str | os.PathLike[str], remote: str | os.PathLike[str] | None = None, *,
                 save_steps: int | float | None = None, strict_uploads: bool = False,
                 **manager_options: Any) -> None:
        if save_steps is not None and not save_steps > 0:
            raise ValueError(f"save_steps must be positive, got {save_steps!r}")
        if not isinstance(strict_uploads, bool):
            raise TypeError(f"strict_uploads must be a bool, got {strict_uploads!r}")
        self.local_dir = local_dir
        self.remote = remote
        self.save_steps = save_steps
        self.strict_uploads = strict_uploads
        self.manager_options = manager_options
        self.last_handle = None
        self.final_health: Health | None = None
        self.resumed_step: int | None = None
        self.resumed_tier: str | None = None
        self._manager: CheckpointManager | None = None
        self._trainer: Any = None
        self._pending: int | None = None
        self._last_saved: int | None = None
        self._warned_hf_save = False
        self._resume_dir: str | None = None
        self._loaded: dict[str, Any] | None = None
        self._records: collections.deque[SaveRecord] = collections.deque(maxlen=MAX_BUFFERED_RECORDS)
        self._records_lock = threading.Lock()
        self._in_trainer_log = False  # inside the trainer.log wrapper of _install_log

    # -- the manager --------------------------------------------------------------------------------------------

    @property
    def manager(self) -> CheckpointManager:
        """The manager (created on first use, again after :meth:`close`)."""
        if self._manager is None:
            opts = dict(self.manager_options)
            self._manager = CheckpointManager(self.local_dir, self.remote, **opts)
            self._manager.add_on_record(self._keep_record)
        return self._manager

    # -- logs ---------------------------------------------------------------------------------------------------

    def _keep_record(self, rec: SaveRecord) -> None:  # the manager's background thread
        with self._records_lock:
            self._records.append(rec)

    def checkpoint_logs(self) -> dict[str, float]:
        """The values to add to the next logs, from the saves resolved since the last call (empty if none): the
        newest resolved save's ``checkpoint/stall_s``, ``checkpoint/persist_s``, ``checkpoint/upload_s`` (each
        when known: no upload seconds without a remote tier or for a failed upload), its step as
        ``checkpoint/step``, and ``checkpoint/upload_lag_steps`` from ``health()`` now."""
        with self._records_lock:
            if not self._records:
                return {}
            rec = self._records[-1]
            self._records.clear()
        values: dict[str, Any] = {"stall_s": rec.stall_s, "persist_s": rec.persist_s, "upload_s": rec.upload_s,
                                  "step": rec.step}
        if self._manager is not None:
            try:
                values["upload_lag_steps"] = self._manager.health().upload_lag_steps
            except Exception as exc:  # never let metrics stop training
                log.debug("tierckpt.hf: health() failed: %s", exc)
        return {f"checkpoint/{k}": (v if k == "step" else float(v)) for k, v in values.items() if v is not None}

    def _install_log(self, trainer: Any) -> None:
        """Add the checkpoint values to the logs before HF records them (an instance attribute; idempotent)."""
        if trainer.__dict__.get("_tierckpt_log") is self:
            return
        original = trainer.log
        cb = self

        def log_with_checkpoints(logs, *args, **kwargs):
            if isinstance(logs, dict):
                logs.update(cb.checkpoint_logs())
            cb._in_trainer_log = True  # on_log, called inside, has nothing left to add
            try:
                return original(logs, *args, **kwargs)
            finally:
                cb._in_trainer_log = False

        trainer.log = log_with_checkpoints
        trainer.__dict__["_tierckpt_log"] = self

    def close(self) -> None:
        """Close the manager (a later use opens it again) and remove the resume folder: every save is committed
        locally, the uploads are waited for while the remote answers (once it fails, after at most about one upload
        attempt, the steps it lacks are logged as an error and kept locally), the folder is released, and
        :attr:`final_health` is set.

        Raises:
            UploadError: with ``strict_uploads=True``, an upload failed (the steps stay committed locally).
            RunConflictError: the remote holds another run's checkpoints (whatever ``strict_uploads``).
            CheckpointError: a local save failed.
        """
        mgr, self._manager = self._manager, None
        try:
            if mgr is not None:
                try:
                    mgr.close(raise_upload_errors=self.strict_uploads)
                finally:
                    self.final_health = health_after_close(mgr.health, "tierckpt.hf")
        finally:
            if self._resume_dir is not None:
                shutil.rmtree(self._resume_dir, ignore_errors=True)
                self._resume_dir = None

    # -- resume -------------------------------------------------------------------------------------------------

    def prepare_resume(self, trainer: Any) -> str | None:
        """Load the newest intact step in any tier for ``trainer``; return the folder to pass as
        ``trainer.train(resume_from_checkpoint=...)``, or None when no tier holds a checkpoint (a fresh start).

        The folder holds only ``trainer_state.json``; the weights, optimizer, scheduler, grad scaler and RNG states
        come from the loaded step when HF asks for them. A step older than the newest committed one (the newer ones
        failed verification in every tier) is made the newest with ``rollback_to`` so that saving can go on.

        Raises:
            NotImplementedError: a DeepSpeed or FSDP trainer.
            ValueError: the loaded step was not saved by a ``TieredCheckpointCallback``.
            CorruptCheckpointError: committed steps exist but none verifies in any tier.
            StorageError: a tier could not be listed and no other holds a step.
        """
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            raise NotImplementedError("TieredCheckpointCallback resume does not support DeepSpeed or FSDP trainers")
        self._trainer = trainer
        self._install_log(trainer)
        mgr = self.manager
        try:
            result = mgr.load()
        except CheckpointNotFoundError:
            return None
        for key in ("model", "optimizer", "scheduler", "trainer_state", "rng"):
            if key not in result.state:
                raise ValueError(f"step {result.step} was not saved by TieredCheckpointCallback (no {key!r})")
        newest = mgr.latest_step()
        if newest is not None and newest > result.step:
            log.warning("tierckpt.hf: resuming from step %d; newer steps up to %d could not be loaded and are set "
                        "aside", result.step, newest)
            mgr.rollback_to(result.step)
        self.resumed_step, self.resumed_tier = result.step, result.tier
        self._last_saved = result.step
        self._loaded = dict(result.state)
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
        self._resume_dir = tempfile.mkdtemp(prefix=f"tierckpt-hf-step-{result.step}-")
        with open(os.path.join(self._resume_dir, _TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(self._loaded.pop("trainer_state"))
        self._install(trainer)
        log.info("tierckpt.hf: resuming from step %d (%s tier)", result.step, result.tier)
        return self._resume_dir

    def _install(self, trainer: Any) -> None:
        """Route HF's loads from our resume folder to the loaded step (instance attributes; idempotent)."""
        cb = self
        originals = trainer.__dict__.setdefault("_tierckpt_originals", {})
        for name in ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state"):
            if name not in originals:
                originals[name] = getattr(trainer, name)

        def ours(path: Any) -> bool:
            return cb._resume_dir is not None and path is not None and os.fspath(path) == cb._resume_dir

        def load_model(path, model=None):
            if not ours(path):
                return originals["_load_from_checkpoint"](path, model)
            target = trainer.model if model is None else model
            target.load_state_dict(cb._take("model"))
            return None

        def load_optimizer_and_scheduler(path):
            if not ours(path):
                return originals["_load_optimizer_and_scheduler"](path)
            trainer.optimizer.load_state_dict(cb._take("optimizer"))
            scheduler = cb._take("scheduler")
            if scheduler is not None and trainer.lr_scheduler is not None:
                trainer.lr_scheduler.load_state_dict(scheduler)
            return None

        def load_scaler(path):
            if not ours(path):
                return originals["_load_scaler"](path)
            scaler = cb._take("scaler", None)
            target = getattr(getattr(trainer, "accelerator", None), "scaler", None)
            if scaler is not None and target is not None:
                target.load_state_dict(scaler)
            return None

        def load_rng_state(path):
            if not ours(path):
                return originals["_load_rng_state"](path)
            rng = (cb._loaded or {}).get("rng")  # HF may call it more than once (each resumed epoch start)
            if rng is not None:
                _set_rng_state(rng)
            return None

        trainer._load_from_checkpoint = load_model
        trainer._load_optimizer_and_scheduler = load_optimizer_and_scheduler
        trainer._load_scaler = load_scaler
        trainer._load_rng_state = load_rng_state

    def _take(self, key: str, *default: Any) -> Any:
        if self._loaded is None or key not in self._loaded:
            if default:
                return default[0]
            raise RuntimeError(f"tierckpt.hf: {key!r} is not in the loaded step (prepare_resume not called?)")
        return self._loaded[key]

    # -- saving -------------------------------------------------------------------------------------------------

    def _every(self, state: Any) -> int:
        n = self.save_steps if self.save_steps is not None else getattr(state, "save_steps", None)
        if n is None or n <= 0:
            raise ValueError("TieredCheckpointCallback needs save_steps (or args.save_steps)")
        if n < 1:  # a ratio of the run, as HF's TrainerState.compute_steps resolves it
            n = int(np.ceil(state.max_steps * n))
        return max(int(n), 1)

    def _save(self, args: Any, state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
        step = state.global_step
        self._pending = None
        if self._last_saved is not None and step <= self._last_saved:
            return
        trainer = self._trainer
        try:
            from transformers.trainer_callback import ExportableState
        except ImportError:  # older transformers: no stateful callbacks
            ExportableState = None  # noqa: N806
        if trainer is not None and ExportableState is not None:  # as HF's _save_checkpoint does
            for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                       if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks.get(name), list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
        ckpt: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": lr_scheduler,
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
            "rng": _rng_state(),
        }
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None) if trainer is not None else None
        if scaler is not None:
            ckpt["scaler"] = scaler
        self.last_handle = self.manager.save(step, ckpt, metadata={"global_step": step, "epoch": state.epoch})
        self._last_saved = step

    def _flush(self, args: Any, state: Any, kwargs: dict[str, Any]) -> None:
        if self._pending is not None and self._pending == state.global_step:
            self._save(args, state, kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler"))
        self._pending = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not self._warned_hf_save and _strategy(args.save_strategy) != "no":
            self._warned_hf_save = True
            warnings.warn(f"TieredCheckpointCallback: the Trainer also saves its own checkpoints synchronously "
                          f"(save_strategy={_strategy(args.save_strategy)!r}); set save_strategy='no'",
                          UserWarning, stacklevel=2)
        self._pending = None
        if self._loaded is not None:  # weights, optimizer and scheduler are in the live state by now: free the
            self._loaded = {"rng": self._loaded.get("rng")}  # host copy, keep the RNG states HF asks for later

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self._every(state) == 0 or step >= state.max_steps:
            self._pending = step
            # HF checkpoints after the step's log and evaluation: save there when they will run
            if not control.should_log and not control.should_evaluate:
                self._flush(args, state, kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._in_trainer_log and isinstance(logs, dict):  # a trainer without the log wrapper
            extra = self.checkpoint_logs()
            if extra:
                entry = state.log_history[-1] if state.log_history else None
                # HF appended {**logs, "step": global_step} just before calling on_log: that entry is this log
                if isinstance(entry, dict) and entry.get("step") == state.global_step and set(logs) <= set(entry):
                    entry.update(extra)
                logs.update(extra)
        if not control.should_evaluate:
            self._flush(args, state, kwargs)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._flush(args, state, kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._flush(args, state, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._flush(args, state, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._flush(args, state, kwargs)
        self._loaded = None
        self.close()



def _find_callback(trainer: Any) -> TieredCheckpointCallback:
    found = [c for c in trainer.callback_handler.callbacks if isinstance(c, TieredCheckpointCallback)]
    if len(found) != 1:
        raise ValueError(f"the trainer has {len(found)} TieredCheckpointCallback; exactly one is needed")
    return found[0]


def train(trainer: Any, **train_kwargs: Any) -> Any:
    """``trainer.train()`` resumed from the newest intact tierckpt step in any tier (or from scratch when there
    is none); returns what ``Trainer.train`` returns. ``train_kwargs`` go to ``Trainer.train`` (not
    ``resume_from_checkpoint``).

    Raises:
        TypeError: ``resume_from_checkpoint`` in ``train_kwargs``.
        ValueError: the trainer does not have exactly one :class:`TieredCheckpointCallback`.
        NotImplementedError, CorruptCheckpointError, StorageError: as
            :meth:`TieredCheckpointCallback.prepare_resume`.
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError("tierckpt.hf.train chooses resume_from_checkpoint itself")
    callback = _find_callback(trainer)
    resume = callback.prepare_resume(trainer)
    return trainer.train(resume_from_checkpoint=resume, **train_kwargs)


def accelerate_state(accelerator: Any) -> dict[str, Any]:
    """What ``accelerator.save_state()`` checkpoints, as a state for :meth:`CheckpointManager.save` and
    :meth:`~CheckpointManager.restore`: the models, optimizers and schedulers given to ``accelerator.prepare``
    (in that order), the objects given to ``register_for_checkpointing``, the grad scaler, and torch's default
    generators (CPU, and CUDA when initialised). Python's and numpy's RNG cannot be restored in place: add
    ``random.getstate()``/``np.random.get_state()`` values and ``load()`` them if the run draws from them.

    Build it once after ``prepare`` and pass the same dict to ``save`` and ``restore`` (restore loads in place).
    """
    state: dict[str, Any] = {}
    for kind, objects in (("model", accelerator._models), ("optimizer", accelerator._optimizers),
                          ("scheduler", accelerator._schedulers), ("custom", accelerator._custom_objects)):
        for i, obj in enumerate(objects):
            state[f"{kind}_{i}"] = accelerator.unwrap_model(obj) if kind == "model" else obj
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    state["torch_rng"] = torch.default_generator
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = list(torch.cuda.default_generators)
    return state
