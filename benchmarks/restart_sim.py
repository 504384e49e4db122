"""Simulated multi-rank saves and restarts: thousands of ranks running tierckpt's own agreement code against one real
TCPStore (torch's default backend, libuv), to measure what each agreement costs the store and each rank.

Each simulated rank is a thread with its own TCPStore client; it runs the library's
:class:`~tierckpt.distributed.Coordinator` and the manager's multi-rank decision code unchanged: the start-up
agreement, a save's two agreements (:func:`tierckpt.engine.sharded.persist`'s "shards written" and "committed on
every node"), and :func:`tierckpt.engine.sharded.restore` itself (the restore plan, the manifest shared with the ranks
that read from the remote, the verdict on the load). Only storage is simulated: each node's local tier holds the
newest ``--keep-local`` steps, the remote those and ``--remote-only`` older ones, and a load succeeds at once.

Scenarios: ``save``; ``restart_intact`` (every node's local tier intact); ``restart_one_node_wiped`` (one node of 8
ranks replaced: it reads from the remote); ``restart_all_wiped`` (every rank reads from the remote). A restart is a
new coordinator (the start-up agreement), the start-up clean-up barrier, the steps every rank holds, then the restore.
Every rank's thread is started and waiting before a scenario begins, and all are let go at once.

Reported per agreement: its time (first rank in to last rank out), the most bytes and requests any rank but 0 sent
and received, rank 0's, the largest single request, and the store keys left once it is over; per scenario, the CPU
time the store server, rank 0 and the other ranks spent.

    unshare -rn sh -c 'ip link set lo up; python benchmarks/restart_sim.py --worlds 256 1024 2048 8192 \
        --remote-only 1 100 --out restart_sim.json'

What runs where, so that a few thousand threads on a few cores measure the agreements rather than the machine's
scheduler: the store server runs in this process, rank 0 alone in a second one (a real rank 0 has its own host,
and it does O(W) work an agreement), the other ranks ``--ranks-per-process`` threads to a process; the three are
sessions of their own, so that where the kernel groups a session's threads (autogroup scheduling), the thousands
of ranks' threads take a third of the CPU from the store and rank 0 only when those two want it. In a process of
many rank threads, a thread waiting for the interpreter's lock asks for it once a second instead of every 5 ms
(``sys.setswitchinterval``): at 8,192 ranks the default's wake-ups of waiting threads cost more CPU than the
agreements.

torch's TCPStore looks up the peer's name of every connection it opens or accepts (a reverse DNS query for
127.0.0.1 here); where the resolver drops a query now and then, a connection waits 5 s for it. Run it in a network
namespace of its own, as above, where the lookup fails at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

NODE = 8  # ranks per node
SCENARIOS = ("save", "restart_intact", "restart_one_node_wiped", "restart_all_wiped")


class _Tier:
    """A tier as the restore sees it: a name and a URL (its storage is simulated)."""

    def __init__(self, tier: str) -> None:
        self.tier, self.url = tier, f"sim://{tier}"


class _Prepared:
    def apply(self) -> None:
        pass

    def release(self) -> None:
        pass


def _rank_ref(rank: int) -> Any:
    from tierckpt.format import layout
    from tierckpt.format.manifest import RankRef

    return RankRef(rank, layout.rank_manifest_name(rank, "5a1d" * 4), 2300, "c" * 32, (("dp", (rank // NODE,)),
                                                                                         ("tp", (rank % NODE,))))


def _remote_manifest(step: int, world: int) -> Any:
    from tierckpt.format.manifest import StepManifest

    return StepManifest(step=step, world_size=world, save_id="5a1d" * 4, total_bytes=world << 30,
                        ranks=tuple(_rank_ref(r) for r in range(world)), metadata={"note": "x" * 600}, created=1.0)


def _worker(conn: Any, port: int, world: int, ranks: list[int], remote_only: int, keep_local: int,
            timeout_s: float) -> None:
    """One process: ``ranks`` as threads, each with its own store client; runs the phases the parent sends."""
    import torch.distributed as dist

    from tierckpt import manager as manager_module
    from tierckpt.distributed import Coordinator
    from tierckpt.engine import sharded
    from tierckpt.store_client import StoreTraffic, Traffic
    from tierckpt.tiers import sharded as tier_sharded
    from tierckpt.tiers.listing import TierListings

    local_steps = list(range(remote_only + 1, remote_only + keep_local + 1))
    remote_steps = set(range(1, remote_only + keep_local + 1))
    wiped: set[int] = set()
    manifests: dict[int, Any] = {}
    lock = threading.Lock()

    def read_step(_store: Any, step: int) -> Any:  # rank 0's read of the remote's manifest.json
        with lock:
            if step not in manifests:
                manifests[step] = _remote_manifest(step, world)
            return manifests[step]

    sharded.read_step = read_step  # type: ignore[assignment]
    tier_sharded.holds_rank = lambda store, step, rank: True  # type: ignore[assignment]  # a node holds its ranks
    def connect(_rank: int) -> StoreTraffic:
        client = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=timeout_s * 4),
                               wait_for_workers=False)
        return StoreTraffic(client, Traffic(), share_connection=True)

    # A thread waiting for the interpreter's lock wakes every switch interval to ask for it (5 ms by default): with
    # a hundred rank threads a process, such wake-ups would keep the cores busy while the rank holding the lock
    # waits for one. A rank holds it between two store requests only (far under a second), and hands it over as it
    # makes the next one.
    sys.setswitchinterval(1.0)
    pool = ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix="rank")
    clients = dict(zip(ranks, pool.map(connect, ranks)))  # in parallel: a connection may wait on a DNS lookup
    conn.send("ready")

    def timed(rank: int, log: list[Any], name: str, fn: Any) -> Any:
        t = clients[rank].traffic
        before = (t.requests, t.sent + t.received, t.largest)
        t.largest = 0
        t0 = time.time()
        out = fn()
        log.append([name, t0, time.time(), t.requests - before[0], t.sent + t.received - before[1], t.largest])
        t.largest = max(t.largest, before[2])
        return out

    def run_rank(rank: int, scenario: str) -> list[Any]:
        log: list[Any] = []
        node = rank // NODE
        coord = timed(rank, log, "start-up", lambda: Coordinator(
            f"/sim/node{node}", timeout_s=timeout_s, store=clients[rank], rank=rank, world_size=world))
        topo = coord.topology
        exchange = coord.exchange

        def timed_exchange(obj: Any, lane: Any, answer: Any, *, what: str, step: int | None = None) -> Any:
            return timed(rank, log, re.sub(r"\d+", "N", what),
                         lambda: exchange(obj, lane, answer, what=what, step=step))

        coord.exchange = timed_exchange  # type: ignore[method-assign]  # each agreement timed and counted
        if scenario == "save":
            step = remote_only + keep_local + 1
            outcome = {"ref": (rank, f"r{rank:05d}-{'5a1d' * 4}.json", 2300, "c" * 32,
                               (("dp", (node,)), ("tp", (rank % NODE,)))),
                       "bytes": 1 << 30, "node": topo.node_ranks if topo.is_node_leader else None}
            if rank == 0:
                outcome |= {"created": time.time(), "metadata": {"note": "x" * 600}}
            sharded._agree(coord, outcome, sharded._written, step, "shards written")
            sharded._agree(coord, {}, sharded._committed, step, "committed on every node")
            return log
        local = [] if (scenario == "restart_all_wiped" or node in wiped) else local_steps
        coord.barrier(coord.main_lane, what="start-up clean-up")
        coord.reduce(local, coord.main_lane, manager_module._common_steps, what="the steps every rank holds")
        tiers = [_Tier("local"), _Tier("remote")]
        steps = {"local": set(local)} | ({"remote": remote_steps} if rank == 0 else {})
        listing = TierListings(steps, {})
        eng = SimpleNamespace(coord=coord, rank=rank, peers=None)
        seen: list[Any] = []

        def load(store: Any, step: int, state: Any, strict: bool, manifest: Any = None) -> _Prepared:
            seen.append((store.tier, step, None if manifest is None else [r.rank for r in manifest.ranks]))
            return _Prepared()

        done = sharded.restore(eng, {}, None, tiers, strict=True, load=load, listing=listing)  # type: ignore[arg-type]
        want_tier = "local" if local else "remote"
        assert done == max(remote_steps), (rank, done)
        assert seen and seen[-1][0] == want_tier, (rank, seen)
        assert want_tier == "local" or seen[-1][2] == [rank], (rank, seen)  # its own rank reference, shared by rank 0
        return log

    while True:
        msg = conn.recv()
        if msg is None:
            break
        scenario, wiped_nodes = msg
        wiped = set(wiped_nodes)
        go, armed = threading.Event(), threading.Semaphore(0)

        def start(rank: int, scenario: str = scenario, go: threading.Event = go,
                  armed: threading.Semaphore = armed) -> list[Any]:
            armed.release()
            go.wait()
            return run_rank(rank, scenario)

        futures = [pool.submit(start, r) for r in ranks]
        for _ in ranks:  # every rank's thread is waiting: the parent starts all processes' ranks at once
            armed.acquire()
        conn.send("armed")
        assert conn.recv() == "go"
        cpu0 = _cpu()
        go.set()
        out, errors = {}, []
        for r, f in zip(ranks, futures):
            try:
                out[r] = f.result()
            except Exception as exc:
                errors.append(f"rank {r}: {type(exc).__name__}: {exc}")
        conn.send({"logs": out, "errors": errors[:5], "cpu": _cpu() - cpu0})
    pool.shutdown()
    os._exit(0)  # the store clients' destructors are not waited for


def _session(jobs: list[tuple[Any, list[int]]], port: int, world: int, remote_only: int, keep_local: int,
             timeout_s: float) -> None:
    """A session of its own (so the kernel's scheduler gives it its own share of the CPU, next to the store's and
    rank 0's) holding the worker processes of ``jobs`` (a pipe and the ranks it runs, each); one job runs here."""
    os.setsid()
    if len(jobs) == 1:
        (conn, ranks), = jobs
        _worker(conn, port, world, ranks, remote_only, keep_local, timeout_s)
    ctx = mp.get_context("fork")
    children = [ctx.Process(target=_worker, args=(conn, port, world, ranks, remote_only, keep_local, timeout_s))
                for conn, ranks in jobs]
    for p in children:
        p.start()
    for p in children:
        p.join()
    os._exit(0)


def run_world(world: int, remote_only: int, *, procs: int, keep_local: int, timeout_s: float,
              scenarios: tuple[str, ...] = SCENARIOS) -> dict[str, Any]:
    """Run ``scenarios`` with ``world`` simulated ranks: rank 0 alone in a process, the others ``procs`` processes
    of many threads; the store server in this process. Three sessions (see the module docstring)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=600),
                           wait_for_workers=False)  # torch's default backend: libuv
    backend = "libuv" if getattr(server, "libuvBackend", False) else "legacy"
    ctx = mp.get_context("fork")
    chunks = [[0]] + [chunk for i in range(procs) if (chunk := list(range(1, world))[i::procs])]
    pipes = [ctx.Pipe() for _ in chunks]
    args = (server.port, world, remote_only, keep_local, timeout_s)
    jobs = [(child, chunk) for (_, child), chunk in zip(pipes, chunks)]
    children = [ctx.Process(target=_session, args=(jobs[:1], *args)),  # rank 0
                ctx.Process(target=_session, args=(jobs[1:], *args))]  # every other rank
    for p in children:
        p.start()
    pipes = [parent for parent, _ in pipes]
    for parent in pipes:
        assert parent.recv() == "ready"
    print(f"W={world}: rank 0 and {len(chunks) - 1} processes of other ranks, {world} store clients connected",
          flush=True)
    result: dict[str, Any] = {"world": world, "remote_only_steps": remote_only, "store_backend": backend,
                              "processes": len(chunks), "scenarios": {}}
    for scenario in scenarios:
        keys_before = server.num_keys()
        wiped = [world // NODE - 1] if scenario == "restart_one_node_wiped" else []
        for parent in pipes:
            parent.send((scenario, wiped))
        for parent in pipes:
            assert parent.recv() == "armed"
        t0, server_cpu = time.time(), _cpu()
        for parent in pipes:
            parent.send("go")
        logs: dict[int, list[Any]] = {}
        errors: list[str] = []
        cpu = {"store": 0.0, "rank0": 0.0, "ranks": 0.0}
        for i, parent in enumerate(pipes):
            reply = parent.recv()
            logs.update(reply["logs"])
            errors += reply["errors"]
            cpu["rank0" if i == 0 else "ranks"] += reply["cpu"]
        wall = time.time() - t0
        cpu["store"] = _cpu() - server_cpu
        if errors:
            raise SystemExit(f"W={world} {scenario}: {errors}")
        # the first coordinator of each rank creates its counter of managers (one key per rank, kept for the job):
        # not an agreement's key
        counters = world if scenario == scenarios[0] else 0
        result["scenarios"][scenario] = _summary(logs, wall, keys_before + counters, server.num_keys())
        result["scenarios"][scenario]["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
        print(f"W={world:5d} remote-only={remote_only:3d} {scenario:24s} {wall:7.2f} s  keys left "
              f"{server.num_keys() - keys_before - counters}", flush=True)
    for parent in pipes:
        parent.send(None)
    for p in children:
        p.join(30)
        if p.exitcode is None:
            p.kill()
    return result


def _cpu() -> float:
    """This process's CPU time so far (user and system, every thread), in seconds."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _summary(logs: dict[int, list[Any]], wall: float, keys_before: int, keys_after: int) -> dict[str, Any]:
    """Per agreement (in the order rank 0 made them): time, bytes and requests per rank and on rank 0."""
    names = [entry[0] for entry in logs[0]]
    agreements = []
    last_out = min(log[0][1] for log in logs.values())  # the first rank in
    for i, name in enumerate(names):
        rows = [(r, log[i]) for r, log in logs.items()]
        others = [e for r, e in rows if r != 0]
        zero = logs[0][i]
        out = max(e[2] for _, e in rows)
        seconds, last_out = out - last_out, out
        agreements.append({
            "agreement": name,
            # from the last rank out of the previous agreement (the first rank in, for the first) to the last
            # rank out of this one: what it adds to the restart's time
            "seconds": round(seconds, 3),
            "rank_bytes_max": max((e[4] for e in others), default=0),
            # what most ranks send and receive: the maximum adds the removal of the answer's keys by whichever
            # rank reads it last, a role timing decides
            "rank_bytes_median": sorted(e[4] for e in others)[len(others) // 2] if others else 0,
            "rank_requests_max": max((e[3] for e in others), default=0),
            "rank0_bytes": zero[4],
            "rank0_requests": zero[3],
            "store_requests": sum(e[3] for _, e in rows),
            "store_bytes": sum(e[4] for _, e in rows),
            "largest_request_bytes": max(e[5] for _, e in rows),
        })
    return {"wall_s": round(wall, 3), "keys_left": keys_after - keys_before, "agreements": agreements}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| W | remote-only steps | scenario | agreement | time s | per-rank bytes (max) | per-rank requests "
             "(max) | rank 0 bytes | rank 0 requests | store requests | largest request B | keys left |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for scenario, s in res["scenarios"].items():
            for a in s["agreements"]:
                lines.append(f"| {res['world']} | {res['remote_only_steps']} | {scenario} | {a['agreement']} | "
                             f"{a['seconds']:.2f} | {a['rank_bytes_max']} | {a['rank_requests_max']} | "
                             f"{a['rank0_bytes']} | {a['rank0_requests']} | {a['store_requests']} | "
                             f"{a['largest_request_bytes']} | {s['keys_left']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 2048, 8192])
    ap.add_argument("--remote-only", type=int, nargs="+", default=[1, 100])
    ap.add_argument("--keep-local", type=int, default=2)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--ranks-per-process", type=int, default=128,
                    help="simulated ranks (threads) per process, rank 0 aside (it runs alone)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="the agreements' collective timeout")
    ap.add_argument("--out", default=str(REPO_ROOT / ".bench" / "restart_sim.json"))
    ap.add_argument("--markdown", help="also write the table as Markdown here")
    args = ap.parse_args()
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a client per rank, and the server's end of each
    import torch

    results: list[dict[str, Any]] = []
    doc = {"script": "benchmarks/restart_sim.py", "argv": sys.argv[1:], "torch": torch.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
           "ranks_per_node": NODE, "keep_local": args.keep_local,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for world in args.worlds:
        for n in args.remote_only:
            procs = max(1, -(-(world - 1) // args.ranks_per_process))
            results.append(run_world(world, n, procs=procs, keep_local=args.keep_local, timeout_s=args.timeout_s,
                                     scenarios=tuple(args.scenarios)))
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")  # after each run: a long run keeps its part
    table = markdown(results)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
