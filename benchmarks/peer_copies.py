"""Peer copies (``peer_replicas=1``) when uploads lag: the recovery point after a node loss, the copy's time to commit
against a raw loopback socket copy of the same bytes, and what it costs a training step.

Two "nodes" of one rank each (gloo through a FileStore, each node its own local folder) train for ``--saves``
steps and save after every one; a step is a fixed CPU matmul loop (``--step-s`` seconds on its own). The remote is
a POSIX folder behind ``upload_bandwidth_mbps=--remote-mbps``: slower than the saves, so uploads fall behind. The
same job runs twice, without and with peer copies. Right after the last save is committed (and, with peer copies,
copied), rank 0 takes stock as if node 1 were lost at that instant: the newest step every rank could still restore
is the newest step committed on the remote, or (with peer copies) one that node 0 holds locally and as node 1's
replica; the recovery point is how many saves back that step is. Step time: the mean wall time of a training step
and its ``save()``, past the first two. Copy time: from the local commit's hand-over to the partner's reply that
the replica is committed (received, checksummed, fsync-ed, renamed), against a raw copy of the same files over a
loopback TCP socket into files fsync-ed on the other end (and against the socket alone).

    .venv/bin/python benchmarks/peer_copies.py --mib 64 --saves 8 --step-s 1.0 --remote-mbps 30
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness as h


def _worker(rank: int, cfg: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from tierckpt import CheckpointManager
    from tierckpt.storage.local import LocalStore
    from tierckpt.tiers.listing import list_root

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["store"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    root = Path(cfg["root"])
    state = h.gpt_state(cfg["mib"] << 20, seed=rank)
    a = torch.randn(256, 256)
    mgr = CheckpointManager(root / f"node{rank}", remote=str(root / "remote"), keep_local=2,
                            peer_replicas=cfg["peers"], upload_bandwidth_mbps=cfg["remote_mbps"],
                            collective_timeout_s=300)
    steps = []
    t_last = time.perf_counter()
    handle = None
    for s in range(1, cfg["saves"] + 1):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < cfg["step_s"]:  # the training step
            a = torch.tanh(a @ a / 256)
        handle = mgr.save(s, state)
        now = time.perf_counter()
        steps.append(now - t_last)
        t_last = now
    assert handle is not None
    handle.persisted.result()
    peers = mgr.components.engine.peers
    if peers is not None:  # the newest step's copy is in (what a node loss right now would find)
        deadline = time.monotonic() + 120
        while peers.pushed != cfg["saves"] and time.monotonic() < deadline:
            time.sleep(0.01)
    dist.barrier()
    out: dict[str, Any] = {"step_s": steps, "copies": [] if peers is None else list(peers.copies)}
    if rank == 0:  # node 1 is lost now: what could every rank restore?
        remote = set(list_root(LocalStore(root / "remote", tier="remote", create=False)).steps)
        local = set(list_root(mgr.local).steps)
        replica = root / "node0" / "replicas" / "node-00001"
        held = {int(p.name[5:]) for p in replica.glob("step-*") if (p / "manifest.json").is_file()}
        newest = max(remote | (local & held), default=0)
        out |= {"remote_steps": sorted(remote), "replica_steps": sorted(held), "restorable": newest,
                "recovery_point_steps": cfg["saves"] - newest}
    dist.barrier()
    mgr.close()
    Path(cfg["out"]).with_suffix(f".r{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _job(scratch: Path, args: Any, peers: int) -> list[dict[str, Any]]:
    root = h.fresh_dir(scratch, f"peers{peers}")
    cfg = {"root": str(root), "store": f"file://{root}/store", "mib": args.mib, "saves": args.saves,
           "step_s": args.step_s, "remote_mbps": args.remote_mbps, "peers": peers, "out": str(root / "out.json")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(h.REPO_ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), json.dumps(cfg)], env=env)
             for r in range(2)]
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise SystemExit(f"a rank of the peer_replicas={peers} job failed")
    res = [json.loads((root / f"out.r{r}.json").read_text()) for r in range(2)]
    copied = root / "node0" / f"step-{args.saves:010d}"
    res[0]["files"] = [str(p) for p in sorted(copied.iterdir())] if peers else []
    return res


def _raw_copy(files: list[str], dest: Path, *, to_disk: bool) -> float:
    """Send ``files`` over a loopback TCP socket, 4 MiB at a time, to a thread that writes each into ``dest``
    (fsync-ed) or drops it; seconds until the receiver is done."""
    srv = socket.create_server(("127.0.0.1", 0))
    sizes = [os.path.getsize(f) for f in files]
    dest.mkdir(parents=True, exist_ok=True)

    def receive() -> None:
        conn, _ = srv.accept()
        buf = bytearray(4 << 20)
        with conn:
            for i, size in enumerate(sizes):
                fd = os.open(dest / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if to_disk else -1
                got = 0
                while got < size:
                    k = conn.recv_into(buf, min(len(buf), size - got))
                    if to_disk:
                        os.write(fd, memoryview(buf)[:k])
                    got += k
                if to_disk:
                    os.fsync(fd)
                    os.close(fd)
            conn.sendall(b"k")

    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(srv.getsockname()) as c:
        for f in files:
            with open(f, "rb") as src:
                while chunk := src.read(4 << 20):
                    c.sendall(chunk)
        c.recv(1)
    secs = time.perf_counter() - t0
    t.join()
    srv.close()
    return secs


def main() -> None:
    cli = h.Cli(__doc__, __file__)
    cli.add_argument("--mib", type=int, default=128, help="each rank's state (MiB)")
    cli.add_argument("--saves", type=int, default=8)
    cli.add_argument("--step-s", type=float, default=0.5, help="a training step's compute (seconds)")
    cli.add_argument("--remote-mbps", type=float, default=60.0, help="the remote's upload cap (MB/s)")
    args = cli.parse()
    scratch = h.scratch_dir(args.dir)
    jobs = {}
    for peers in (0, 1):
        h.log(f"job with peer_replicas={peers}")
        jobs[peers] = _job(scratch, args, peers)
    off, on = jobs[0], jobs[1]
    files = on[0].pop("files")
    nbytes = sum(os.path.getsize(f) for f in files)
    raw_disk = [_raw_copy(files, scratch / "raw", to_disk=True) for _ in range(3)]
    raw_sock = [_raw_copy(files, scratch / "raw", to_disk=False) for _ in range(3)]
    h.remove(scratch / "raw")
    copy_s = [c[3] for r in on for c in r["copies"]]

    def mean_step(res: list[dict[str, Any]]) -> float:
        xs = [x for r in res for x in r["step_s"][2:]]
        return sum(xs) / len(xs)

    result = {
        "bytes_per_node_step": nbytes, "recovery_point_steps": {"off": off[0]["recovery_point_steps"],
                                                                "on": on[0]["recovery_point_steps"]},
        "restorable": {"off": off[0]["restorable"], "on": on[0]["restorable"]},
        "remote_steps": {"off": off[0]["remote_steps"], "on": on[0]["remote_steps"]},
        "replica_steps": on[0]["replica_steps"],
        "step_s": {"off": mean_step(off), "on": mean_step(on)},
        "copy_s": {"median": sorted(copy_s)[len(copy_s) // 2], "min": min(copy_s), "max": max(copy_s)},
        "raw_copy_disk_s": sorted(raw_disk)[1], "raw_copy_socket_s": sorted(raw_sock)[1],
        "machine": h.machine(scratch),
    }
    rows = [["recovery point after losing node 1 (saves back)", str(result["recovery_point_steps"]["off"]),
             str(result["recovery_point_steps"]["on"])],
            ["training step + save() (mean, s)", h.fmt(result["step_s"]["off"]), h.fmt(result["step_s"]["on"])]]
    copy = [["peer copy to commit (median of the copies)", h.fmt(result["copy_s"]["median"])],
            ["raw loopback socket copy into fsync-ed files", h.fmt(result["raw_copy_disk_s"])],
            ["raw loopback socket copy, no disk", h.fmt(result["raw_copy_socket_s"])]]
    md = h.sections([("Recovery point and step time", ["", "peer_replicas=0", "peer_replicas=1"], rows),
                     (f"Copy of one node's step ({nbytes / 2**20:.0f} MiB)", ["", "seconds"], copy)])
    print(md)
    h.finish(args, result, md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()
