"""The replication component on its own: its policy's decisions (pure), and the Replicator driven with real stores,
a stand-in upload function that fails on demand, and an injected clock for the retry backoff."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._support.steps import build_step, write_step
from tierckpt.errors import StorageUnavailableError, UploadError
from tierckpt.replication import ReplicationPolicy, Replicator
from tierckpt.replication.policy import OVER_BACKLOG, REPLICATED, SUPERSEDED
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------------ the policy
def test_plan_newest_first_and_drops_superseded_and_deleted() -> None:
    p = ReplicationPolicy(keep_local=2, keep_remote=2)
    plan = p.plan_uploads({2, 3, 4, 5, 6, 7, 8}, remote={1}, local={7, 8})
    assert plan.next == 8
    assert {s for s, _ in plan.dropped} == {2, 3, 4, 5, 6}
    assert all("deleted" in why for s, why in plan.dropped)
    plan = p.plan_uploads({5, 6, 7, 8}, remote={1}, local={5, 6, 7, 8})
    assert plan.next == 8 and dict(plan.dropped) == {5: "superseded by step 8", 6: "superseded by step 8"}
    assert p.plan_uploads(set(), remote={1}, local={1}).next is None


def test_plan_keeps_milestones_and_everything_without_remote_retention() -> None:
    p = ReplicationPolicy(keep_local=1, keep_remote=1, keep_every=4)
    plan = p.plan_uploads({3, 4, 5}, remote=set(), local={3, 4, 5})
    assert plan.next == 5 and dict(plan.dropped).keys() == {3}
    plan = ReplicationPolicy(keep_local=1).plan_uploads({3, 4, 5}, remote=set(), local={3, 4, 5})
    assert plan.next == 5 and not plan.dropped


def test_local_deletions_reasons() -> None:
    p = ReplicationPolicy(keep_local=2, keep_every=4, max_backlog=2)
    out = dict(p.local_deletions(range(1, 9), replicated=set()))
    assert out == {1: OVER_BACKLOG, 2: OVER_BACKLOG, 3: OVER_BACKLOG, 5: OVER_BACKLOG}  # keeps 4 (milestone), 6
    out = dict(p.local_deletions(range(1, 9), replicated={1, 2, 3, 4, 5, 6}))
    assert out == {s: REPLICATED for s in range(1, 7)}
    q = ReplicationPolicy(keep_local=2, keep_remote=2)
    assert dict(q.local_deletions([1, 2, 3, 4], replicated=set(), remote={9})) == {1: SUPERSEDED, 2: SUPERSEDED}
    assert dict(ReplicationPolicy(keep_local=1).local_deletions([1, 2, 3], replicated=None)) == {1: REPLICATED,
                                                                                                 2: REPLICATED}


def test_retry_delay_doubles_and_is_capped() -> None:
    p = ReplicationPolicy(retry_initial_s=2.0, retry_max_s=10.0)
    assert [p.retry_delay(n) for n in (1, 2, 3, 4, 10)] == [2.0, 4.0, 8.0, 10.0, 10.0]


def test_policy_validates() -> None:
    with pytest.raises(ValueError, match="max_upload_backlog"):
        ReplicationPolicy(max_backlog=-1)
    with pytest.raises(ValueError, match="keep_last"):
        ReplicationPolicy(keep_local=0)


@settings(max_examples=200, deadline=None)
@given(local=st.sets(st.integers(0, 60), max_size=25), replicated_share=st.sets(st.integers(0, 60)),
       keep_local=st.integers(1, 4), keep_remote=st.one_of(st.none(), st.integers(1, 4)),
       keep_every=st.one_of(st.none(), st.integers(2, 10)), backlog=st.integers(0, 3))
def test_local_deletions_are_bounded_and_never_the_newest(local, replicated_share, keep_local, keep_remote,
                                                          keep_every, backlog) -> None:
    p = ReplicationPolicy(keep_local=keep_local, keep_remote=keep_remote, keep_every=keep_every, max_backlog=backlog)
    replicated = replicated_share & local
    gone = {s for s, _ in p.local_deletions(local, replicated=replicated)}
    left = local - gone
    assert set(sorted(local)[-keep_local:]) <= left
    assert len(left) <= keep_local + backlog
    assert all(why == REPLICATED for s, why in p.local_deletions(local, replicated=local))


# ------------------------------------------------------------------------------------------------ the component
class _Remote:
    """The upload function: copies a step's manifest name into a set, or fails while ``down`` is set."""

    def __init__(self, remote: LocalStore, local: LocalStore) -> None:
        self.remote, self.local = remote, local
        self.down = threading.Event()
        self.order: list[int] = []

    def upload(self, step: int, **_kw) -> None:
        if self.down.is_set():
            raise UploadError("remote down", step=step, tier="remote", path=self.remote.url)
        from tierckpt.tiers.uploader import replicate_step

        replicate_step(self.local, self.remote, step)
        self.order.append(step)


