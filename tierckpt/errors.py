"""The error hierarchy.

Every error tierckpt raises on purpose derives from :class:`CheckpointError`. Subclasses also inherit the matching
builtin so that generic handlers keep working (``except FileNotFoundError`` catches a missing checkpoint).
Each error carries the ``step``, ``tier`` and ``path`` it concerns, where known, and puts them in its message.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "CheckpointLockedError",
    "StorageError",
    "StorageAccessError",
    "StorageTimeoutError",
    "StorageUnavailableError",
    "UploadError",
    "StepConflictError",
    "RunConflictError",
    "RollbackError",
]


class CheckpointError(Exception):
    """Root of every error tierckpt raises on purpose.

    Attributes:
        step: the step concerned, or None.
        tier: the tier concerned (``"local"``, ``"remote"``, ``"cli"``), or None.
        path: the file, folder or URL concerned (credentials removed), or None.
        detail: the message without the ``[step ..., tier ..., path ...]`` suffix that ``str()`` adds.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        tier: str | None = None,
        path: str | None = None,
    ) -> None:
        self.step = step
        self.tier = tier
        self.path = path
        self.detail = message
        context = []
        if step is not None:
            context.append(f"step {step}")
        if tier is not None:
            context.append(f"tier {tier}")
        if path is not None:
            context.append(f"path {path}")
        full = f"{message} [{', '.join(context)}]" if context else message
        super().__init__(full)

    def __reduce__(self):  # keep the keyword-only context when pickled across processes
        return (_rebuild, (type(self), self.detail, self.step, self.tier, self.path))


def _rebuild(cls, message, step, tier, path):  # pragma: no cover - used by pickle only
    return cls(message, step=step, tier=tier, path=path)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No tier holds the requested checkpoint (or none exists at all)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A checkpoint exists but fails verification: bad checksum, truncated, missing file or malformed manifest.

    ``bad_files`` lists the files found damaged or missing (names or paths, as the check found them)."""

    def __init__(self, message: str, *, bad_files: list[str] | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.bad_files = list(bad_files or [])


class StateMismatchError(CheckpointError, KeyError):
    """The checkpoint does not fit the state it is loaded into: a missing/unexpected key, shape or dtype."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class CheckpointLockedError(CheckpointError, BlockingIOError):
    """Another manager already owns this local folder (and rank)."""


class StorageError(CheckpointError, OSError):
    """A storage operation failed (after retries, where they apply).

    ``transient`` says whether trying again later may succeed (an unreachable or throttling endpoint, a timeout) or
    not (access denied, a missing bucket, an invalid request); None where it is not known. Every failure of a
    storage backend that tierckpt passes on (botocore, aiohttp, gcsfs, OS errors) is one of these, with the
    backend's exception chained as ``__cause__``; a missing file stays a :class:`FileNotFoundError`."""

    def __init__(self, message: str, *, transient: bool | None = None, **kw) -> None:
        super().__init__(message, **kw)
        self.transient = transient

    def __reduce__(self):
        return (_rebuild_storage, (type(self), self.detail, self.step, self.tier, self.path, self.transient))


def _rebuild_storage(cls, message, step, tier, path, transient):  # pragma: no cover - used by pickle only
    return cls(message, step=step, tier=tier, path=path, transient=transient)


class StorageAccessError(StorageError, PermissionError):
    """The storage refused the operation (HTTP 403, missing credentials, a missing bucket): no retry helps."""


class StorageUnavailableError(StorageError, ConnectionError):
    """The storage could not be reached (connection refused or reset, DNS, a failing endpoint): may pass."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage operation did not finish within its deadline (a silent or very slow endpoint)."""


class UploadError(StorageError):
    """A step could not be replicated to the remote tier."""


class StepConflictError(UploadError, FileExistsError):
    """The remote holds a committed copy of the step from another save: it is never replaced (the local copy is
    kept; ``tierckpt verify``/``inspect`` show both)."""


class RunConflictError(UploadError, FileExistsError):
    """The remote tier belongs to another run (its ``run.json``, or steps of which this job holds no save): nothing
    is uploaded. The message names both runs and how to continue the other one on purpose (restore from it, or
    ``continue_remote_run=True``)."""


class RollbackError(CheckpointError, ValueError):
    """``save()`` was asked for a step below a newer committed step (a rollback, or an old run's checkpoints in the
    folder): a restart would restore the newer step, not this run's. The message says how to proceed."""
