"""The replication component: one background thread that makes committed local steps durable on the remote tier.

Order of calls: construct; :meth:`Replicator.start` once (the thread lists the remote and resumes what earlier runs
left unreplicated: no remote I/O on the caller's thread); :meth:`Replicator.submit` for each step committed
locally, from any thread; :meth:`Replicator.apply_local_retention`, :meth:`Replicator.health`,
:meth:`Replicator.waiting`, :meth:`Replicator.take_errors` at any time; :meth:`Replicator.fence` before a rollback
sets steps aside, :meth:`Replicator.adopt` once the job continues the remote's run; :meth:`Replicator.begin_close`
then :meth:`Replicator.close` once.

Invariants:

- a failing remote never costs a local checkpoint: the thread only reads the local tier, and local retention
  deletes a step only as :meth:`~tierckpt.replication.policy.ReplicationPolicy.local_deletions` allows (never one
  of the newest ``keep_local``; an unreplicated one only when superseded or past the backlog, logged:
  :mod:`.trimming`);
- nothing is uploaded before ``claim()`` found the remote to be this run's (:mod:`tierckpt.tiers.identity`);
- the newest wanted step is uploaded first; waiting steps that the remote's retention would not keep, or whose
  local copy is gone, are dropped (their handles resolve with None and the record says why);
- the remote has one failure streak and backoff (:class:`~tierckpt.replication.remote_state.RemoteState`): each
  new save is tried once, the steps that waited while a try failed are resolved as failed without one, and the
  failed steps are tried again together once the backoff has passed, or at once after a success; an error is
  raised by ``wait()``/``close()`` once and only while it applies (not after its step was uploaded or superseded:
  :mod:`.outcomes`);
- once closing, no step is tried after the remote fails, and failed steps are left for the next start;
- after :meth:`Replicator.fence`, no upload of a step it dropped starts or commits (the one in progress is
  cancelled and waited for);
- every piece of state is under one lock; the thread is the only one that uploads or deletes remote steps;
- in a multi-rank job (an :class:`UploadChannel`) every rank uploads the same steps in the same order: rank 0's
  replicator (the leader) decides as above and publishes each decision (the step to upload, the steps dropped or
  failed without a try, the unreplicated local steps to delete); the others (followers, :mod:`.follower`) apply
  the decisions in order and decide nothing by themselves. So every node's local tier is bounded the same way, and
  no rank waits for a shard another skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import RunConflictError, UploadError
from ..storage.base import Store
from ..storage.failures import with_deadline
from ..tiers.listing import list_root
from .follower import Follower
from .health import Health, UploadChannel
from .outcomes import Outcomes, Waiter
from .policy import REPLICATED, ReplicationPolicy, remote_summary
from .remote_state import RemoteState
from .trimming import Trimming

__all__ = ["Health", "Replicator", "UploadChannel"]

log = logging.getLogger(__name__)


class Replicator(Trimming, Follower, Outcomes):
    """See the module docstring. ``upload(step, cancel=event)`` replicates one committed local step (raises on
    failure; stops soon after ``event`` is set; in a multi-rank job it is called with ``attempt=name`` too, the same
    name on every rank); ``resume`` are the committed local steps found at start-up (uploaded if the remote lacks
    them and still wants them); ``on_done(handle)`` is called once a handle's upload is resolved (the manager writes
    its record); ``track(future)`` is handed the future of each upload the component starts by itself (resumed
    steps, and failed steps caught up once the remote answers again), so that the owner's ``wait()`` includes them.
    ``remote_retention`` / ``local_retention``: whether this process applies each tier's retention (in a
    multi-rank job, rank 0 and each node's leader). ``channel``: a multi-rank job's decisions (see the module
    docstring). ``list_deadline_s``: how long a listing of the remote keeps trying before it is given up for now.
    ``claim()``: called on this thread before the first upload (and again until it succeeds): checks that the
    remote belongs to this run (:mod:`tierckpt.tiers.identity`); a :class:`~tierckpt.errors.RunConflictError` it
    raises stops every upload. ``clock``: monotonic seconds, for the retry backoff (tests inject their own, then
    call :meth:`wake`)."""

    def __init__(self, local: Store, remote: Store, *, policy: ReplicationPolicy, upload: Callable[..., Any],
                 resume: list[int], on_done: Callable[[Any], None], track: Callable[[Future], Any] = lambda f: None,
                 remote_retention: bool = True, local_retention: bool = True,
                 channel: UploadChannel | None = None, list_deadline_s: float | None = 30.0,
                 claim: Callable[[], Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.local = local
        self.remote = remote
        self.policy = policy
        self._upload = upload
        self._on_done = on_done
        self._remote_retention = remote_retention
        self._local_retention = local_retention
        self._channel = channel
        self._follower = channel is not None and not channel.leader
        self._seq = 0  # the next decision's number (multi-rank)
        #: a follower's outcome of each step a decision named: its submit() may come after the decision
        self._outcomes: dict[int, tuple[str, Any]] = {}
        self._list_deadline_s = list_deadline_s
        self._claim = claim
        self._claimed = claim is None or self._follower
        self._clock = clock
        #: the remote's failure streak and backoff, shared with the manager's listings
        self.state = RemoteState(remote.url, retry_delay=policy.retry_delay, clock=clock)
        self._cond = threading.Condition()
        self._retention_lock = threading.Lock()
        self._track = track
        self._waiting: dict[int, list[Waiter]] = {}
        self._committed_at: dict[int, float] = {s: clock() for s in resume}
        self._resume = set(resume)
        for step in resume:  # queued now, so that wait() covers them before the thread has listed the remote
            self._waiting[step] = [self._own_waiter()]
        self._failed_steps: set[int] = set()  # failed or deferred while the remote fails: tried again after it
        self._fenced: set[int] = set()  # set aside by a rollback: never uploaded (a new save of the step lifts it)
        self._replicated: set[int] = set()
        self._remote_steps: set[int] | None = None
        self._current: int | None = None
        self._cancel: threading.Event | None = None  # the upload in progress stops when it is set
        self._conflict: BaseException | None = None  # the remote belongs to another run: nothing is uploaded
        self._errors: list[tuple[int | None, BaseException]] = []  # (step, error) not taken yet
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tierckpt-upload", daemon=True)

    # ----------------------------------------------------------------------------------------------- interface
    def start(self) -> None:
        self._thread.start()

    def submit(self, step: int, handle: Any = None) -> Future:
        """Queue committed local step ``step``; returns a future that resolves (never with an error) once its
        first upload attempt is over: uploaded, failed (the error is in ``handle.uploaded`` and
        :meth:`take_errors`), dropped, or not tried because the remote is failing (then it is tried again with the
        other failed steps once the remote's backoff has passed)."""
        fut: Future = Future()
        waiter = Waiter(handle, fut)
        with self._cond:
            self._committed_at.setdefault(step, self._clock())
            self._fenced.discard(step)  # a new save of a step a rollback set aside
            outcome = self._outcomes.pop(step, None)
            if outcome is None:
                self._waiting.setdefault(step, []).append(waiter)
                self._failed_steps.discard(step)
                self._cond.notify_all()
        if outcome is not None:  # a follower whose leader decided on this step before it was committed here
            kind, detail = outcome
            if kind == "failed":
                self._fail_waiters(step, [waiter], detail)
            else:
                self._resolve(step, [waiter], skipped=detail if kind == "dropped" else None)
        return fut

    def wake(self) -> None:
        """Re-evaluate whether the remote is due (after the injected ``clock`` moved; tests)."""
        with self._cond:
            self._cond.notify_all()

    def replicated(self, step: int) -> bool:
        with self._cond:
            return step in self._replicated

    def waiting(self) -> set[int]:
        """Steps queued or being uploaded (not those waiting for a retry: :meth:`failed`)."""
        with self._cond:
            out = set(self._waiting)
            return out if self._current is None else out | {self._current}

    def failed(self) -> set[int]:
        """Steps whose last upload failed (or that were not tried while the remote failed), waiting for a retry."""
        with self._cond:
            return set(self._failed_steps)

    def remote_steps(self) -> set[int] | None:
        """Committed remote steps as last listed or uploaded; None while the remote has not been listed (or
        belongs to another run)."""
        with self._cond:
            return None if self._remote_steps is None or self._conflict is not None else set(self._remote_steps)

    def _listed(self, steps: set[int]) -> set[int]:
        """Under the lock: the remote holds ``steps`` as a listing read them, less those a rollback set aside
        since (a listing that started before :meth:`fence` may land after it). Returns what it records."""
        self._remote_steps = steps - self._fenced
        return self._remote_steps

    def fence(self, above: int, timeout_s: float | None) -> list[int]:
        """Stop replicating every step after ``above`` (a rollback sets them aside next): the waiting and failed
        ones are dropped, and an upload of one in progress is cancelled and waited for (at most ``timeout_s``), so
        that no upload lands after the caller has set the steps aside. A later :meth:`submit` of such a step (a new
        save) uploads it as usual. Returns the steps dropped or cancelled.

        Raises:
            TimeoutError: the upload in progress did not stop within ``timeout_s``."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            newer = {s for s in set(self._waiting) | self._failed_steps if s > above}
            dropped = [(s, self._waiting.pop(s, [])) for s in newer]
            self._failed_steps -= newer
            self._fenced |= newer
            busy = self._current
            if busy is not None and busy > above:
                self._fenced.add(busy)
                newer.add(busy)
                if self._cancel is not None:
                    self._cancel.set()
                while self._current == busy:
                    left = None if end is None else end - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"the upload of step {busy} did not stop within {timeout_s} s")
                    self._cond.wait(left)
            self._fenced |= {s for s in self._committed_at if s > above}
            self._remote_steps = None if self._remote_steps is None else {s for s in self._remote_steps if s <= above}
            self._replicated = {s for s in self._replicated if s <= above}
        for s, waiters in dropped:
            self._resolve(s, waiters, skipped="set aside by a rollback")
        return sorted(newer)

    def forget(self, steps: set[int]) -> None:
        """Stop replicating ``steps`` (set aside by a rollback): waiting handles resolve as dropped."""
        with self._cond:
            dropped = [(s, self._waiting.pop(s, [])) for s in steps]
            self._failed_steps -= set(steps)
            self._fenced |= set(steps)
            for s in steps:
                self._replicated.discard(s)
                if self._remote_steps is not None:
                    self._remote_steps.discard(s)
        for s, waiters in dropped:
            self._resolve(s, waiters, skipped="set aside by a rollback")

    def adopt(self) -> None:
        """This process now continues the remote's run (its identity was adopted): uploads may start."""
        with self._cond:
            self._conflict = None
            self._claimed = self._claim is None
            self._cond.notify_all()

    def health(self) -> Health:
        try:
            local_steps = sorted(list_root(self.local).steps)
        except OSError:
            local_steps = sorted(self._committed_at)
        with self._cond:
            remote_step = max(self._remote_steps) if self._remote_steps else None
            lagging = [s for s in local_steps if remote_step is None or s > remote_step]
            now = self._clock()
            lag_s = max((now - self._committed_at.get(s, now) for s in lagging), default=0.0)
            fields = self.state.fields()
            if self._conflict is not None:
                fields = {**fields, "consecutive_failures": max(1, fields["consecutive_failures"]),
                          "last_error": str(self._conflict)}
            return Health(
                local_step=local_steps[-1] if local_steps else None, remote_step=remote_step,
                remote_configured=True, remote_listed=self._remote_steps is not None,
                upload_lag_steps=len(lagging), upload_lag_s=lag_s, uploading=self._current,
                waiting=tuple(sorted(set(self._waiting) | self._failed_steps)), **fields)

    def begin_close(self) -> None:
        """The owner is closing: steps still waiting are tried once while the remote answers; none is tried once
        it fails (they are reported and stay committed locally), and failed steps are not retried."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread after the upload in progress (waiting steps stay committed locally; the next start
        resumes them)."""
        with self._cond:
            self._closing = self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        if self._follower:
            self._follow()
            return
        self._list_remote(resume=True)
        while True:
            job = self._next_job()
            if job is None:
                return
            kind, due = job
            try:
                if kind == "defer":
                    self._defer()
                elif kind == "probe":
                    self._probe()
                else:
                    self._round(due)
            except Exception as exc:  # a bug, or the c10d store gone: logged, and the thread goes on
                log.exception("tier remote: replication round failed under %s: %s", self.remote.url, exc)
                time.sleep(1.0)

    def _next_job(self) -> tuple[str, set[int]] | None:
        """Block until there is something to do: ``("round", due steps)``: the steps saved since the last
        failure, each tried once as it comes (the newest first), with the failed ones once the remote's backoff
        has passed; ``("defer", ...)``: the waiting steps are resolved as failed without a try (closing while the
        remote fails, or the remote belongs to another run); ``("probe", ...)``: the remote failed and nothing is
        owed to it: list it once its backoff has passed, so that its recovery is seen. None once closed."""
        with self._cond:
            while not self._closed:
                down = self.state.down()
                if down:
                    self.state.summary(set(self._waiting) | self._failed_steps)
                due = down and self.state.due()
                if self._waiting and (self._conflict is not None or (down and self._closing)):
                    return "defer", set()
                if self._closing:  # failed steps stay for the next start or `tierckpt sync`
                    if self._waiting:
                        return "round", set(self._waiting)
                elif self._conflict is None and (self._waiting or (due and self._failed_steps)):
                    return "round", set(self._waiting) | (self._failed_steps if due else set())
                elif self._conflict is None and due:
                    return "probe", set()
                wake = self.state.wait_s() if down and not self._closing else None
                self._cond.wait(None if wake is None else min(max(0.01, wake), self.state.summary_s))
            return None

    def _round(self, due: set[int]) -> None:
        """One decision of the leader (or of a single-process job's replicator), carried out."""
        if not self._claimed and not self._check_claim(max(due)):
            self._defer()  # the run identity could not be checked: these steps wait for the next try
            return
        step, dropped, deletes = self._decide(due)
        seq = None
        try:
            if self._channel is not None:
                seq = self._publish({"step": step, "drop": [[s, why] for s, _w, why in dropped], "delete": deletes})
            self._delete_local(deletes)  # first: wait() returns with the local tier within its bound
            for s, waiters, why in dropped:
                self._resolve(s, waiters, skipped=why)
        except BaseException:
            with self._cond:
                self._current = None  # the step stays waiting or due; retention may consider it again
                self._cond.notify_all()
            raise
        if step is not None:
            self._attempt(step, seq)

    def _check_claim(self, step: int) -> bool:
        """Run ``claim()`` before the first upload (shown as the upload of ``step``): True once the remote is this
        run's. A conflict stops every upload (kept, raised once, shown by health()); a storage failure counts as a
        failed attempt."""
        assert self._claim is not None
        with self._cond:
            self._current = step
        try:
            self._claim()
        except RunConflictError as exc:
            with self._cond:
                self._conflict = exc
                self._errors.append((None, exc))
            log.error("tier remote: %s", exc)
            return False
        except Exception as exc:
            self.state.attempt_failed(exc, "checking the run identity")
            return False
        finally:
            with self._cond:
                self._current = None
                self._cond.notify_all()
        with self._cond:
            self._claimed = True
        return True

    def _defer(self) -> None:
        """Resolve the waiting steps as failed without trying them: the remote is failing (they are tried with
        the failed steps once its backoff has passed) or belongs to another run."""
        with self._cond:
            popped, self._waiting = self._waiting, {}
            conflict = self._conflict
            if conflict is None:
                self._failed_steps |= set(popped)
            last = self.state.fields()["last_error"]
        if not popped:
            return
        errors = {s: conflict or UploadError(
            f"not uploaded: the remote is failing (last error: {last}); the local copy is kept and the upload is "
            f"retried once the remote answers (or by `tierckpt sync`)", step=s, tier=self.remote.tier,
            path=self.remote.url, transient=True) for s in popped}
        if self._channel is not None:  # the followers fail theirs; every node's local tier stays bounded meanwhile
            deletes = self._owed_deletions()
            self._publish({"step": None, "fail": [[s, str(e)] for s, e in errors.items()], "delete": deletes})
            self._delete_local(deletes)
        else:  # as after a failed try: wait() returns with the local tier within its bound
            self.apply_local_retention()
        log.debug("tier remote: %d steps not tried while %s fails: %s", len(popped), self.remote.url, sorted(popped))
        for s, waiters in popped.items():
            self._fail_waiters(s, waiters, errors[s], keep=conflict is None)
        if conflict is not None and popped:
            with self._cond:
                if not any(e is conflict for _s, e in self._errors):
                    self._errors.append((None, conflict))

    def _probe(self) -> None:
        """The remote failed and nothing waits for it: list it, so that health() and the listings see it back."""
        if self._list_remote(resume=False, counts=True):
            self._recovered()

    def _publish(self, decision: dict[str, Any]) -> int:
        """Leader: publish ``decision``; returns its number."""
        assert self._channel is not None
        with self._cond:
            seq, self._seq = self._seq, self._seq + 1
            remote = self._remote_steps
        decision["remote_newest"] = max(remote) if remote else None
        self._channel.publish(seq, decision)
        return seq

    def _local_steps(self) -> set[int]:
        try:
            return set(list_root(self.local).steps)
        except OSError as exc:
            log.warning("tier local: cannot list %s: %s", self.local.url, exc)
            with self._cond:
                return set(self._committed_at)

    def _list_remote(self, *, resume: bool, counts: bool | None = None) -> bool:
        """List the remote's committed steps (bounded by ``list_deadline_s``). ``counts``: whether a failure
        counts as a failed attempt of the remote (the start-up listing and probes; default: ``resume``) or only as
        a failed request (the listing after an upload: uploads work, so the remote is not down)."""
        counts = resume if counts is None else counts
        try:
            steps = set(with_deadline(lambda: list_root(self.remote).steps, deadline_s=self._list_deadline_s,
                                      diagnose=self.remote.diagnose,
                                      what="list", tier=self.remote.tier, url=self.remote.url))
        except Exception as exc:
            if counts:
                self.state.attempt_failed(exc, "listing")
            else:
                self.state.request_failed(exc)
                log.warning("tier remote: cannot list %s (%s); uploads go on", self.remote.url, exc)
            if resume:
                self._sort_resumed(set())
            return False
        try:
            local = set(list_root(self.local).steps)
        except OSError:
            local = set(self._committed_at)
        with self._cond:
            steps = self._listed(steps)
            self._replicated |= steps & local  # every local step the remote holds, resumed or not
        if resume:
            self.state.succeeded()
            self._sort_resumed(steps)
        return True

    def _sort_resumed(self, remote: set[int]) -> None:
        """Of the steps found locally at start-up: those the remote holds, or that its retention would delete at
        once (a newer step is durable there), count as replicated; the others are uploaded."""
        done: list[tuple[int, list[Waiter]]] = []
        with self._cond:
            resumed, self._resume = sorted(self._resume), set()
            for s in resumed:
                if s in remote or (remote and s not in self.policy.remote_keeps(remote | {s})):
                    self._replicated.add(s)
                    done.append((s, self._waiting.pop(s, [])))
                elif s in self._waiting:
                    log.info("tier remote: re-queueing upload of step %d (committed locally, missing in %s)", s,
                             self.remote.url)
            listed = self._remote_steps
        if self._channel is not None:
            self._publish({"remote": None if listed is None else remote_summary(listed, self._local_steps()),
                           "remote_count": len(listed or ()), "resumed_done": [s for s, _ in done]})
        if done:
            self.apply_local_retention()  # first: wait() returns with the local tier trimmed
        for s, waiters in done:
            self._resolve(s, waiters)

    def _decide(self, due: set[int]) -> tuple[int | None, list[tuple[int, list[Waiter], str]], list[list[Any]]]:
        """The step to upload now among ``due``, the steps dropped (with their waiters and why), and (multi-rank:
        the leader decides for every node) the unreplicated local steps to delete. The step chosen becomes the
        one being uploaded before local retention can run again: retention skips it, so the upload never reads a
        step deleted under it."""
        with self._retention_lock:
            local = self._local_steps() or set(due)
            with self._cond:
                remote = set(self._remote_steps or ())
                replicated = set(self._replicated)
                fenced = due & self._fenced
            plan = self.policy.plan_uploads(due - fenced, remote=remote, local=local)
            deletes = self._owed_deletions(local, replicated, remote, keep=plan.next)
            with self._cond:
                dropped = []
                for s, why in [*plan.dropped, *((s, "set aside by a rollback") for s in sorted(fenced))]:
                    self._failed_steps.discard(s)
                    dropped.append((s, self._waiting.pop(s, []), why))
                if plan.next is not None:
                    self._failed_steps.discard(plan.next)
                    self._current = plan.next
        return plan.next, dropped, deletes

    def _owed_deletions(self, local: set[int] | None = None, replicated: set[int] | None = None,
                        remote: set[int] | None = None, *, keep: int | None = None) -> list[list[Any]]:
        """Multi-rank leader: the unreplicated local steps the policy gives up on (past the backlog, superseded),
        which every node deletes when the decision says so; none in one process (its retention does it)."""
        if self._channel is None:
            return []
        if local is None:
            local = self._local_steps()
        with self._cond:
            replicated = set(self._replicated) if replicated is None else replicated
            remote = set(self._remote_steps or ()) if remote is None else remote
        return [[s, why] for s, why in self.policy.local_deletions(local, replicated=replicated, remote=remote)
                if why != REPLICATED and s != keep]

    def _attempt(self, step: int, seq: int | None = None) -> None:
        """Upload ``step`` (``seq``: the leader's decision it carries out, which names the attempt for every
        rank of a multi-rank job)."""
        cancel = threading.Event()
        with self._cond:
            waiters = self._waiting.pop(step, [])
            self._current = step
            self._cancel = cancel
        try:
            if step in self._fenced:
                raise UploadError("cancelled: set aside by a rollback", step=step, tier=self.remote.tier,
                                  path=self.remote.url, transient=False)
            if seq is None:
                self._upload(step, cancel=cancel)
            else:
                self._upload(step, attempt=f"a{seq}", cancel=cancel)
        except BaseException as exc:
            self._failed(step, waiters, exc, fenced=cancel.is_set())
            return
        with self._cond:
            self._current, self._cancel = None, None
            self._cond.notify_all()
            self._replicated.add(step)
            self._forget_errors(step)
            waiters += self._waiting.pop(step, [])  # submitted while the upload ran (a follower's late commit)
            if self._follower and not waiters:
                self._outcomes[step] = ("uploaded", None)
            if self._remote_steps is not None:
                self._remote_steps.add(step)
        self._recovered()
        self._apply_remote_retention()
        self.apply_local_retention()
        if self._remote_steps is None and not self._follower:
            self._list_remote(resume=False)
        self._resolve(step, waiters)  # after retention: wait() returns with both tiers trimmed
