"""A multi-rank job's follower replicators: every rank but rank 0 applies the leader's replication decisions, in
order, and decides nothing by itself (see :mod:`tierckpt.replication.replicator`, whose :class:`Replicator` this
mixin is part of)."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import UploadError

log = logging.getLogger(__name__)


class Follower:
    """The follower's side of :class:`~tierckpt.replication.replicator.Replicator` (its state is the
    replicator's): the thread's loop over the leader's decisions and how each is applied."""

    def _follow(self) -> None:
        """A follower's thread: apply the leader's decisions in order until the component closes."""
        assert self._channel is not None
        while True:
            decision = None
            while decision is None:
                with self._cond:
                    if self._closed:
                        return
                    seq = self._seq
                decision = self._channel.receive(seq, 0.5)
            with self._cond:
                self._seq += 1
            try:
                self._apply(decision, seq)
            except Exception as exc:  # a bug: logged, and the next decision is applied
                log.exception("tier remote: applying replication decision %d failed: %s", seq, exc)

    def _apply(self, d: dict[str, Any], seq: int) -> None:
        """A follower applies one decision of the leader (see :meth:`_run` and :meth:`_sort_resumed`)."""
        if "resumed_done" in d:  # the start-up decision: what the remote holds, which resumed steps are done
            remote = None if d.get("remote") is None else set(d["remote"])
            local = self._local_steps()
            with self._cond:
                if remote is not None:
                    self._replicated |= self._listed(remote) & local
                done = [(s, self._waiting.pop(s, [])) for s in d["resumed_done"]]
                self._replicated |= {s for s, _ in done}
            for s, waiters in done:
                self._resolve(s, waiters)
            self.apply_local_retention()
            return
        with self._cond:
            if d.get("remote_newest") is not None:
                self._listed((self._remote_steps or set()) | {d["remote_newest"]})
            dropped, failed = [], []
            for s, why in d.get("drop", []):
                waiters = self._waiting.pop(s, [])
                if not waiters:
                    self._outcomes[s] = ("dropped", why)
                dropped.append((s, waiters, why))
            for s, msg in d.get("fail", []):
                err = UploadError(msg, step=s, tier=self.remote.tier, path=self.remote.url, transient=True)
                waiters = self._waiting.pop(s, [])
                if not waiters:
                    self._outcomes[s] = ("failed", err)
                failed.append((s, waiters, err))
        # the deletions first, as on the leader: wait() returns with this node's local tier within its bound
        self._delete_local([(s, why) for s, why in d.get("delete", [])])
        for s, waiters, why in dropped:
            self._resolve(s, waiters, skipped=why)
        for s, waiters, err in failed:
            self._fail_waiters(s, waiters, err)
        if d.get("step") is not None:
            self._attempt(d["step"], seq)
        self._trim_outcomes()

    def _trim_outcomes(self, keep: int = 1024) -> None:
        with self._cond:
            for s in sorted(self._outcomes)[:-keep]:
                del self._outcomes[s]
