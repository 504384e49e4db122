"""The peer channel in one process: a node's server receives replicas over loopback and commits them whole or not
at all (a transfer killed mid-file, a checksum that differs, a foreign token or node), keeps ``keep`` of them per
source node, and serves one rank's shard back; the ring, the restore plan's counting of replicas, and the option's
checks."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from tierckpt import CheckpointManager
from tierckpt.engine.restore_plan import RestorePlan, my_tiers
from tierckpt.errors import StorageError
from tierckpt.format import hashing
from tierckpt.peers import replicas, wire
from tierckpt.peers.replicas import Ring
from tierckpt.peers.server import PeerServer

DATA = os.urandom(300_000)
FILES = [["r00002-p0000-ab.safetensors", len(DATA)], ["r00002-ab.manifest.json", 5], ["r00003-ab.manifest.json", 5],
         ["manifest.json", 2]]
BODIES = {"r00002-p0000-ab.safetensors": DATA, "r00002-ab.manifest.json": b"rm-02", "r00003-ab.manifest.json":
          b"rm-03", "manifest.json": b"{}"}


@pytest.fixture
def server(tmp_path: Path):
    srv = PeerServer(str(tmp_path), Ring(node=0, nodes=2, copies=1), host="127.0.0.1", keep=2, timeout_s=5)
    yield srv
    srv.close()


def connect(srv: PeerServer) -> socket.socket:
    sock = socket.create_connection(srv.address, timeout=5)
    return sock


def put(srv: PeerServer, step: int, *, token: str | None = None, node: int = 1) -> dict:
    with connect(srv) as sock:
        wire.send_msg(sock, {"op": "put", "token": token or srv.token, "node": node, "step": step, "files": FILES})
        reply = wire.recv_msg(sock)
        if not reply.get("ok"):
            return reply
        for name, _ in FILES:
            sock.sendall(BODIES[name])
            wire.send_msg(sock, {"digest": hashing.digest(BODIES[name]).hex()})
        return wire.recv_msg(sock)


def settle(srv: PeerServer) -> None:
    """Wait until the server's connection threads are done (they hold one of its slots each)."""
    deadline = time.monotonic() + 5
    while srv._slots._value < 4 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.01)


def test_a_replica_is_committed_whole_and_retention_keeps_keep_steps(server: PeerServer, tmp_path: Path) -> None:
    for step in (1, 2, 3):
        assert put(server, step) == {"ok": True}
    assert replicas.committed_steps(str(tmp_path), 1) == [2, 3]
    folder = tmp_path / "replicas" / "node-00001" / "step-0000000003"
    assert sorted(p.name for p in folder.iterdir()) == sorted(BODIES)
    assert (folder / "r00002-p0000-ab.safetensors").read_bytes() == DATA


def test_a_transfer_killed_mid_file_leaves_no_step(server: PeerServer, tmp_path: Path) -> None:
    with connect(server) as sock:
        wire.send_msg(sock, {"op": "put", "token": server.token, "node": 1, "step": 7, "files": FILES})
        assert wire.recv_msg(sock) == {"ok": True}
        sock.sendall(DATA[:100_000])  # the sender dies a third of the way into the first file
    settle(server)
    assert replicas.committed_steps(str(tmp_path), 1) == []
    assert os.listdir(tmp_path / "replicas" / "node-00001") == []  # its temporary folder is gone too


def test_a_temporary_folder_left_by_a_crash_is_never_counted_and_is_cleaned(tmp_path: Path) -> None:
    tmp = tmp_path / "replicas" / "node-00001" / ".tmp-step-0000000009-deadbeef"
    tmp.mkdir(parents=True)
    (tmp / "manifest.json").write_text("{}")  # even with its manifest: not committed until renamed
    assert replicas.committed_steps(str(tmp_path), 1) == []
    assert replicas.clean_leftovers(str(tmp_path)) == [str(tmp)]
    assert not tmp.exists()


