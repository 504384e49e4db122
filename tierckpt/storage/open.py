"""Turning a user's path or URL into a :class:`~tierckpt.storage.base.Store` (the one seam for URL handling)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from .base import Store


def is_url(target: str | os.PathLike[str]) -> bool:
    s = os.fspath(target)
    return "://" in s and not s.startswith("file://")


def open_store(
    target: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    tier: str = "remote",
    create: bool = True,
    part_size: int | None = None,
    read_concurrency: int | None = None,
    write_concurrency: int | None = None,
    direct_io: bool = False,
    huge_pages: bool = False,
    create_bucket: bool = False,
) -> Store:
    """A plain path or ``file://`` URL opens a :class:`LocalStore` (fsync, atomic rename); any other URL goes through
    fsspec, whose backend package is imported only then. ``part_size``, ``read_concurrency`` and
    ``write_concurrency`` (None: the defaults) apply to fsspec stores only; ``direct_io`` (``O_DIRECT`` where the
    file system accepts it, see :mod:`.local`) and ``huge_pages`` (its read buffers on transparent huge pages) to
    paths only. ``create_bucket``: an object store's missing bucket is created (otherwise never: see
    :class:`~tierckpt.storage.fsspec_store.FsspecStore`)."""
    s = os.fspath(target)
    if not s:
        raise CheckpointError("empty path or URL", tier=tier)
    if not is_url(s):
        from .local import LocalStore

        path = s[len("file://") :] if s.startswith("file://") else s
        return LocalStore(path, tier=tier, create=create, direct_io=direct_io, huge_pages=huge_pages)
    from .fsspec_store import FsspecStore

    kwargs: dict[str, Any] = {}
    if part_size is not None:
        kwargs["part_size"] = part_size
    if read_concurrency is not None:
        kwargs["read_concurrency"] = read_concurrency
    if write_concurrency is not None:
        kwargs["write_concurrency"] = write_concurrency
    return FsspecStore(s, storage_options=storage_options, tier=tier, create_bucket=create_bucket, **kwargs)
