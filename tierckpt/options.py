"""The manager's keyword-only options, validated once with messages that name the option."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .storage.fsspec_store import DEFAULT_PART_SIZE


@dataclass(frozen=True)
class Options:
    """The keyword-only options of :class:`~tierckpt.CheckpointManager` and their defaults, checked once.

    The manager builds one from its keywords (``mgr.options``); each field is the keyword of the same name, and the
    manager's signature takes its defaults from here. Raises ``ValueError`` naming the option for a value out of
    range or of the wrong type. What each option does and costs: the documentation's tuning page.
    """

    keep_local: int = 2
    keep_remote: int | None = None
    keep_every: int | None = None
    writer_threads: int = 2
    staging_buffers: int = 1
    file_size_mb: int = 512
    upload_threads: int = 4
    upload_bandwidth_mbps: float | None = None
    upload_deadline_s: float | None = 3600.0
    upload_part_mb: int = DEFAULT_PART_SIZE >> 20
    remote_compression: str | None = None
    verify_uploads: bool = False
    remote_read_concurrency: int = 8
    remote_write_concurrency: int = 8
    cache_remote_restores: bool = False
    pin_memory: bool | None = None
    log_records: bool = True
    collective_timeout_s: float = 600.0
    lazy_snapshot: bool = False
    direct_io: bool = True
    remote_direct_io: bool | None = None
    overlap_writes: bool | None = None
    huge_pages: bool | None = None
    remote_timeout_s: float = 30.0
    max_upload_backlog: int = 2
    create_bucket: bool = False

    def __post_init__(self) -> None:
        def pos_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an int >= 1{' or None' if allow_none else ''}, got {v!r}")

        pos_int("keep_local")
        pos_int("keep_remote", True)
        pos_int("keep_every", True)
        pos_int("writer_threads")
        pos_int("staging_buffers")
        pos_int("file_size_mb")
        pos_int("upload_threads")
        pos_int("upload_part_mb")
        pos_int("remote_read_concurrency")
        pos_int("remote_write_concurrency")
        if not 5 <= self.upload_part_mb <= 5120:
            raise ValueError(f"upload_part_mb must be between 5 and 5120 (S3's smallest and largest part), got "
                             f"{self.upload_part_mb!r}")
        if type(self.max_upload_backlog) is not int or self.max_upload_backlog < 0:
            raise ValueError(f"max_upload_backlog must be an int >= 0, got {self.max_upload_backlog!r}")
        for name in ("upload_bandwidth_mbps", "upload_deadline_s", "collective_timeout_s", "remote_timeout_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {v!r}")
        if self.remote_compression not in (None, "zstd"):
            raise ValueError(f"remote_compression must be None or 'zstd', got {self.remote_compression!r}")
        for name in ("verify_uploads", "cache_remote_restores", "log_records", "lazy_snapshot", "direct_io",
                     "create_bucket"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("pin_memory", "overlap_writes", "remote_direct_io", "huge_pages"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be None (auto), True or False, got {getattr(self, name)!r}")


def check_metadata(metadata: Any) -> Any:
    """``save()``'s ``metadata``, refused unless it is JSON (no NaN/inf): it goes into the step manifest as is."""
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable (no NaN/inf): {exc}") from None
    return metadata


def check_storage_options(storage_options: Any) -> dict[str, Any] | None:
    """A copy of ``storage_options`` (the fsspec options of the remote tier), or None; ``ValueError`` for anything
    but a dict or None."""
    if storage_options is None:
        return None
    if not isinstance(storage_options, dict):
        raise ValueError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    return dict(storage_options)
