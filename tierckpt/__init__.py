"""tierckpt: asynchronous tiered checkpointing for PyTorch training.

``save()`` copies the state into reusable host buffers and returns; background threads persist it to the node-local
tier (checksummed, committed atomically) and replicate it to a remote tier (a parallel file system or object
storage); ``restore()`` loads the newest intact checkpoint from whichever tier holds one.
"""

from __future__ import annotations

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RollbackError,
    RunConflictError,
    StateMismatchError,
    StepConflictError,
    StorageAccessError,
    StorageError,
    StorageTimeoutError,
    StorageUnavailableError,
    UploadError,
)
from .handle import SaveHandle, SaveRecord
from .options import DistributedOptions, LocalTierOptions, RemoteTierOptions
from .replication import Health, ReplicationPolicy
from .retention import KeepPolicy
from .status import StepInfo

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from .engine.load import LoadResult
    from .manager import CheckpointManager


def __getattr__(name: str):
    # The manager imports torch; loading it lazily keeps the operators' CLI (ls/verify) fast and torch-free.
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    if name == "LoadResult":  # what CheckpointManager.load returns (its module imports torch too)
        from .engine.load import LoadResult

        return LoadResult
    raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")

__all__ = [
    "CheckpointManager",
    "LoadResult",
    "LocalTierOptions",
    "RemoteTierOptions",
    "DistributedOptions",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "RollbackError",
    "StorageError",
    "StorageAccessError",
    "StorageUnavailableError",
    "StorageTimeoutError",
    "UploadError",
    "StepConflictError",
    "RunConflictError",
    "Health",
    "ReplicationPolicy",
    "SaveHandle",
    "SaveRecord",
    "StepInfo",
    "KeepPolicy",
    "__version__",
]
