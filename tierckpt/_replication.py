"""The manager's remote side: the upload thread, resuming uploads at start-up, and retention in both tiers.

Invariants: one upload thread replicates committed local steps in order; a step whose upload failed stays in the
local tier (whatever ``keep_local`` says) until a later manager or ``tierckpt sync`` replicates it; retention in a
tier runs only after a newer step committed there and never deletes its newest step; a local step is deleted only
once its remote copy is committed (when a remote tier is configured). In a multi-rank job the node's leader applies
local retention and rank 0 remote retention.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from . import _sharded
from .retention import KeepPolicy
from .tiers.uploader import delete_step
from .tiers.verify import list_root

if TYPE_CHECKING:
    from .handle import SaveHandle
    from .manager import CheckpointManager

log = logging.getLogger("tierckpt.manager")


def enqueue_upload(mgr: CheckpointManager, step: int, handle: SaveHandle | None) -> None:
    fut: Future = Future()
    mgr._track(fut)
    mgr._uploads.put((step, handle, fut))  # type: ignore[arg-type]


def resume_uploads(mgr: CheckpointManager) -> None:
    assert mgr.remote is not None
    try:
        remote_steps = set(list_root(mgr.remote).steps)
    except Exception as exc:  # remote down at start-up: the uploads will retry
        log.warning("tier remote: cannot list %s at start-up: %s", mgr.remote.url, exc)
        remote_steps = set()
    policy = KeepPolicy(keep_last=mgr.options.keep_remote, keep_every=mgr.options.keep_every)
    pending = []
    for step in list_root(mgr.local).steps:
        if step in remote_steps:
            mgr._uploaded_remote.add(step)
        elif step in policy.to_delete(remote_steps | {step}):
            # remote retention would delete it at once (it removed it before): no upload, and the local
            # copy counts as replicated for local retention, a newer step being durable remotely
            mgr._uploaded_remote.add(step)
        else:
            pending.append(step)
    if mgr._coord is not None:  # a multi-rank step needs every rank's shard: resume what every rank still has
        everyone = mgr._coord.gather(pending, mgr._coord.main_group)
        pending = sorted(set(everyone[0]).intersection(*map(set, everyone[1:])))
    for step in pending:
        log.info("tier remote: re-queueing upload of step %d (committed locally, missing in %s)", step, mgr.remote.url)
        enqueue_upload(mgr, step, None)


def upload_loop(mgr: CheckpointManager) -> None:
    while True:
        item = mgr._uploads.get()
        if item is None:
            return
        step, handle, fut = item  # type: ignore[misc]
        mgr._uploading_now = step
        try:
            from .tiers import uploader

            assert mgr.remote is not None
            opts = dict(
                threads=mgr.options.upload_threads, part_size=mgr.options.upload_part_mb << 20,
                bandwidth_bytes_per_s=None if mgr.options.upload_bandwidth_mbps is None else mgr.options.upload_bandwidth_mbps * 1e6,
                compression=mgr.options.remote_compression, verify=mgr.options.verify_uploads,
                deadline_s=mgr.options.upload_deadline_s,
            )
            if mgr._coord is None:
                uploader.replicate_step(mgr.local, mgr.remote, step, **opts)
            else:
                _sharded.upload(mgr, step, opts)
            mgr._uploaded_remote.add(step)
            mgr._upload_failed.discard(step)
            mgr._uploading_now = None
            if handle is not None:
                handle._record.upload_s = handle.elapsed()
                handle.uploaded.set_result(handle._record.upload_s)
                mgr._write_record(handle)
            apply_remote_retention(mgr)
            apply_local_retention(mgr)
            catch_up(mgr)
            fut.set_result(None)
        except BaseException as exc:
            mgr._upload_failed.add(step)
            mgr._uploading_now = None
            mgr._background_error(exc, f"uploading step {step} to the remote tier failed (the local copy is kept)")
            if handle is not None:
                handle._record.error = str(exc)
                handle.uploaded.set_exception(exc)
                mgr._write_record(handle)
            fut.set_result(None)


def catch_up(mgr: CheckpointManager) -> None:
    """After an upload succeeds (the remote is reachable again), re-queue the steps whose upload failed earlier and
    that the remote's retention would still keep; the others are superseded by a newer durable step."""
    failed = sorted(mgr._upload_failed)
    if not failed:
        return
    assert mgr.remote is not None
    try:
        remote_steps = set(list_root(mgr.remote).steps)
        local_steps = set(list_root(mgr.local).steps)
    except Exception as exc:
        log.warning("tier remote: cannot list for catching up failed uploads: %s", exc)
        return
    policy = KeepPolicy(keep_last=mgr.options.keep_remote, keep_every=mgr.options.keep_every)
    for step in failed:
        mgr._upload_failed.discard(step)
        if step in remote_steps or step not in local_steps or step in policy.to_delete(remote_steps | {step}):
            mgr._uploaded_remote.add(step)  # durable remotely, gone, or superseded: local retention may proceed
            continue
        log.info("tier remote: retrying the upload of step %d, which failed earlier", step)
        enqueue_upload(mgr, step, None)


def apply_local_retention(mgr: CheckpointManager) -> None:
    if mgr._coord is not None and not mgr._coord.topology.is_node_leader:
        return  # the node's leader applies retention to the folder its ranks share
    try:
        steps = list(list_root(mgr.local).steps)
        policy = KeepPolicy(keep_last=mgr.options.keep_local)
        for step in policy.to_delete(steps):
            if mgr.remote is not None and step not in mgr._uploaded_remote:
                continue  # never drop the only durable copy
            delete_step(mgr.local, step)
    except Exception as exc:
        log.warning("tier local: retention failed under %s: %s", mgr.local.url, exc)


def apply_remote_retention(mgr: CheckpointManager) -> None:
    assert mgr.remote is not None
    if mgr._coord is not None and mgr._coord.topology.rank != 0:
        return  # rank 0 applies retention to the shared remote
    try:
        steps = list(list_root(mgr.remote).steps)
        policy = KeepPolicy(keep_last=mgr.options.keep_remote, keep_every=mgr.options.keep_every)
        for step in policy.to_delete(steps):
            delete_step(mgr.remote, step)  # stays in _uploaded_remote: its local copy may go too
    except Exception as exc:
        log.warning("tier remote: retention failed under %s: %s", mgr.remote.url, exc)
