"""The manager's remote-tier glue: what its replication component calls on the upload thread (one step's upload,
the run-identity check before the first one), local retention where no remote tier is configured, the listings
that answer from the other tiers while the remote is known down, and the report of unfinished uploads at close."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import RunConflictError, StorageError
from ..format import layout
from ..replication.health import Health
from ..status import StepInfo, list_steps
from ..storage.base import Store
from ..storage.commit import read_step_manifest
from ..storage.failures import with_deadline
from ..storage.retry import RetryPolicy
from ..tiers import identity, uploader
from ..tiers.listing import TierListings, list_tiers
from ..tiers.steps import delete_steps
from ..tiers.steps import record as record_refs
from ..tiers.verify import list_root
from . import sharded as _sharded

if TYPE_CHECKING:
    from ..replication import ReplicationPolicy, Replicator
    from .core import Engine

log = logging.getLogger(__name__)


def upload(eng: Engine, step: int, *, bucket: Any, channel: Any, attempt: str | None = None,
           cancel: threading.Event | None = None, on_error: Callable[[BaseException], Any] | None = None) -> None:
    """Replicate committed local step ``step`` to ``eng.remote`` (``bucket``: the bandwidth cap's token bucket or
    None; ``channel``, ``attempt``: a multi-rank upload's messages and name, the same on every rank; ``cancel``:
    stops the upload soon after it is set; ``on_error``: told of every failed request). Raises
    :class:`~tierckpt.errors.UploadError` (or another :class:`~tierckpt.errors.StorageError`) on failure."""
    assert eng.remote is not None
    o = eng.options
    opts = dict(threads=o.upload_threads, part_size=o.upload_part_mb << 20, compression=o.remote_compression,
                verify=o.verify_uploads, deadline_s=o.upload_deadline_s, bucket=bucket,
                retry=RetryPolicy(window_s=o.remote_timeout_s), cancel=cancel, on_error=on_error,
                stall_s=o.remote_timeout_s)  # a silent remote fails the step in that time
    if eng.coord is None:
        uploader.replicate_step(eng.local, eng.remote, step, **opts)
    else:
        assert attempt is not None
        _sharded.upload(eng, step, opts, channel=channel, attempt=attempt)
    _note_refs(eng, step)


def _note_refs(eng: Engine, step: int) -> None:
    """Remember what the remote's copy of ``step`` may reference: what the local step references (the remote's copy
    references as much or, with files carried over, less), so that the remote's retention reads no manifest of a
    step this job uploaded. Read from the local tier; nothing is remembered if it cannot be read."""
    assert eng.remote is not None
    try:
        m = read_step_manifest(eng.local, layout.step_dir(step), step)
    except Exception:  # the remote's manifest is read when needed
        return
    if m is not None:
        record_refs(eng.remote, step, m.refs)


def apply_local_retention(eng: Engine, retention: ReplicationPolicy) -> None:
    """Local retention without a remote tier: the newest ``keep_local`` steps stay (the node's leader decides
    for a folder its ranks share). Failures are logged, never raised: the next save tries again."""
    if eng.coord is not None and not eng.coord.topology.is_node_leader:
        return
    try:
        listed = list_root(eng.local).steps
        deletions = retention.local_deletions(listed, replicated=None)
        # newest first: an incremental step goes before the steps it references, which can then go too
        delete_steps(eng.local, [step for step, _why in deletions], listed=listed)
    except Exception as exc:
        log.warning("tier local: retention failed under %s: %s", eng.local.url, exc)


# ------------------------------------------------------------------------------------------------ the run identity
def claim_remote(eng: Engine) -> None:
    """Before the first upload (on the upload thread): check that the remote belongs to this run, claiming an empty
    root, within ``remote_timeout_s`` (:func:`tierckpt.tiers.identity.check_remote`). Adopts the remote's run when
    this job continues it on purpose (``continue_remote_run``, or a restore that read a step from the remote).

    Raises:
        RunConflictError: the remote belongs to another run; StorageError: it could not be read in time."""
    assert eng.remote is not None
    remote, local = eng.remote, eng.local

    assert eng.identity is not None
    mine = eng.identity
    ident = with_deadline(
        lambda: identity.check_remote(remote, mine, local_url=local.url,
                                      adopt_theirs=eng.options.continue_remote_run or eng.continues_remote,
                                      shares_saves=lambda steps: _shares_saves(local, remote, steps)),
        deadline_s=eng.options.remote_timeout_s, what="check the run identity of", tier=remote.tier, url=remote.url,
        diagnose=remote.diagnose)
    if ident != mine:
        identity.adopt(local, ident)
        eng.identity = ident
    eng.remote_run = ident


def note_restored(eng: Engine, replicator: Replicator | None, step: int | None, listing: TierListings) -> None:
    """A restore or load returned ``step``: if it came from the remote (the local tier does not hold it), this job
    continues the remote's run, and uploads may claim it (see :mod:`tierckpt.tiers.identity`)."""
    if replicator is None or eng.remote is None or step is None or step in listing.steps.get(eng.local.tier, set()):
        return
    if eng.coord is not None and eng.coord.topology.rank != 0:
        return  # rank 0 checks and claims the remote for the job
    if step in listing.steps.get(eng.remote.tier, set()) and not eng.continues_remote:
        eng.continues_remote = True
        remote = eng.remote
        try:  # recorded locally now, so that a restart before the first upload continues the same run
            theirs = with_deadline(lambda: identity.read(remote), deadline_s=eng.options.remote_timeout_s,
                                   what="read the run identity of", tier=remote.tier, url=remote.url,
                                   diagnose=remote.diagnose)
        except Exception as exc:  # the check before the first upload adopts it then
            log.warning("tier remote: cannot read the run identity of %s: %s", remote.url, exc)
            theirs = None
        if theirs is not None and theirs != eng.identity:
            identity.adopt(eng.local, theirs)
            eng.identity = eng.remote_run = theirs
        replicator.adopt()


