"""What a manager's background threads leave for its caller: the records of its saves (kept in memory, handed to
``on_record`` hooks, appended to ``saves.jsonl``) and the errors its next call re-raises."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..format import layout
from ..handle import SaveHandle, SaveRecord
from ..storage.files import append_line

log = logging.getLogger(__name__)

Hook = Callable[[SaveRecord], None]


def record_hooks(on_record: Any) -> tuple[Hook, ...]:
    """``on_record`` as a tuple of callables. Raises ``ValueError`` for anything else."""
    if on_record is None:
        return ()
    hooks = (on_record,) if callable(on_record) else on_record
    if not isinstance(hooks, (list, tuple)) or not all(callable(h) for h in hooks):
        raise ValueError(f"on_record must be a callable or a list of callables, got {on_record!r}")
    return tuple(hooks)


class SaveLog:
    """Each resolved save's :class:`SaveRecord`, in order: kept, handed to every hook (a hook that raises is
    logged, never allowed to cost a checkpoint) and, with ``log_to`` (the local folder), appended as one JSON line
    to its ``saves.jsonl`` (never through a symbolic link or into anything but a regular file planted at that name:
    such a line is dropped with a warning naming the path). Written from the persist and upload threads; read from
    any."""

    def __init__(self, hooks: tuple[Hook, ...], *, log_to: str | None) -> None:
        self._hooks = hooks
        self._path = None if log_to is None else os.path.join(log_to, layout.RECORDS_FILE)
        self._records: list[SaveRecord] = []

    def add_hook(self, hook: Hook) -> None:
        """Add ``hook`` unless it is there already. Raises ``ValueError`` if it is not callable."""
        (hook,) = record_hooks(hook)
        if not any(h is hook for h in self._hooks):
            self._hooks = (*self._hooks, hook)  # one tuple swap: the thread that calls them sees either

    def records(self) -> list[SaveRecord]:
        """The records so far, oldest first (a copy)."""
        return list(self._records)

    def write(self, handle: SaveHandle) -> None:
        """Record ``handle``'s save, now that it resolved."""
        rec = handle.record()
        self._records.append(rec)
        for hook in self._hooks:
            try:
                hook(rec)
            except Exception as exc:  # a metrics exporter's bug never costs a checkpoint
                log.warning("step %d: on_record hook %r raised %s: %s", rec.step, hook, type(exc).__name__, exc)
        if self._path is None:
            return
        try:
            append_line(self._path, rec.to_json() + "\n", tier="local")
        except OSError as exc:  # a StorageAccessError too: a link or special file planted there is never followed
            log.warning("tier local: cannot append to %s: %s", layout.RECORDS_FILE, exc)


class BackgroundErrors:
    """Errors of the snapshot and persist threads, kept until the caller's next call re-raises the first (the
    others are logged), as orbax does: a background failure is never lost and never raised twice."""

    def __init__(self) -> None:
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def add(self, exc: BaseException, what: str) -> None:
        """Keep ``exc`` (and log it with ``what`` failed)."""
        log.error("%s: %s", what, exc)
        with self._lock:
            self._errors.append(exc)

    def raise_first(self, more: list[BaseException] | None = None) -> None:
        """Re-raise the first error kept (``more``: errors another component kept, after these); no-op if none."""
        with self._lock:
            self._errors.extend(more or ())
            if not self._errors:
                return
            first, rest = self._errors[0], self._errors[1:]
            self._errors.clear()
        if rest:  # each was logged where it happened, or (upload errors during an outage) summed up there
            log.warning("%d more background checkpoint errors are not raised: %s", len(rest),
                        "; ".join(f"step {getattr(e, 'step', None)}: {type(e).__name__}" for e in rest[:8]))
        raise first
