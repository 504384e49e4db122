"""What the manager's replication component calls on the upload thread: one step's upload, and local retention
where no remote tier is configured."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import _sharded
from .storage.retry import RetryPolicy
from .tiers import uploader
from .tiers.verify import list_root

if TYPE_CHECKING:
    from ._engine import Engine
    from .replication import ReplicationPolicy

log = logging.getLogger(__name__)


def upload(eng: Engine, step: int, *, bucket: Any, channel: Any, attempt: str | None = None) -> None:
    """Replicate committed local step ``step`` to ``eng.remote`` (``bucket``: the bandwidth cap's token bucket or
    None; ``channel``, ``attempt``: a multi-rank upload's messages and name, the same on every rank). Raises
    :class:`~tierckpt.errors.UploadError` (or another :class:`~tierckpt.errors.StorageError`) on failure."""
    assert eng.remote is not None
    o = eng.options
    opts = dict(threads=o.upload_threads, part_size=o.upload_part_mb << 20, compression=o.remote_compression,
                verify=o.verify_uploads, deadline_s=o.upload_deadline_s, bucket=bucket,
                retry=RetryPolicy(window_s=o.remote_timeout_s),
                stall_s=o.remote_timeout_s)  # a silent remote fails the step in that time
    if eng.coord is None:
        uploader.replicate_step(eng.local, eng.remote, step, **opts)
    else:
        assert attempt is not None
        _sharded.upload(eng, step, opts, channel=channel, attempt=attempt)


def apply_local_retention(eng: Engine, retention: ReplicationPolicy) -> None:
    """Local retention without a remote tier: the newest ``keep_local`` steps stay (the node's leader decides
    for a folder its ranks share). Failures are logged, never raised: the next save tries again."""
    if eng.coord is not None and not eng.coord.topology.is_node_leader:
        return
    try:
        for step, _why in retention.local_deletions(list_root(eng.local).steps, replicated=None):
            uploader.delete_step(eng.local, step)
    except Exception as exc:
        log.warning("tier local: retention failed under %s: %s", eng.local.url, exc)