# ------------------------------------------------------------------------------------------------ listings
def list_for_call(eng: Engine, replicator: Replicator | None, tiers: list[Store], step: int | None) -> TierListings:
    """The tiers' committed steps for a restore, load or ``latest_step()``, bounded by ``remote_timeout_s``. While
    the remote is known to be failing (:meth:`RemoteState.known_down`) and another tier holds an answer (a step, or
    ``step``), the remote is not asked again: its known error stands in its place. A listing of the remote tells
    the remote's state how it went."""
    state = None if replicator is None else replicator.state
    remote = eng.remote
    down = None if state is None else state.known_down()
    if down is not None and remote is not None and remote in tiers and len(tiers) > 1:
        rest = list_tiers([t for t in tiers if t is not remote], deadline_s=eng.options.remote_timeout_s)
        if rest.known() if step is None else step in rest.known():
            return TierListings(rest.steps, {**rest.failed, remote.tier: down}, known_down=frozenset({remote.tier}))
    listing = list_tiers(tiers, deadline_s=eng.options.remote_timeout_s)
    if state is not None and remote is not None and remote in tiers:
        failed = listing.failed.get(remote.tier)
        if failed is None:
            state.succeeded()
        else:
            state.attempt_failed(failed, "listing")
    if remote is not None and len(tiers) > 1 and listing.steps.get(remote.tier) and listing.steps.get(eng.local.tier):
        theirs = _foreign_run(eng)
        if theirs is not None:  # this job has checkpoints of its own: never resume another run's by accident
            log.warning("tier remote: %s holds the checkpoints of another %s; this job's local folder %s holds "
                        "its own, so they are restored from it alone (restore(source='remote') or "
                        "continue_remote_run=True continue the other run)", remote.url, theirs.describe(),
                        eng.local.url)
            return TierListings({t: s for t, s in listing.steps.items() if t != remote.tier}, listing.failed)
    return listing


