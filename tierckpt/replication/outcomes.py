"""How each step's upload ends for whoever waits on it: the handles resolved (uploaded, not uploaded and why, or
failed with the error), the errors kept for ``wait()``/``close()`` while they apply, and a failed step kept for the
retry once the remote answers again (see :mod:`tierckpt.replication.replicator`, whose :class:`Replicator` this
mixin is part of)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFoundError, StepConflictError

log = logging.getLogger(__name__)


@dataclass
class Waiter:
    """One wait on a step's upload: the save's handle (None for a step the component queued itself) and the future
    resolved once the first attempt is over."""

    handle: Any  # SaveHandle | None
    done: Future


class Outcomes:
    """The outcome side of :class:`~tierckpt.replication.replicator.Replicator` (its state is the replicator's):
    resolving the waiters of a step and keeping the errors ``take_errors()`` returns."""

    def _own_waiter(self) -> Waiter:
        w = Waiter(None, Future())
        self._track(w.done)
        return w

    def take_errors(self) -> list[BaseException]:
        """Errors of failed uploads not yet taken, oldest first (each is returned once). An error whose step has
        been uploaded since, or is no longer owed to the remote (superseded by a durable newer step, set aside by
        a rollback), no longer applies and is not returned."""
        with self._cond:
            out, self._errors = [e for _s, e in self._errors], []
        return out

    def _recovered(self) -> None:
        """The remote answered: end the streak and catch the failed steps up now (``wait()`` covers them)."""
        self.state.succeeded()
        with self._cond:
            if self._follower or self._closing or not self._failed_steps:
                return
            for s in sorted(self._failed_steps):
                self._waiting.setdefault(s, []).append(self._own_waiter())
            log.info("tier remote: retrying the uploads of steps %s, which failed or waited earlier",
                     sorted(self._failed_steps))
            self._failed_steps = set()
            self._cond.notify_all()

    def _failed(self, step: int, waiters: list[Waiter], exc: BaseException, *, fenced: bool = False) -> None:
        gone = isinstance(exc, CheckpointNotFoundError) and exc.tier == self.local.tier
        permanent = gone or fenced or isinstance(exc, StepConflictError)
        if not fenced and not permanent:  # a missing local step or another save's remote step: the remote answered
            self.state.attempt_failed(exc, f"the upload of step {step}")
        with self._cond:
            self._current, self._cancel = None, None
            self._cond.notify_all()
            waiters = waiters + self._waiting.pop(step, [])  # submitted while the upload ran
            if self._follower and not waiters:
                self._outcomes[step] = ("failed", exc)
            if not permanent and not self._follower and not self._closed:
                self._failed_steps.add(step)
        if fenced:
            self._resolve(step, waiters, skipped="set aside by a rollback")
            return
        if permanent:
            log.error("step %d, tier remote: not uploaded to %s (the local copy is kept): %s", step,
                      self.remote.url, exc)
        # a step committed while this upload ran was kept as the one being uploaded: trim to the bound now, so
        # that wait() returns with the local tier within keep_local + max_upload_backlog
        self.apply_local_retention()
        self._fail_waiters(step, waiters, exc)
        if not self._follower and not permanent:
            self._defer()  # the steps that waited meanwhile are not tried back to back: see _next_job

    def _forget_errors(self, step: int) -> None:
        """Under the lock: ``step``'s errors no longer apply (uploaded, or no longer owed to the remote)."""
        self._errors = [(s, e) for s, e in self._errors if s != step]

    def _fail_waiters(self, step: int, waiters: list[Waiter], exc: BaseException, *, keep: bool = True) -> None:
        if waiters and keep:
            with self._cond:
                self._forget_errors(step)  # the newest error of a step stands for it
                self._errors.append((step, exc))
        for w in waiters:
            if w.handle is not None:
                w.handle._record.error = str(exc)
                if not w.handle.uploaded.done():
                    w.handle.uploaded.set_exception(exc)
                self._on_done(w.handle)
            w.done.set_result(None)

    def _resolve(self, step: int, waiters: list[Waiter], *, skipped: str | None = None) -> None:
        if skipped is not None:
            log.info("step %d, tier remote: not uploading it: %s", step, skipped)
            if not skipped.startswith("deleted"):  # superseded, or set aside: its earlier error no longer applies
                with self._cond:
                    self._forget_errors(step)
        for w in waiters:
            h = w.handle
            if h is not None and not h.uploaded.done():
                if skipped is None:
                    h._record.upload_s = h.elapsed()
                    h.uploaded.set_result(h._record.upload_s)
                else:
                    h._record.upload_skipped = skipped
                    h.uploaded.set_result(None)
                self._on_done(h)
            w.done.set_result(None)
