"""The manager's keyword-only options, validated once with messages that name the option."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .storage.fsspec_store import DEFAULT_PART_SIZE

G = TypeVar("G")


@dataclass(frozen=True)
class LocalTierOptions:
    """Options of the node-local tier and of the snapshot that feeds it (a group of :class:`Options`)."""

    #: newest committed steps kept in the local tier (more while uploads are behind: ``max_upload_backlog``)
    keep_local: int = 2
    #: parallel file writers, readers and hashers for the local tier; a state splits into a multiple of this many
    #: files. Raise it on NVMe arrays that need more queue depth; each writer takes a core while it hashes
    writer_threads: int = 2
    #: host staging slots, each the size of one snapshot: the memory budget is ``staging_buffers x state bytes``.
    #: With 1, a save waits while the previous one is still being written
    staging_buffers: int = 1
    #: target size of one data file; large states split so that files write and read in parallel
    file_size_mb: int = 512
    #: write (and read uncached files) with ``O_DIRECT`` where the file system allows it, bypassing the page cache.
    #: False: everything through the page cache
    direct_io: bool = True
    #: pin the staging buffers (None: when CUDA is available): faster device-to-host copies, locked memory
    pin_memory: bool | None = None
    #: ``save()`` returns before the copy, which runs during the next forward/backward;
    #: :meth:`~tierckpt.CheckpointManager.snapshot_barrier` (automatic before ``optimizer.step()``) waits for it.
    #: Tensors changed in place before that barrier must be barriered by hand
    lazy_snapshot: bool = False
    #: append each save's record to ``saves.jsonl`` in the local folder
    log_records: bool = True
    #: large host buffers on transparent huge pages (None: where the kernel offers them). False on VMs where fresh
    #: huge pages are slow (a balloon reporting free memory to the host)
    huge_pages: bool | None = None
    #: keep each staging slot in shared memory (``/dev/shm``) that outlives a crashed process, with the newest
    #: locally committed step it holds: a restart on the same node restores from memory, verified, before the
    #: local disk (docs/memory-tier.md). Freed by ``close()``
    memory_tier: bool = False
    #: a save writes (and uploads) only the tensors whose bytes differ from those of the newest step committed in
    #: that tier, and references that step's stored bytes for the rest (in a multi-rank job each rank its own shard's;
    #: docs/format.md, "Incremental steps")
    incremental: bool = False
    #: with ``incremental``: every that many saves, a step is written whole, so that the older steps it would
    #: reference can go (None: only when nothing can be referenced)
    full_every: int | None = None


@dataclass(frozen=True)
class RemoteTierOptions:
    """Options of the remote tier: retention, uploads, reads and deadlines (a group of :class:`Options`)."""

    #: newest committed steps kept in the remote tier (None: every step)
    keep_remote: int | None = None
    #: also keep every K-th step in the remote tier (milestones), beyond ``keep_remote``
    keep_every: int | None = None
    #: files of one step uploaded in parallel
    upload_threads: int = 4
    #: cap on upload bandwidth in MB/s (None: none), to leave the network to training
    upload_bandwidth_mbps: float | None = None
    #: a step's upload fails after this many seconds (None: never); ``close()`` waits at most this long for the
    #: upload in progress, and tries no other once the remote fails
    upload_deadline_s: float | None = 3600.0
    #: size of one part of a multipart upload to S3 (5-5120 MiB); ``remote_write_concurrency`` of them in memory
    upload_part_mb: int = DEFAULT_PART_SIZE >> 20
    #: ``"zstd"`` compresses the remote copies (the local tier stays uncompressed)
    remote_compression: str | None = None
    #: read each uploaded file back and check its checksum (a full extra read of every upload)
    verify_uploads: bool = False
    #: ranged reads of one file in flight when reading from an object store (a restore, a verification)
    remote_read_concurrency: int = 8
    #: parts of the uploads to S3 in flight at once (each ``upload_part_mb`` of memory)
    remote_write_concurrency: int = 8
    #: copy a step restored from the remote tier into the local tier (single-rank jobs)
    cache_remote_restores: bool = False
    #: how long a restore, ``steps()``, ``latest_step()`` and the start-up resume keep trying to list the remote
    #: (retrying transient failures) before going on without it, or raising where no other tier answered; also
    #: how long an upload may move no byte before it fails
    remote_timeout_s: float = 30.0
    #: committed local steps kept beyond ``keep_local`` while the remote is down or slower than the saves
    max_upload_backlog: int = 2
    #: create the remote's bucket if it is missing (default: a mistyped bucket name fails)
    create_bucket: bool = False
    #: this job continues the run whose checkpoints the remote holds, though its local folder belongs to another
    #: run (or is new and restored nothing from the remote): it adopts that run's identity. Without it such a job
    #: uploads nothing (``RunConflictError``), so that no other run's checkpoint is ever mixed or replaced
    continue_remote_run: bool = False


@dataclass(frozen=True)
class DistributedOptions:
    """Options of multi-rank jobs (a group of :class:`Options`)."""

    #: how long a rank waits for the others to reach an agreement (a commit, a restore) before failing it
    collective_timeout_s: float = 600.0
    #: copy each node's committed local step to this many partner nodes (the next ones in a ring of the nodes), kept
    #: there as that node's replica, so that a job that lost a node restores its newest local step (0: off; 1 or 2;
    #: needs at least ``peer_replicas + 1`` nodes; docs/peer-copies.md)
    peer_replicas: int = 0


@dataclass(frozen=True)
class Heuristics:
    """Internal heuristics, kept as keywords; their automatic choices are measured, not for tuning."""

    #: ``direct_io`` for a remote given as a path only (None: as ``direct_io``); False keeps an NFS mount whose
    #: ``O_DIRECT`` is slow on the page cache
    remote_direct_io: bool | None = None
    #: write each file while the rest of the snapshot is still being copied (None: where it measured a gain)
    overlap_writes: bool | None = None


#: the groups, in the order their fields appear in :class:`Options`
GROUPS = (LocalTierOptions, RemoteTierOptions, DistributedOptions, Heuristics)
#: the manager's keyword for each group a user may pass whole
_GROUP_KEYWORDS: dict[str, type] = {"local_tier": LocalTierOptions, "remote_tier": RemoteTierOptions,
                                    "distributed": DistributedOptions}


@dataclass(frozen=True)
class Options(Heuristics, DistributedOptions, RemoteTierOptions, LocalTierOptions):
    """The keyword-only options of :class:`~tierckpt.CheckpointManager` and their defaults, checked once.

    The manager builds one from its keywords (``mgr.options``); each field is the keyword of the same name, and the
    manager's signature takes its defaults from here. The fields come in groups, each a frozen dataclass that
    documents its fields (:class:`LocalTierOptions`, :class:`RemoteTierOptions`, :class:`DistributedOptions`,
    :class:`Heuristics`); a group may be passed whole to the manager (``local_tier=``, ``remote_tier=``,
    ``distributed=``) and read back with :meth:`group`. Raises ``ValueError`` naming the option for a value out of
    range or of the wrong type.
    """

    def group(self, cls: type[G]) -> G:
        """This options' fields of group ``cls`` (one of :data:`GROUPS`) as that group's dataclass."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    @classmethod
    def from_keywords(cls, given: dict[str, Any], groups: dict[str, Any]) -> Options:
        """The options of a manager called with ``given`` (every keyword, defaults included) and ``groups`` (the
        group objects passed whole, by keyword, or None). A group replaces its fields' keywords; a keyword of a
        group also passed whole must keep its default. Raises ``ValueError`` otherwise, naming both."""
        values = {f.name: given[f.name] for f in fields(cls)}
        for keyword, group in groups.items():
            if group is None:
                continue
            want = _GROUP_KEYWORDS[keyword]
            if type(group) is not want:
                raise ValueError(f"{keyword} must be a {want.__name__}, got {group!r}")
            for f in fields(group):
                if given[f.name] != f.default:
                    raise ValueError(f"{f.name} given both as a keyword and in {keyword}; pass it once")
                values[f.name] = getattr(group, f.name)
        return cls(**values)

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
        pos_int("full_every", True)
        if self.full_every is not None and self.incremental is not True:
            raise ValueError(f"full_every applies to incremental saves: pass incremental=True with "
                             f"full_every={self.full_every!r}")
        if not 5 <= self.upload_part_mb <= 5120:
            raise ValueError(f"upload_part_mb must be between 5 and 5120 (S3's smallest and largest part), got "
                             f"{self.upload_part_mb!r}")
        if type(self.max_upload_backlog) is not int or self.max_upload_backlog < 0:
            raise ValueError(f"max_upload_backlog must be an int >= 0, got {self.max_upload_backlog!r}")
        for name in ("upload_bandwidth_mbps", "upload_deadline_s", "collective_timeout_s", "remote_timeout_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {v!r}")
        if type(self.peer_replicas) is not int or not 0 <= self.peer_replicas <= 2:
            raise ValueError(f"peer_replicas must be 0 (off), 1 or 2, got {self.peer_replicas!r}")
        if self.remote_compression not in (None, "zstd"):
            raise ValueError(f"remote_compression must be None or 'zstd', got {self.remote_compression!r}")
        for name in ("verify_uploads", "cache_remote_restores", "log_records", "lazy_snapshot", "direct_io",
                     "create_bucket", "continue_remote_run", "incremental", "memory_tier"):
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
