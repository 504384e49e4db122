"""Retention across both tiers, as a Hypothesis state machine: saves (step numbers always increasing), a remote that
goes down and comes back, waits for the uploads, restarts, and ``tierckpt prune`` on the local tier between
restarts, in any order, with any ``keep_local``/``keep_remote`` (1..3), ``keep_every`` (None, 2..4) and
``max_upload_backlog`` (0..2).

After every rule the real folders are read back (``list_root``) and checked:

1. the newest step saved (every save reaches the local tier here) is committed in some tier, in fact in the local
   one (retention never deletes a tier's newest step, ``prune`` neither), and no tier holds a step never saved;
2. after a ``wait()`` that follows a successful upload with the remote up (so every failed step was retried: see
   below), each tier holds at most what its policy says: the local tier its newest ``keep_local`` steps at most,
   the remote only steps its retention keeps (newest ``keep_remote`` + ``keep_every`` milestones), the newest among
   them; and ``wait()`` re-raises each upload error once only (a second call returns);
3. once the manager is idle, the local tier holds at most ``keep_local + max_upload_backlog`` committed steps;
4. a restart (and a restore in a live manager) restores the newest saved step, with its values (the state encodes
   the step number), never an older one, never None once a step was saved;
5. ``tierckpt verify`` passes on each tier (every step it lists as committed verifies).

The remote is a local folder whose store the manager gets wrapped in a :class:`FaultyStore` from construction on
(``open_store`` is patched in :mod:`tierckpt.manager`, so that a restarted manager's resumed uploads see the same
outage deterministically; the tests that swap ``mgr.remote`` after construction race with that start-up). "Down"
makes every write-side operation fail with a permanent ``PermissionError`` (no in-upload retries): listings and
reads still work, as with a bucket whose writes are denied. The replicator's retry backoff is raised to an hour
(the policy object the manager builds is patched; retention decisions are untouched) so that no failed upload is
retried behind the test's back: failed steps are retried only when an upload succeeds again or at a restart,
both of which the model tracks. Checks that need an idle manager (3, 2) run only after a ``wait()``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tierckpt.manager as manager_mod
from tests._support.remote import RemoteSwitch, wrap_remote_stores
from tierckpt import CheckpointManager, UploadError, cli
from tierckpt.replication import ReplicationPolicy
from tierckpt.retention import KeepPolicy
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(300)

N = 100
EXIT_UNAVAILABLE = 3


def _state(step: int) -> dict:
    return {"w": torch.arange(N, dtype=torch.float32) + 1000.0 * step, "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(N), "step": -1}


_CURRENT: list[RemoteSwitch] = []  # the running example's switch (the patched open_store finds it here)


def _steps(path: Path, tier: str) -> list[int]:
    if not path.exists():
        return []
    return sorted(list_root(LocalStore(path, tier=tier, create=False)).steps)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(list(argv))
    return rc, out.getvalue()


class TwoTierRetention(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierckpt-retention-sm-"))
        self.local_dir, self.remote_dir = self.dir / "local", self.dir / "remote"
        self.switch = RemoteSwitch()
        _CURRENT[:] = [self.switch]
        self.mgr: CheckpointManager | None = None
        self.saved: list[int] = []  # every step saved, in order (each reached the local tier)
        self.quiet = True  # the manager is idle: nothing in flight, nothing waiting (retries are an hour away)
        self.synced = False  # every upload the model owes has succeeded (checked by invariant 2)
        self.owed_retry = False  # some upload may have failed and waits for a retry
        self.kicked = False  # since the remote came up, something starts the retries (a save, a restart)

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def newest(self) -> int | None:
        return self.saved[-1] if self.saved else None

    def _open(self) -> CheckpointManager:
        return CheckpointManager(self.local_dir, remote=str(self.remote_dir), **self.opts, remote_timeout_s=2.0,
                                 writer_threads=1, upload_threads=1, pin_memory=False)

    def _policy(self) -> ReplicationPolicy:
        o = self.opts
        return ReplicationPolicy(keep_local=o["keep_local"], keep_remote=o["keep_remote"],
                                 keep_every=o["keep_every"], max_backlog=o["max_upload_backlog"])

    def _up(self) -> bool:
        return not self.switch.down

    def _restore_check(self, mgr: CheckpointManager) -> None:
        state = _empty()
        got = mgr.restore(state)
        assert got == self.newest, f"restore gave step {got}, the newest saved is {self.newest}"
        if got is not None:
            torch.testing.assert_close(state["w"], _state(got)["w"], rtol=0, atol=0)
            assert state["step"] == got

    def _wait(self) -> None:
        """``mgr.wait()``: it may re-raise upload errors (once each); a second call then returns."""
        assert self.mgr is not None
        try:
            self.mgr.wait(timeout=60)
        except UploadError:
            self.owed_retry = True
        self.mgr.wait(timeout=60)  # every error was taken by the first call: nothing is left to raise
        self.quiet = True
        if self._up() and (self.kicked or not self.owed_retry):
            self.owed_retry = False
            self.synced = True

    # ------------------------------------------------------------------------------------------------ rules
    @initialize(keep_local=st.integers(1, 3), keep_remote=st.integers(1, 3),
                keep_every=st.none() | st.integers(2, 4), backlog=st.integers(0, 2))
    def start(self, keep_local: int, keep_remote: int, keep_every: int | None, backlog: int) -> None:
        self.opts = dict(keep_local=keep_local, keep_remote=keep_remote, keep_every=keep_every,
                         max_upload_backlog=backlog)
        self.mgr = self._open()

    @rule(gaps=st.lists(st.integers(1, 3), min_size=1, max_size=4), settle=st.booleans())
    def save(self, gaps: list[int], settle: bool) -> None:
        """A few saves in a row (uploads of the earlier ones may still run), then, if ``settle``, a wait."""
        assert self.mgr is not None
        for gap in gaps:
            step = (self.newest or 0) + gap
            h = self.mgr.save(step, _state(step))  # never raises for the remote: it costs nothing locally
            h.persisted.result(timeout=60)
            self.saved.append(step)
        self.quiet = self.synced = False
        if self._up():
            self.kicked = True  # its upload succeeds and re-queues every failed step
        else:
            self.owed_retry = True
        if settle:
            self._wait()

    @rule()
    def wait(self) -> None:
        self._wait()

    @precondition(lambda self: not self.switch.down)
    @rule()
    def remote_fails(self) -> None:
        self.switch.set(True)
        self.owed_retry = True  # conservatively: an upload in flight may fail now
        self.kicked = self.synced = False

    @precondition(lambda self: self.switch.down)
    @rule()
    def remote_recovers(self) -> None:
        self.switch.set(False)
        self.kicked = False  # failed steps wait for their (hour-long) backoff until an upload succeeds

    @rule()
    def restore_live(self) -> None:
        assert self.mgr is not None
        self._restore_check(self.mgr)

    @precondition(lambda self: self.quiet)
    @rule(keep=st.integers(1, 3))
    def prune_refused_while_live(self, keep: int) -> None:
        before = _steps(self.local_dir, "local")
        rc, _ = _cli("prune", str(self.local_dir), "--keep", str(keep))
        assert rc == EXIT_UNAVAILABLE, f"prune on a live manager's local tier exited {rc}, not {EXIT_UNAVAILABLE}"
        assert _steps(self.local_dir, "local") == before, "a refused prune deleted steps"

    @rule(prune=st.none() | st.integers(1, 3))
    def restart(self, prune: int | None) -> None:
        assert self.mgr is not None
        mgr, self.mgr = self.mgr, None
        try:
            mgr.close(timeout=60)
        except UploadError:
            self.owed_retry = True
        if prune is not None:
            before = _steps(self.local_dir, "local")
            rc, _ = _cli("prune", str(self.local_dir), "--keep", str(prune))
            after = _steps(self.local_dir, "local")
            if before:
                assert rc == 0, f"prune --keep {prune} exited {rc}"
                assert after == before[-prune:], f"prune --keep {prune} left {after} of {before}"
            else:
                assert rc == 2 and after == []
        self.mgr = self._open()
        self.quiet = self.synced = False
        self.kicked = self._up()  # the new manager re-queues every local step the remote lacks
        self._restore_check(self.mgr)

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                with contextlib.suppress(UploadError):
                    self.mgr.close(timeout=60)
        finally:
            _CURRENT.clear()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ invariants
    @invariant()
    def newest_is_committed_somewhere(self) -> None:  # 1
        local, remote = _steps(self.local_dir, "local"), _steps(self.remote_dir, "remote")
        assert set(local) | set(remote) <= set(self.saved), f"tiers hold steps never saved: {local} {remote}"
        if self.newest is not None:
            assert self.newest in set(local) | set(remote), \
                f"newest step {self.newest} committed in no tier (local {local}, remote {remote})"
            assert self.newest in local, f"newest step {self.newest} deleted from the local tier ({local})"

    @invariant()
    def idle_local_tier_is_bounded(self) -> None:  # 3
        if not self.quiet or self.mgr is None:
            return
        local = _steps(self.local_dir, "local")
        bound = self.opts["keep_local"] + self.opts["max_upload_backlog"]
        assert len(local) <= bound, \
            f"idle local tier holds {local}: more than keep_local + max_upload_backlog = {bound}"

    @invariant()
    def synced_tiers_hold_their_policy(self) -> None:  # 2
        if not self.synced:
            return
        local, remote = _steps(self.local_dir, "local"), _steps(self.remote_dir, "remote")
        assert len(local) <= self.opts["keep_local"], f"every upload done, yet the local tier holds {local}"
        keeps = KeepPolicy(keep_last=self.opts["keep_remote"], keep_every=self.opts["keep_every"])
        assert not keeps.to_delete(remote), f"remote {remote} holds steps its retention deletes {self.opts}"
        assert self._policy().remote_keeps(remote) == set(remote)
        if self.newest is not None:
            assert remote and remote[-1] == self.newest, f"every upload done, yet the remote holds {remote}"

    @invariant()
    def every_committed_step_verifies(self) -> None:  # 5
        for path, tier in ((self.local_dir, "local"), (self.remote_dir, "remote")):
            if not _steps(path, tier):
                continue
            rc, out = _cli("verify", str(path), "--json")
            doc = json.loads(out)
            bad = [r for r in doc["steps"] if not r["ok"]]
            assert rc == 0 and not bad, f"tierckpt verify {tier}: exit {rc}, failed steps {bad}"


@pytest.fixture
def patched_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    wrap_remote_stores(monkeypatch, _CURRENT)
    monkeypatch.setattr(manager_mod, "ReplicationPolicy",
                        functools.partial(ReplicationPolicy, retry_initial_s=3600.0, retry_max_s=3600.0))


def test_retention_across_tiers_state_machine(patched_manager: None) -> None:
    run_state_machine_as_test(TwoTierRetention,
                              settings=settings(max_examples=25, stateful_step_count=15, deadline=None))