def test_a_checksum_that_differs_is_refused(server: PeerServer, tmp_path: Path) -> None:
    with connect(server) as sock:
        wire.send_msg(sock, {"op": "put", "token": server.token, "node": 1, "step": 4, "files": FILES[:1]
                             + FILES[-1:]})
        assert wire.recv_msg(sock) == {"ok": True}
        sock.sendall(DATA)
        wire.send_msg(sock, {"digest": hashing.digest(DATA[:-1]).hex()})  # bytes changed on the way
        reply = wire.recv_msg(sock)
    assert "checksum mismatch" in reply["error"]
    settle(server)
    assert replicas.committed_steps(str(tmp_path), 1) == []


def test_foreign_requests_are_refused(server: PeerServer, tmp_path: Path) -> None:
    assert "token" in put(server, 1, token="0" * 32)["error"]
    assert "not a source" in put(server, 1, node=0)["error"]
    with connect(server) as sock:
        sock.sendall(b"\xff\xff\xff\xff")  # a length over the bound
        assert "error" in wire.recv_msg(sock)
    with connect(server) as sock:
        wire.send_msg(sock, {"op": "put", "token": server.token, "node": 1, "step": 1,
                             "files": [["../escape", 1], ["manifest.json", 2]]})
        assert "unsafe file name" in wire.recv_msg(sock)["error"]
    assert replicas.committed_steps(str(tmp_path), 1) == []


def test_a_copy_pauses_between_chunks_while_a_save_is_written_locally(tmp_path: Path) -> None:
    from tierckpt.peers import node

    class Busy:
        calls = 0

        def __call__(self) -> bool:
            self.calls += 1
            return self.calls < 4  # the local write ends after a few checks

    peers = node.Peers.__new__(node.Peers)  # only the pause is under test: no ring, no server
    peers.timeout_s, peers.yielded_s, peers.busy = 5.0, 0.0, Busy()
    peers._yield(4 << 20)
    assert peers.busy.calls == 4 and peers.yielded_s > 0
    peers.busy = lambda: True  # a local write that never ends: bounded all the same
    t0 = time.monotonic()
    peers._yield(4 << 20)
    assert node.YIELD_S <= time.monotonic() - t0 < node.YIELD_S + 1


def test_get_sends_one_ranks_shard_verified(server: PeerServer, tmp_path: Path) -> None:
    assert put(server, 5) == {"ok": True}
    out = tmp_path / "out"
    out.mkdir()
    with connect(server) as sock:
        wire.send_msg(sock, {"op": "get", "token": server.token, "node": 1, "step": 5, "rank": 2})
        files = wire.check_files(wire.recv_msg(sock)["files"])
        for name, size in files:
            wire.recv_file(sock, str(out / name), size)
    assert [n for n, _ in files] == ["manifest.json", "r00002-ab.manifest.json", "r00002-p0000-ab.safetensors"]
    assert (out / "r00002-p0000-ab.safetensors").read_bytes() == DATA
    with connect(server) as sock:
        wire.send_msg(sock, {"op": "get", "token": server.token, "node": 1, "step": 6, "rank": 2})
        assert "holds no replica" in wire.recv_msg(sock)["error"]


def test_a_fetch_from_a_replica_without_the_ranks_shard_goes_on_to_the_next_tier(server: PeerServer,
                                                                                   tmp_path: Path) -> None:
    from tierckpt.errors import CorruptCheckpointError
    from tierckpt.peers import node
    from tierckpt.storage.local import LocalStore

    assert put(server, 5) == {"ok": True}
    host, port = server.address

    class Channel:
        def fetch(self, names: list[str], timeout_s: float, *, readers: int) -> dict:
            return {names[0]: {"host": host, "port": port, "token": server.token}}

    peers = node.Peers.__new__(node.Peers)  # rank 7 of node 1, whose partner is this server's node 0
    peers.local, peers.rank, peers.ring, peers.url = LocalStore(tmp_path / "b"), 7, Ring(1, 2, 1), "peer://node-1"
    peers.timeout_s, peers._addresses, peers._channel = 5.0, {}, Channel()
    with pytest.raises(CorruptCheckpointError, match="holds no shard of rank 7"):
        peers.fetch(5)  # the restore then tries the remote, as for a corrupt copy
    peers.rank = 2
    got = peers.fetch(5)
    assert got.tier == "peer"
    assert (Path(got.root) / "step-0000000005" / "r00002-p0000-ab.safetensors").read_bytes() == DATA