def _stores(tmp_path: Path, steps: list[int]) -> tuple[LocalStore, LocalStore]:
    local = LocalStore(tmp_path / "local")
    for s in steps:
        write_step(local, build_step(s))
    return local, LocalStore(tmp_path / "remote", tier="remote")


def _wait_for(cond, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_replicator_resumes_newest_first_and_trims_the_local_tier(tmp_path: Path) -> None:
    local, remote = _stores(tmp_path, [1, 2, 3])
    fake = _Remote(remote, local)
    done: list = []
    rep = Replicator(local, remote, policy=ReplicationPolicy(keep_local=1), upload=fake.upload, resume=[1, 2, 3],
                     on_done=done.append, track=done.append)
    rep.start()
    _wait_for(lambda: len(fake.order) == 3)
    assert fake.order == [3, 2, 1]
    _wait_for(lambda: sorted(list_root(local).steps) == [3])
    h = rep.health()
    assert h.ok and h.remote_step == 3 and h.upload_lag_steps == 0 and h.remote_listed
    rep.close(5)


def test_local_retention_never_deletes_the_step_chosen_for_upload(tmp_path: Path) -> None:
    """The upload thread has chosen step 1 and not yet started on it when step 2 commits and local retention runs
    (keep_local=1, no backlog allowed): retention waits for the choice and then skips step 1, whose upload
    succeeds; step 1 leaves the local tier once the remote holds it. Before, retention could delete step 1 in
    that window and its upload failed reading a step that was gone."""
    local, remote = _stores(tmp_path, [1])
    fake = _Remote(remote, local)
    deciding, go = threading.Event(), threading.Event()

    class PausingPolicy(ReplicationPolicy):
        def plan_uploads(self, due, **kw):  # type: ignore[no-untyped-def]
            plan = super().plan_uploads(due, **kw)
            if plan.next == 1 and not deciding.is_set():
                deciding.set()
                go.wait(10)
            return plan

    rep = Replicator(local, remote, policy=PausingPolicy(keep_local=1, max_backlog=0), upload=fake.upload,
                     resume=[], on_done=lambda h: None)
    rep.start()
    first = rep.submit(1)
    assert deciding.wait(10)
    write_step(local, build_step(2))
    retention = threading.Thread(target=rep.apply_local_retention)  # as the persist thread runs it on a commit
    retention.start()
    retention.join(0.5)
    assert 1 in list_root(local).steps  # not deleted while the upload thread was choosing it
    go.set()
    retention.join(10)
    first.result(timeout=20)
    rep.submit(2).result(timeout=20)
    assert rep.take_errors() == [] and fake.order == [1, 2]
    assert {1, 2} <= set(list_root(remote).steps)
    _wait_for(lambda: sorted(list_root(local).steps) == [2])
    rep.close(5)


def test_replicator_backs_off_on_failures_and_catches_up(tmp_path: Path) -> None:
    local, remote = _stores(tmp_path, [1])
    fake = _Remote(remote, local)
    fake.down.set()
    now = [1000.0]
    rep = Replicator(local, remote, policy=ReplicationPolicy(keep_local=5, retry_initial_s=10, retry_max_s=40),
                     upload=fake.upload, resume=[], on_done=lambda h: None, clock=lambda: now[0])
    rep.start()
    rep.submit(1).result(timeout=10)
    h = rep.health()
    assert h.consecutive_failures == 1 and "remote down" in (h.last_error or "") and rep.failed() == {1}
    errors = rep.take_errors()
    assert len(errors) == 1 and isinstance(errors[0], UploadError) and rep.take_errors() == []
    now[0] += 5  # not due yet
    rep.wake()
    time.sleep(0.2)
    assert fake.order == [] and rep.failed() == {1}
    fake.down.clear()
    now[0] += 6  # due: retried without a new save
    rep.wake()
    _wait_for(lambda: fake.order == [1])
    _wait_for(lambda: rep.health().ok and rep.failed() == set())
    rep.close(5)


def test_replicator_lists_the_remote_on_its_thread_and_survives_it_being_down(tmp_path: Path) -> None:
    """A remote whose listing fails: start() returns at once, the failure is in health(), uploads still go on."""
    local, remote = _stores(tmp_path, [1])

    class Unlistable(LocalStore):
        def list(self, rel: str = "") -> list[str]:
            raise StorageUnavailableError("listing refused", tier="remote", path=self.url, transient=True)

    broken = Unlistable(tmp_path / "remote", tier="remote")
    fake = _Remote(remote, local)
    t0 = time.monotonic()
    rep = Replicator(local, broken, policy=ReplicationPolicy(), upload=fake.upload, resume=[1],
                     on_done=lambda h: None, list_deadline_s=0.5)
    rep.start()
    assert time.monotonic() - t0 < 0.5
    _wait_for(lambda: fake.order == [1])
    assert "listing refused" in (rep.health().last_error or "")
    rep.close(5)


class _Decisions:
    """An in-process UploadChannel: the leader's decisions in a dict (the c10d store in a real job)."""

    def __init__(self, leader: bool, shared: dict[int, dict] | None = None) -> None:
        self.leader = leader
        self.shared: dict[int, dict] = {} if shared is None else shared
        self.cond = threading.Condition()

    def follower(self) -> _Decisions:
        other = _Decisions(False, self.shared)
        other.cond = self.cond
        return other

    def publish(self, seq: int, decision: dict) -> None:
        with self.cond:
            self.shared[seq] = decision
            self.cond.notify_all()

    def receive(self, seq: int, timeout_s: float) -> dict | None:
        with self.cond:
            self.cond.wait_for(lambda: seq in self.shared, timeout_s)
            return self.shared.get(seq)


@pytest.mark.parametrize("fails", [False, True], ids=["uploaded", "failed"])
def test_follower_step_committed_while_its_upload_runs_resolves(tmp_path: Path, fails: bool) -> None:
    """A follower's own commit of a step can come after the leader's decision to upload it, while the follower
    already uploads its shard: the handle of that late submit() still resolves (it used to wait forever)."""
    leader_ch = _Decisions(True)
    follower_ch = leader_ch.follower()
    llocal, lremote = _stores(tmp_path / "r0", [1])
    flocal, fremote = _stores(tmp_path / "r1", [1])
    started, release = threading.Event(), threading.Event()

    def follower_upload(step: int, attempt: str = "", **_kw) -> None:
        started.set()
        assert release.wait(20)
        if fails:
            raise UploadError("remote down", step=step, tier="remote", path=fremote.url)

    leader = Replicator(llocal, lremote, policy=ReplicationPolicy(keep_local=2), resume=[],
                        upload=lambda step, attempt="", **_kw: None, on_done=lambda h: None, channel=leader_ch,
                        list_deadline_s=2)
    follower = Replicator(flocal, fremote, policy=ReplicationPolicy(keep_local=2), resume=[],
                          upload=follower_upload, on_done=lambda h: None, channel=follower_ch, list_deadline_s=2)
    leader.start()
    follower.start()
    leader.submit(1).result(timeout=20)
    assert started.wait(20)  # the follower uploads step 1 before its own submit(1)
    late = follower.submit(1)
    release.set()
    late.result(timeout=20)
    assert follower.waiting() == set()
    assert len(follower.take_errors()) == (1 if fails else 0)
    leader.close(5)
    follower.close(5)
