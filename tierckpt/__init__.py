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
    StateMismatchError,
    StorageError,
    UploadError,
)
from .handle import SaveHandle, SaveRecord
from .manager import CheckpointManager
from .retention import KeepPolicy
from .status import StepInfo

__all__ = [
    "CheckpointManager",
    "CheckpointError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "StorageError",
    "UploadError",
    "SaveHandle",
    "SaveRecord",
    "StepInfo",
    "KeepPolicy",
    "__version__",
]