def test_the_ring_and_the_plan_count_a_partners_replica() -> None:
    ring = Ring(node=2, nodes=4, copies=2)
    assert ring.partners() == [3, 0] and ring.sources() == [1, 0]
    # 2 nodes x 2 ranks; node 1 (ranks 2, 3) lost its folder; node 0's leader holds node 1's steps 4 and 5
    offers = [{"local": [3, 4, 5], "node": 0, "replicas": [[1, [4, 5]]]}, {"local": [3, 4, 5], "node": 0},
              {"local": [], "node": 1, "replicas": [[0, []]]}, {"local": [], "node": 1}]
    plan = RestorePlan(None, local_first=True, shared={3}, ring=(2, 1))
    answer = plan.plan(offers)[0]
    assert answer["next"] == {"step": 5, "index": 0, "remote": False, "share": False}
    without = RestorePlan(None, local_first=True, shared={3}).plan([{"local": o["local"]} for o in offers])[0]
    assert without["next"]["step"] == 3  # the newest uploaded step: two steps lost without the replica
    # a replica offered by a node that is not a partner of its source is not counted
    stray = RestorePlan(None, local_first=True, shared=set(), ring=(3, 1)).plan(
        [{"local": [], "node": 0}, {"local": [5], "node": 1}, {"local": [5], "node": 2, "replicas": [[0, [5]]]}])[0]
    assert stray["next"] is None


def test_a_remote_rank_0_could_not_list_defers_to_the_replicas_then_fails_the_restore() -> None:
    down = StorageError("remote refused", tier="remote", path="s3://b/run")
    # rank 0's node (0) was replaced and the remote cannot be listed: node 1 holds node 0's step 5
    offers = [{"local": [], "node": 0, "replicas": [[1, [5]]], "deferred": down}, {"local": [5], "node": 1,
                                                                                  "replicas": [[0, [5]]]}]
    assert RestorePlan(None, local_first=True, ring=(2, 1)).plan(offers)[0]["next"]["step"] == 5
    offers[1]["replicas"] = [[0, []]]  # no replica either: the remote's error, never "no checkpoint"
    answer = RestorePlan(None, local_first=True, ring=(2, 1)).plan(offers)[0]
    assert answer["blocked"]["ranks"] == [0] and answer["error"] is down
    assert RestorePlan(5, local_first=True, ring=(2, 1)).plan(offers)[0]["error"] is down


def test_my_tiers_puts_the_partners_between_local_and_remote() -> None:
    class T:
        def __init__(self, tier: str) -> None:
            self.tier = tier

    local, remote, peer = T("local"), T("remote"), T("peer")
    decision = {"step": 5, "remote": True}
    assert my_tiers([local, remote], decision, {5}, peer) == [local, peer, remote]
    assert my_tiers([local, remote], decision, set(), peer) == [peer, remote]
    assert my_tiers([local, remote], decision, set()) == [remote]


def test_peer_replicas_is_checked(tmp_path: Path) -> None:
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(ValueError, match="peer_replicas"):
            CheckpointManager(tmp_path / "c", peer_replicas=bad)
    with pytest.raises(ValueError, match="multi-rank job on several nodes"):
        CheckpointManager(tmp_path / "c", peer_replicas=1)
    with CheckpointManager(tmp_path / "c") as mgr:  # still usable: the refused managers released the folder
        assert mgr.options.peer_replicas == 0
