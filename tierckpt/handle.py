"""What :meth:`CheckpointManager.save` returns: one handle with a future per stage, and the save's record."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field


@dataclass
class SaveRecord:
    """Timings and sizes of one save; fields stay None until their stage completes.

    Attributes:
        step: the step saved.
        bytes / tensors / files: tensor bytes, tensors and data files of this rank's part of the step.
        stall_s: seconds ``save()`` blocked its caller.
        persist_s: seconds from ``save()`` until durable in the local tier (None: not yet, or the local save
            failed).
        upload_s: seconds from ``save()`` until committed in the remote tier (None: not yet, no remote tier, or the
            upload failed or was skipped).
        started: ``time.time()`` when ``save()`` was called.
        error: the error of a failed local save or upload, as text.
        upload_skipped: why the step was never uploaded.
    """

    step: int
    bytes: int = 0
    tensors: int = 0
    files: int = 0
    stall_s: float | None = None
    persist_s: float | None = None  # from save() to locally durable
    upload_s: float | None = None  # from save() to committed in the remote tier
    started: float = field(default_factory=time.time)
    error: str | None = None
    #: why the step was never uploaded (superseded by a newer step, deleted locally first, set aside): its
    #: ``uploaded`` future then resolves to None
    upload_skipped: str | None = None

    @property
    def persist_gbps(self) -> float | None:
        """Bytes over ``persist_s``, in GB/s (10^9 bytes a second); None while ``persist_s`` is unknown."""
        return self.bytes / self.persist_s / 1e9 if self.persist_s else None

    def to_json(self) -> str:
        """The record as one line of JSON, ``persist_gbps`` included (a line of ``saves.jsonl``)."""
        d = asdict(self)
        d["persist_gbps"] = self.persist_gbps
        return json.dumps(d, allow_nan=False)


class SaveHandle:
    """Futures for one save's stages. Each resolves to the seconds elapsed since ``save()`` was called:

    - ``staged``: the snapshot is in host buffers (already done when ``save()`` returns);
    - ``persisted``: committed and durable in the local tier;
    - ``uploaded``: committed in the remote tier (``None`` once locally durable when no remote tier is configured,
      or when the step will never be uploaded: superseded by a newer step first; ``record().upload_skipped`` says
      why).

    A failed stage's future holds the exception (the same error is re-raised by the manager's next call).
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.staged: Future[float | None] = Future()
        self.persisted: Future[float | None] = Future()
        self.uploaded: Future[float | None] = Future()
        self._record = SaveRecord(step)
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since ``save()`` was called."""
        return time.perf_counter() - self._t0

    def record(self) -> SaveRecord:
        """A copy of the save's record as it stands now."""
        return SaveRecord(**asdict(self._record))

    def done(self) -> bool:
        """Whether the save is resolved in every tier: ``persisted`` and ``uploaded`` are both done (with a result
        or an exception)."""
        return self.persisted.done() and self.uploaded.done()

    def __repr__(self) -> str:
        def st(f: Future) -> str:
            return "pending" if not f.done() else ("failed" if f.exception() else "done")

        return f"SaveHandle(step={self.step}, persisted={st(self.persisted)}, uploaded={st(self.uploaded)})"