def _foreign_run(eng: Engine) -> identity.RunIdentity | None:
    """The remote's run identity if it is another run's that this job does not continue on purpose (read once,
    within ``remote_timeout_s``; None when it cannot be read: the listing that just succeeded decides)."""
    if eng.options.continue_remote_run or eng.continues_remote or eng.remote is None:
        return None
    if eng.remote_run is None:
        remote = eng.remote
        try:
            eng.remote_run = with_deadline(lambda: identity.read(remote), deadline_s=eng.options.remote_timeout_s,
                                           what="read the run identity of", tier=remote.tier, url=remote.url,
                                   diagnose=remote.diagnose)
        except Exception as exc:
            log.warning("tier remote: cannot read the run identity of %s: %s", remote.url, exc)
            return None
    theirs = eng.remote_run
    if theirs is None or eng.identity is None or theirs.run_id == eng.identity.run_id:
        return None
    remote = eng.remote
    try:  # the local tier holds the remote's saves (pulled from it): the same run
        shared = with_deadline(lambda: _shares_saves(eng.local, remote, set(list_root(remote).steps)),
                               deadline_s=eng.options.remote_timeout_s, what="compare the saves of",
                               tier=remote.tier, url=remote.url, diagnose=remote.diagnose)
    except Exception as exc:
        log.warning("tier remote: cannot compare the saves of %s with the local tier: %s", remote.url, exc)
        return theirs
    return None if shared else theirs


def _shares_saves(local: Store, remote: Store, steps: set[int]) -> bool:
    """Whether the local tier holds a save of one of the remote's committed ``steps`` with the same save id (its
    three newest common steps are compared)."""
    for s in sorted(set(list_root(local).steps) & steps, reverse=True)[:3]:
        mine = read_step_manifest(local, layout.step_dir(s), s)
        theirs = read_step_manifest(remote, layout.step_dir(s), s)
        if mine is not None and theirs is not None and mine.save_id == theirs.save_id:
            return True
    return False


def steps(eng: Engine, replicator: Replicator | None) -> list[StepInfo]:
    """``CheckpointManager.steps()``: every step of both tiers with its state; the local tier's alone (failed and
    queued uploads still marked) when the remote is known down or cannot be listed, or :class:`StorageError` when
    the local tier holds none."""
    failed = replicator.failed() if replicator is not None else set()
    waiting = replicator.waiting() if replicator is not None else set()
    remote = eng.remote
    configured = remote is not None
    down = None if replicator is None else replicator.state.known_down()
    if remote is not None and (down is None or not list_root(eng.local).steps):
        try:
            out = list_steps(eng.local, remote, failed, waiting, remote_deadline_s=eng.options.remote_timeout_s)
        except StorageError as exc:
            down = exc
            if replicator is not None:
                replicator.state.attempt_failed(exc, "listing")
        else:
            if replicator is not None:
                replicator.state.succeeded()
            return out
    if down is not None:
        TierListings({"local": set(list_root(eng.local).steps)}, {"remote": down}).require(
            None, remote.url if remote is not None else eng.local.url)
    return list_steps(eng.local, None, failed, waiting, remote_configured=configured)


def health(eng: Engine, replicator: Replicator | None) -> Health:
    """``CheckpointManager.health()``: the replicator's view, or the local tier's alone without a remote."""
    if replicator is not None:
        return replicator.health()
    steps = sorted(list_root(eng.local).steps)
    return Health(local_step=steps[-1] if steps else None, remote_step=None, remote_configured=False,
                  remote_listed=False, upload_lag_steps=0, upload_lag_s=0.0, uploading=None, waiting=(),
                  consecutive_failures=0, failing_since=None, last_error=None, last_error_time=None)


# ------------------------------------------------------------------------------------------------ closing
def report_unfinished(eng: Engine, replicator: Replicator, errors: list[BaseException], *, raise_errors: bool) -> None:
    """At ``close()``: log once which committed local steps the remote does not hold (kept locally for the next
    start or ``tierckpt sync``) and, with ``raise_errors``, raise the first upload error; a run conflict is always
    raised. Errors of local saves are the caller's."""
    unfinished = sorted(replicator.failed() | replicator.waiting())
    if unfinished:
        assert eng.remote is not None
        log.error("tier remote: %d committed steps are not on %s (%s); they are kept in %s: the next start resumes "
                  "their upload, or run `tierckpt sync %s %s`", len(unfinished), eng.remote.url,
                  ", ".join(map(str, unfinished)), eng.local.url, eng.local.url, eng.remote.url)
    conflicts = [e for e in errors if isinstance(e, RunConflictError)]
    if conflicts:
        raise conflicts[0]
    if errors and raise_errors:
        if len(errors) > 1:
            log.error("%d more upload errors are not raised (their steps are listed above)", len(errors) - 1)
        raise errors[0]
    for exc in errors:
        log.warning("tier remote: upload error at close (not raised: raise_upload_errors=False): %s", exc)
