"""A manager's components from start to stop: the local tier recovered from a crash at start-up, the remote
store's options, the peer copies of a multi-node job and the replication component; the wait for the background
work a manager tracks (``wait()``, ``close()``); and the order in which ``close()`` stops them all.

The manager builds the stores, the coordinator and the replication policy itself and hands them in; each function
here works on what it is given (the :class:`~.core.Engine` and the components), never on the manager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from ..peers.node import Peers
from ..replication import Replicator
from ..storage.commit import protocol_for
from . import sharded as _sharded
from . import uploads as _uploads

if TYPE_CHECKING:
    from ..distributed import Coordinator
    from ..options import Options
    from ..policy import Preemption
    from ..replication import ReplicationPolicy
    from ..storage.local import LocalStore
    from .core import Engine
    from .pipeline import SavePipeline

log = logging.getLogger(__name__)


def recover_local(local: LocalStore, coord: Coordinator | None) -> None:
    """Finish or roll back what a crash left in the local tier (every rank's folder at once in a multi-rank job)."""
    if coord is None:
        for action in protocol_for(local).recover(local):
            log.info("tier local: %s under %s", action, local.url)
    else:
        _sharded.recover_local(local, coord)


def remote_store_options(options: Options, huge: bool) -> dict[str, Any]:
    """The keywords the remote tier's store is opened with (besides the URL, ``storage_options`` and the tier)."""
    return dict(part_size=options.upload_part_mb << 20, read_concurrency=options.remote_read_concurrency,
                write_concurrency=options.remote_write_concurrency,
                direct_io=options.direct_io if options.remote_direct_io is None else options.remote_direct_io,
                huge_pages=huge, create_bucket=options.create_bucket)


def start_peers(local: LocalStore, coord: Coordinator | None, options: Options) -> Peers | None:
    """The peer copies of a multi-node job (``peer_replicas``), or None. Raises ValueError in a single-rank
    job, CheckpointError on every rank where the job has too few nodes."""
    copies = options.peer_replicas
    if not copies:
        return None
    if coord is None:
        raise ValueError(f"peer_replicas={copies} needs a multi-rank job on several nodes (world_size > 1); "
                         "a single process has no partner node to copy to")
    return Peers(local, coord, copies, keep=options.keep_local, timeout_s=options.remote_timeout_s)


def build_replicator(eng: Engine, policy: ReplicationPolicy, bucket: Any, *, resume: list[int],
                     on_done: Callable[[Any], None], track: Callable[[Future], Any]) -> Replicator:
    """The replication component for ``eng.remote``, not started yet: rank 0 applies the remote's retention and
    checks the run identity before the first upload, each node's leader applies the local tier's retention, and a
    multi-rank job's replicators exchange their decisions through the job's c10d store. ``bucket``: the bandwidth
    cap's token bucket or None; ``resume``: committed local steps."""
    assert eng.remote is not None
    coord = eng.coord
    leader = coord is None or coord.topology.is_node_leader
    first = coord is None or coord.topology.rank == 0
    channel = None if coord is None else coord.upload_channel()

    def upload(step: int, attempt: str | None = None, cancel: Any = None) -> None:
        _uploads.upload(eng, step, bucket=bucket, channel=channel, attempt=attempt, cancel=cancel,
                        on_error=replicator.state.request_failed)

    replicator = Replicator(eng.local, eng.remote, policy=policy, upload=upload, resume=resume, on_done=on_done,
                            track=track, remote_retention=first, local_retention=leader, channel=channel,
                            list_deadline_s=eng.options.remote_timeout_s,
                            claim=(lambda: _uploads.claim_remote(eng)) if first else None)
    return replicator


def wait_for(pending: set[Future], timeout: float | None) -> None:
    """Wait until ``pending`` is empty (futures leave it as they finish; new ones may join meanwhile). Raises
    TimeoutError when work is still pending after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        waiting = list(pending)
        if not waiting:
            break
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, not_done = wait_futures(waiting, timeout=left)
        if not_done and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{len(not_done)} checkpoint operations still pending after {timeout} s")


def stop(eng: Engine, replicator: Replicator | None, pipeline: SavePipeline, preemption: Preemption,
         timeout: float | None) -> None:
    """Stop a closing manager's components, the upload thread first (``timeout``, default ``remote_timeout_s``)
    and the remote store last; the folder lock is the manager's to release."""
    if replicator is not None:  # idle by now, unless a listing of a silent remote is in flight
        replicator.close(timeout if timeout is not None else eng.options.remote_timeout_s)
    pipeline.close()
    if eng.peers is not None:
        eng.peers.close()
    eng.io.shutdown(wait=True)
    eng.hash.shutdown(wait=True)
    eng.pool.close()
    eng.close()  # the restore's bounce buffers are unmapped with it
    preemption.uninstall()
    if eng.coord is not None:
        eng.coord.destroy()
    if eng.remote is not None:
        eng.remote.close()
