"""The agreement layer's bounds, exercised by many ranks as threads over one in-process c10d store: every request
batched, every answer common unless it differs, no key left behind on success or failure, store failures as
AgreementError, no value over the bound, and per-rank bytes that do not grow with the world size or the steps the
remote holds (the restore plan)."""

from __future__ import annotations

import datetime
import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from tierckpt import store_client
from tierckpt.distributed import AgreementError, Coordinator, Split
from tierckpt.engine import sharded
from tierckpt.engine.restore_plan import RestorePlan
from tierckpt.errors import CheckpointError
from tierckpt.format.manifest import RankRef, StepManifest
from tierckpt.store_client import BATCH_BYTES, BATCH_KEYS, MAX_VALUE_BYTES, StoreOps, StoreTraffic, Traffic, batches
from tierckpt.tiers.listing import TierListings

TIMEOUT_S = 0.5


def run_ranks(world: int, body: Callable[[int, Coordinator], Any], *, store: Any = None, skip: set[int] = frozenset(),
              timeout_s: float = 10.0) -> tuple[list[Any], Any, list[Traffic]]:
    """``body(rank, coordinator)`` on ``world`` threads, each rank with its own counted view of one HashStore
    (ranks in ``skip`` never start). Returns each rank's result (or the exception it raised), the store and the
    ranks' traffic."""
    store = dist.HashStore() if store is None else store
    traffic = [Traffic() for _ in range(world)]
    coords: dict[int, Coordinator] = {}

    def rank_main(r: int) -> Any:
        client = StoreTraffic(store, traffic[r], share_connection=True)
        try:
            coords[r] = Coordinator(f"/node{r // 4}", timeout_s=timeout_s, store=client, rank=r, world_size=world)
            return body(r, coords[r])
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(rank_main, [r for r in range(world) if r not in skip]))
    return results, store, traffic


# ------------------------------------------------------------------------------------------------ batching
def test_batches_bound_keys_and_bytes_and_send_a_large_item_alone() -> None:
    small = [("k", 100)] * (BATCH_KEYS * 2 + 3)
    cut = list(batches(small, lambda kv: kv[1]))
    assert all(len(b) <= BATCH_KEYS and sum(v for _, v in b) <= BATCH_BYTES for b in cut)
    assert sum(map(len, cut)) == len(small)
    big = [("a", 10), ("b", BATCH_BYTES * 3), ("c", 10)]
    assert [[k for k, _ in b] for b in batches(big, lambda kv: kv[1])] == [["a"], ["b"], ["c"]]


def test_rank0_reads_inputs_and_writes_own_answers_in_bounded_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_client, "BATCH_KEYS", 16)
    world = 48
    big = "x" * 3000  # 48 answers of 3 KB, each rank's own: more than one 64 KiB batch

    def body(r: int, c: Coordinator) -> Any:
        return c.exchange(r, c.main_lane, lambda objs: [big + str(o) for o in objs], what="echo")

    results, store, traffic = run_ranks(world, body)
    assert results == [big + str(r) for r in range(world)]
    assert max(t.largest for t in traffic) <= BATCH_BYTES + 4096
    # 47 inputs read in batches of 16 keys (start-up and the echo), 141 KB of answers set in 64 KiB batches (the
    # start-up sets none: every node is a block of 4 consecutive ranks, which the common answer says)
    assert traffic[0].by_op["multi_get"] == 2 * 3 and traffic[0].by_op["multi_set"] >= 3
    assert store.num_keys() == world


