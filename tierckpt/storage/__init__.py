"""Storage: where bytes live. Never imports torch.

- :mod:`.base`: the :class:`Store` interface, with capability flags instead of type checks.
- :mod:`.local`: POSIX folders through the OS (fsync, atomic rename); the local tier and POSIX remotes.
- :mod:`.fsspec_store`: everything fsspec reaches (``s3://``, ``gs://``, ``memory://``, ...).
- :mod:`.commit`: how a step folder becomes visible atomically on each kind of store.
"""

from __future__ import annotations

from .base import Store, WriteStream
from .open import open_store

__all__ = ["Store", "WriteStream", "open_store"]