def test_get_now_reads_a_key_or_none_in_one_request_on_every_store(tmp_path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    for inner in (server, dist.FileStore(str(tmp_path / "store"), 1), dist.HashStore(),
                  dist.PrefixStore("p", dist.HashStore())):
        traffic = Traffic()
        io = StoreOps(StoreTraffic(inner, traffic), 1, what="test")
        assert io.get_now("k") is None and not inner.check(["k"])  # neither waits nor sets it
        inner.set("k", b"v")
        assert io.get_now("k") == b"v" and inner.get("k") == b"v"
        assert traffic.requests == 2, (inner, traffic.by_op)


def test_a_rank_other_than_0_makes_five_requests_an_agreement() -> None:
    world = 4

    def body(r: int, c: Coordinator) -> Any:
        before = c.main_lane.store.traffic.requests
        c.reduce(r, c.main_lane, sum, what="a sum")
        return c.main_lane.store.traffic.requests - before

    results, _, _ = run_ranks(world, body)
    # its input, the wait for the answer, its read, the input's removal, the count of readers (the last reader
    # removes the answer and the count: two more)
    assert all(n in (5, 7) for n in results[1:]), results


# ------------------------------------------------------------------------------------------------ answers and keys
def test_common_answers_are_stored_once_and_no_key_is_left_after_many_agreements() -> None:
    world = 16

    def body(r: int, c: Coordinator) -> Any:
        out = [c.reduce(r, c.main_lane, sum, what="a sum"), c.broadcast(f"from {r}", c.main_lane, what="hello")]
        c.barrier(c.persist_lane, what="barrier")
        out.append(c.exchange(r, c.main_lane, lambda objs: [o % 2 for o in objs], what="parity"))
        out.append(c.exchange(r, c.main_lane, lambda objs: Split("all", {3: "three"}, world_size=len(objs)),
                              what="split"))
        out.append(c.topology.node_ranks)
        return out

    results, store, traffic = run_ranks(world, body)
    for r, got in enumerate(results):
        assert got[:4] == [sum(range(world)), "from 0", r % 2, ("all", "three" if r == 3 else None)]
        assert got[4] == tuple(range(r // 4 * 4, r // 4 * 4 + 4))
    # only each rank's counter of managers created remains: every agreement removed all its keys
    assert store.num_keys() == world
    # a common answer is set once: rank 0 set no per-rank answer for the sum, the broadcast or the barrier
    assert traffic[0].by_op.get("multi_set", 0) <= 3  # start-up, parity, split: one batch each


def test_a_rank_that_never_arrives_is_named_and_leaves_no_key() -> None:
    world = 6

    def body(r: int, c: Coordinator) -> Any:
        c.timeout_s = TIMEOUT_S
        return c.reduce(r, c.main_lane, sum, what="a sum")

    # rank 5 never starts: start-up fails, naming it, on every rank that arrived
    results, store, _ = run_ranks(world, body, skip={5}, timeout_s=TIMEOUT_S)
    assert all(isinstance(e, AgreementError) and e.ranks == [5] and "rank 5 never reached it" in str(e)
               for e in results), results
    assert store.num_keys() == world - 1  # the managers' counters only


def test_a_late_rank_and_a_rank_whose_peer_died_clean_up_after_themselves() -> None:
    world = 4
    gate = threading.Event()

    def body(r: int, c: Coordinator) -> Any:
        c.timeout_s = TIMEOUT_S
        if r == 3:
            gate.wait(5)  # arrives once the others have given up
        try:
            return c.reduce(r, c.main_lane, sum, what="late")
        finally:
            if r == 0:
                gate.set()

    results, store, _ = run_ranks(world, body)
    assert all(isinstance(e, AgreementError) for e in results), results
    assert results[0].ranks == [3]
    assert store.num_keys() == world  # the late rank removed its input

    # rank 0 dies before answering: every other rank's wait runs out, and it removes what it set
    def body0(r: int, c: Coordinator) -> Any:
        c.timeout_s = TIMEOUT_S / 2
        if r == 0:
            return "dead"
        return c.reduce(r, c.main_lane, sum, what="rank 0 dies")

    results, store, _ = run_ranks(world, lambda r, c: body0(r, c))
    assert results[0] == "dead"
    assert all(isinstance(e, AgreementError) and "rank 0 did not answer" in str(e) for e in results[1:])
    assert store.num_keys() == world


def test_a_late_rank_that_finds_the_answer_gone_fails_at_once_and_removes_its_input() -> None:
    """The answer a late rank waited for can be gone when it reads it (the ranks rank 0 counted read it, and the
    last removed it): the late rank fails at once, naming itself, instead of waiting out the store's timeout."""
    world = 3
    answered, waited = threading.Event(), threading.Event()

    class LateRank(StoreTraffic):  # rank 2: its wait returns while the answer is there, its read comes after
        def wait(self, keys: list[str], *timeout: Any) -> None:
            super().wait(keys, *timeout)
            if keys[0].endswith("/answer"):
                waited.set()
                deadline = time.monotonic() + 5
                while self.inner.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.01)

    class OnTimeRank(StoreTraffic):  # rank 1: reads the answer once rank 2's wait returned
        def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
            if key.endswith("/answer"):
                waited.wait(5)
            return super().compare_set(key, expected, desired)

    def body(r: int, c: Coordinator) -> Any:
        c.timeout_s = TIMEOUT_S
        if r > 0:
            c.main_lane.store = (OnTimeRank, LateRank)[r - 1](c.main_lane.store.inner, c.main_lane.store.traffic)
        if r == 2:
            answered.wait(5)  # arrives once rank 0 has answered without it
        try:
            return c.reduce(r, c.main_lane, sum, what="late")
        finally:
            if r == 0:
                answered.set()

    started = time.monotonic()
    results, store, _ = run_ranks(world, body)
    assert results[0].ranks == [2] and results[1].ranks == [2], results
    assert isinstance(results[2], AgreementError) and "after rank 0 gave up on it" in str(results[2]), results
    assert results[2].ranks == [2] and time.monotonic() - started < 5
    assert store.num_keys() == world  # the managers' counters: the late rank removed its input


def test_an_answer_function_that_raises_fails_every_rank_and_leaves_no_key() -> None:
    def body(r: int, c: Coordinator) -> Any:
        return c.reduce(r, c.main_lane, lambda objs: 1 / 0, what="a bug")

    results, store, _ = run_ranks(8, body)
    assert all(isinstance(e, CheckpointError) and "ZeroDivisionError" in str(e) for e in results)
    assert store.num_keys() == 8


def test_no_value_over_the_bound_is_sent() -> None:
    def body(r: int, c: Coordinator) -> Any:
        out = []
        for obj, combine in (("x" * (MAX_VALUE_BYTES + 1) if r == 1 else "", len),
                             ("", lambda objs: "y" * (MAX_VALUE_BYTES + 1))):
            try:
                c.reduce(obj, c.main_lane, combine, what="too big")
            except CheckpointError as exc:
                out.append(str(exc))
        return out

    results, store, traffic = run_ranks(4, body)
    for got in results:
        assert len(got) == 2 and "over the" in got[0] and "exceeds" in got[1], got
    assert max(t.largest for t in traffic) < MAX_VALUE_BYTES
    assert store.num_keys() == 4
    with pytest.raises(ValueError, match="exceeds"):
        StoreOps(dist.HashStore(), 0, what="t").set("k", b"x" * (MAX_VALUE_BYTES + 1))


# ------------------------------------------------------------------------------------------------ store failures
def test_the_store_host_dying_is_an_agreement_error_naming_the_rank_and_the_store() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    port = server.port
    ops = StoreOps(client, 7, what="the step to restore", step=3)
    ops.set("k", b"v")
    del server
    gc.collect()
    time.sleep(0.2)
    with pytest.raises(AgreementError, match=rf"rank 7: the job's store at 127.0.0.1:{port} failed during "
                                             r"(set|get) \(the step to restore\)") as ei:
        ops.set("k2", b"v")
        ops.get("k2")
    assert ei.value.step == 3 and isinstance(ei.value.__cause__, dist.DistError)


# ------------------------------------------------------------------------------------------------ restore plan
class _Tier:
    def __init__(self, tier: str) -> None:
        self.tier, self.url = tier, f"mem://{tier}"


class _Prepared:
    def apply(self) -> None:
        pass

    def release(self) -> None:
        pass


def _restart(world: int, remote_only: int, wiped: set[int], monkeypatch: pytest.MonkeyPatch) -> tuple[
        list[Any], list[Traffic], int]:
    """A restart's agreements (start-up, the restore plan, the manifest shared with the ranks that read from the
    remote, the verdict): each node (4 ranks) holds steps N+1 and N+2 unless ``wiped``; the remote also holds
    steps 1..N. Returns what each rank loaded, each rank's traffic, and the keys left."""
    steps = list(range(1, remote_only + 3))
    full = StepManifest(step=steps[-1], world_size=world, save_id="ab" * 8, total_bytes=1,
                        ranks=tuple(RankRef(r, f"r{r:05d}-{'ab' * 8}.json", 10, "c" * 32) for r in range(world)))
    monkeypatch.setattr(sharded, "read_step", lambda store, step: full)
    monkeypatch.setattr(sharded.sharded, "holds_rank", lambda store, step, rank: True)

    def body(r: int, c: Coordinator) -> Any:
        local = set() if r // 4 in wiped else set(steps[-2:])
        listing = TierListings({"local": local} | ({"remote": set(steps)} if r == 0 else {}), {})
        seen = []

        def load(store: Any, s: int, state: Any, strict: bool, manifest: Any = None) -> _Prepared:
            seen.append((store.tier, s, None if manifest is None else [x.rank for x in manifest.ranks]))
            return _Prepared()

        eng = SimpleNamespace(coord=c, rank=r, peers=None)
        done = sharded.restore(eng, {}, None, [_Tier("local"), _Tier("remote")], strict=True, load=load,
                               listing=listing)
        return done, seen

    results, store, traffic = run_ranks(world, body)
    return results, traffic, store.num_keys() - world


@pytest.mark.parametrize("wiped", ["none", "one node", "all"])
def test_restore_plan_sends_each_rank_the_same_bytes_whatever_the_world_and_the_remote_steps(
        wiped: str, monkeypatch: pytest.MonkeyPatch) -> None:
    per_rank = {}
    for world, remote_only in ((8, 1), (32, 1), (32, 100)):
        nodes = {"none": set(), "one node": {world // 4 - 1}, "all": set(range(world // 4))}[wiped]
        results, traffic, left = _restart(world, remote_only, nodes, monkeypatch)
        assert left == 0
        for r, got in enumerate(results):
            assert not isinstance(got, Exception), got
            done, seen = got
            assert done == remote_only + 2
            if r // 4 in nodes:  # read from the remote, with its own rank reference handed over by rank 0
                assert seen == [("remote", done, [r])]
            else:
                assert seen == [("local", done, None)]
        for reads in (True, False):
            sizes = sorted(t.sent + t.received for r, t in enumerate(traffic) if r and (r // 4 in nodes) == reads)
            if sizes:
                per_rank[(world, remote_only, reads)] = (sizes[0], sizes[-1])  # a rank of no other role; any
    # a rank's bytes depend on its role only (a reader of the remote gets its rank reference; the last to arrive or
    # to read sets or removes a few more keys) and on a few more digits in rank and step numbers: nothing grows
    # with W or with the remote's steps
    for reads in (True, False):
        got = [v for k, v in per_rank.items() if k[2] == reads]
        plain, most = [p[0] for p in got], [p[1] for p in got]
        # the busiest rank: the plain cost and, at most, the last arrival's and the last reader's keys (about
        # 160 bytes) in each of the restart's 6 agreements
        assert not got or (max(plain) - min(plain) <= 32 and max(most) - min(plain) <= 6 * 160), per_rank


def test_the_plan_keeps_the_remote_steps_and_every_ranks_offer_on_rank0() -> None:
    plan = RestorePlan(None, local_first=True, shared={1, 2, 3, 9})
    offers = [{"local": [8, 9]}, {"local": [9]}, {"local": []}]
    common = plan.plan(offers)[0]
    assert common == {"any": True, "next": {"step": 9, "index": 0, "remote": True, "share": True}}
    assert plan.readers(9) == [2] and plan.order == [9, 3, 2, 1]
    verdict = plan.loaded(0, [("ok", ""), ("corrupt", "bad"), ("ok", "")])[0]
    assert verdict["kind"] == "corrupt" and verdict["next"]["step"] == 3 and verdict["ranks"]["ranks"] == [1]
    blocked = RestorePlan(None, local_first=True).plan([{"blocked": True, "error": None}, {"local": [1]}])[0]
    assert blocked["blocked"] == {"ranks": [0], "count": 1}
    missing = RestorePlan(7, local_first=True, shared={5}).plan([{"local": [7]}] + [{"local": []}] * 100)[0]
    assert missing["missing"]["count"] == 100 and len(missing["missing"]["ranks"]) == 64
