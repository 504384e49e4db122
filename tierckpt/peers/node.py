"""Peer copies (``peer_replicas``): each node's committed local step is copied to the next ``copies`` nodes of a
ring, and a replaced node's ranks fetch their shards back from there at a restart (docs/distributed.md).

One :class:`Peers` per manager of a multi-rank job. The node's leader runs a :class:`~.server.PeerServer` and
publishes its address (with a token) through the job's c10d store; after each local commit it copies the step's
folder to its partners on the ``tierckpt-peer`` thread, never over the training process group, one partner at a
time, one 4 MiB chunk in memory. Every rank may fetch its own shard from a partner during a restore. A failure
is logged and counted (:attr:`Peers.failures`), never raised to a save.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..distributed import Split
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import layout
from ..storage.local import LocalStore, fsync_dir
from . import replicas, wire
from .replicas import Ring
from .server import PeerServer

log = logging.getLogger(__name__)

#: Environment variable naming the address this node's peer server listens on (default: the address that routes
#: to ``MASTER_ADDR``, else the host name's).
HOST_ENV = "TIERCKPT_PEER_HOST"
#: The longest a copy pauses between two chunks for a save being written locally.
YIELD_S = 0.25


def _host() -> str:
    given = os.environ.get(HOST_ENV)
    if given:
        return given
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet is sent: this only picks the route's source address
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def make_ring(coord: Any, copies: int) -> Ring:
    """Agree on the ring (a collective on the main lane): rank 0 numbers the nodes by their lowest rank and tells
    each rank its node's number, and every rank the number of nodes (O(1) bytes each). Raises CheckpointError on
    every rank where the job has fewer than ``copies + 1`` nodes."""
    leader = coord.topology.node_ranks[0]

    def answer(leaders: list[int]) -> Split:
        index = {n: i for i, n in enumerate(sorted(set(leaders)))}
        return Split(len(index), {r: index[n] for r, n in enumerate(leaders)}, world_size=len(leaders))

    nodes, node = coord.exchange(leader, coord.main_lane, answer, what="the peer ring")
    if nodes <= copies:
        raise CheckpointError(f"peer_replicas={copies} needs at least {copies + 1} nodes (local folders); this job "
                              f"has {nodes}: use peer_replicas={nodes - 1 if nodes > 1 else 0}", tier="peer")
    return Ring(int(node), int(nodes), copies)


class Peers:
    """This rank's part of the peer copies (see the module docstring). ``keep``: replicas kept per source node
    (the manager's ``keep_local``); ``timeout_s``: the deadline of every network operation and address lookup."""

    tier = "peer"

    def __init__(self, local: LocalStore, coord: Any, copies: int, *, keep: int, timeout_s: float) -> None:
        self.local, self.keep, self.timeout_s = local, keep, timeout_s
        topo = coord.topology
        self.rank, self.leader = topo.rank, topo.is_node_leader
        self.ring = make_ring(coord, copies)
        self.url = f"peer://node-{self.ring.node}"
        self._channel = coord.upload_channel()
        self._addresses: dict[int, tuple[str, int, str]] = {}
        self.failures = 0
        self.pushed: int | None = None
        self.last_error: str | None = None
        #: the newest copies to a partner: (step, partner, bytes, seconds from the local commit's hand-over)
        self.copies: deque[tuple[int, int, int, float]] = deque(maxlen=64)
        self._lock = threading.Lock()
        self._pending: int | None = None
        self._running: Future[None] | None = None
        self.server: PeerServer | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierckpt-peer")
        #: whether the local tier is being written now: the copy pauses between chunks meanwhile (set by the manager)
        self.busy: Callable[[], bool] = lambda: False
        #: seconds the copies spent paused for local writes
        self.yielded_s = 0.0
        if self.leader:
            for gone in replicas.clean_leftovers(local.root):
                log.info("tier peer: removed the unfinished replica %s", gone)
            self.server = PeerServer(local.root, self.ring, host=_host(), keep=keep, timeout_s=timeout_s)
            host, port = self.server.address
            self._channel.post(self._key(self.ring.node), {"host": host, "port": port, "token": self.server.token})

    @staticmethod
    def _key(node: int) -> str:
        return f"peer/n{node}"

    def close(self) -> None:
        """Finish the copy in progress (bounded by the deadline), stop the server, withdraw the address."""
        with self._lock:
            self._pending = None
        self._thread.shutdown(wait=True)
        if self.server is not None:
            self.server.close()
            self._channel.withdraw(self._key(self.ring.node))

    # -------------------------------------------------------------------------------------- sending
    def committed(self, step: int) -> Future[None] | None:
        """The node committed ``step`` locally: copy it to the partners on the peer thread (node leaders only).
        A step that arrives while another is being copied waits; a newer one replaces it (only the newest
        matters). Returns the future of the copy that will carry it, or None off the leader."""
        if not self.leader:
            return None
        with self._lock:
            self._pending = step
            if self._running is None or self._running.done():
                self._running = self._thread.submit(self._drain)
            return self._running

    def _drain(self) -> None:
        while True:
            with self._lock:
                step, self._pending = self._pending, None
            if step is None:
                return
            self._push(step)

    def _push(self, step: int) -> None:
        try:
            sources = replicas.replica_sources(self.local, step)
        except Exception as exc:
            self._failed(step, None, exc)
            return
        files = [(n, size) for n, size, _ in sources]
        for partner in self.ring.partners():
            t0 = time.monotonic()
            try:
                with self._connect(partner) as (sock, token):
                    wire.send_msg(sock, {"op": "put", "token": token, "node": self.ring.node, "step": step,
                                         "files": files})
                    self._expect_ok(sock)
                    for _n, size, src in sources:
                        if isinstance(src, bytes):
                            wire.send_bytes(sock, src)
                        else:
                            wire.send_file(sock, src, size, throttle=self._yield)
                    self._expect_ok(sock)
            except Exception as exc:
                self._failed(step, partner, exc)
                continue
            self.pushed = step
            self.copies.append((step, partner, sum(s for _, s in files), time.monotonic() - t0))
            log.info("tier peer: node %d copied step %d to node %d (%d bytes) in %.3f s", self.ring.node, step,
                     partner, sum(s for _, s in files), time.monotonic() - t0)

    def _yield(self, _sent: int) -> None:
        """Between two chunks: wait while a save is written to the local tier (the local write comes first), at
        most :data:`YIELD_S` per chunk, so that a job saving back to back still copies (a chunk per pause at
        worst) and the partner's receive never times out meanwhile."""
        if not self.busy():
            return
        t0 = time.monotonic()
        while self.busy() and time.monotonic() - t0 < min(YIELD_S, self.timeout_s / 2):
            time.sleep(0.005)
        self.yielded_s += time.monotonic() - t0

    def _failed(self, step: int, partner: int | None, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
        where = "" if partner is None else f" to node {partner}"
        log.warning("tier peer: node %d could not copy step %d%s (the save is not affected): %s", self.ring.node,
                    step, where, exc)
        if partner is not None:
            self._addresses.pop(partner, None)  # look it up again next time: the partner may have restarted

    @staticmethod
    def _expect_ok(sock: socket.socket) -> None:
        reply = wire.recv_msg(sock)
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            err = reply.get("error") if isinstance(reply, dict) else reply
            raise wire.PeerError(f"the partner refused: {err!s:.1024}")

    def _connect(self, node: int) -> _Connection:
        addr = self._addresses.get(node)
        if addr is None:
            got = self._channel.fetch([self._key(node)], self.timeout_s, readers=0).get(self._key(node))
            if got is None:
                raise wire.PeerError(f"node {node} published no peer address within {self.timeout_s:.0f} s")
            addr = self._addresses[node] = (str(got["host"]), int(got["port"]), str(got["token"]))
        sock = socket.create_connection(addr[:2], timeout=self.timeout_s)
        sock.settimeout(self.timeout_s)
        return _Connection(sock, addr[2])

    # -------------------------------------------------------------------------------------- restoring
    def offer(self) -> dict[str, Any]:
        """What this rank adds to its restore offer: its node, and (the leader) the replicas it holds for its
        source nodes, at most ``keep`` steps each, so ``keep x copies`` steps in all."""
        out: dict[str, Any] = {"node": self.ring.node}
        if self.leader:
            out["replicas"] = [[k, replicas.committed_steps(self.local.root, k)[-self.keep:]]
                               for k in self.ring.sources()]
        return out

    def fetch(self, step: int) -> LocalStore:
        """This rank's shard of its node's ``step`` from the first partner that holds it, verified on receipt,
        committed under ``replicas/.fetch-r<rank>/`` (replacing an earlier fetch); returns that folder as a store
        for the restore to read (and verify against the manifests again). Raises CorruptCheckpointError when no
        partner holds an intact copy, so that the restore goes on to the next tier."""
        root = replicas.fetch_root(self.local.root, self.rank)
        errors = []
        for partner in self.ring.partners():
            replicas.remove_tree(root)
            tmp = os.path.join(root, f"{layout.TMP_PREFIX}{layout.step_dir(step)}-{layout.new_save_id()}")
            t0 = time.monotonic()
            try:
                os.makedirs(tmp)
                with self._connect(partner) as (sock, token):
                    wire.send_msg(sock, {"op": "get", "token": token, "node": self.ring.node, "step": step,
                                         "rank": self.rank})
                    reply = wire.recv_msg(sock)
                    if not isinstance(reply, dict) or "files" not in reply:
                        raise wire.PeerError(str(reply.get("error") if isinstance(reply, dict) else reply)[:1024])
                    files = wire.check_files(reply["files"])
                    if not any(n.startswith(f"r{self.rank:05d}-") and n.endswith(".manifest.json") for n, _ in files):
                        raise wire.PeerError(f"its replica of step {step} holds no shard of rank {self.rank}")
                    for n, size in files:
                        wire.recv_file(sock, os.path.join(tmp, n), size)
                os.rename(tmp, os.path.join(root, layout.step_dir(step)))
                fsync_dir(root)
            except Exception as exc:
                errors.append(f"node {partner}: {exc}")
                log.warning("tier peer: rank %d could not fetch step %d from node %d: %s", self.rank, step, partner,
                            exc)
                self._addresses.pop(partner, None)
                continue
            log.info("tier peer: rank %d fetched its shard of step %d from node %d (%d bytes) in %.3f s", self.rank,
                     step, partner, sum(s for _, s in files), time.monotonic() - t0)
            return LocalStore(root, tier="peer", direct_io=self.local.direct_io, huge_pages=self.local.huge_pages)
        raise CorruptCheckpointError("no partner holds an intact replica: " + "; ".join(errors), step=step,
                                     tier="peer", path=self.url)


    def adopt(self, step: int) -> None:
        """A restore read and verified this rank's shard of ``step`` from its fetched copy and applied it: commit it
        into the node's local tier (:func:`.replicas.commit_fetched`), so that the next restart and retention see
        the step as the node's own. Never raises: a failure only logs (the restore succeeded)."""
        try:
            replicas.commit_fetched(self.local, step, self.rank)
        except Exception as exc:  # noqa: BLE001 - the restore stands; the next restart fetches again
            log.warning("tier peer: rank %d could not commit its fetched shard of step %d into the local tier %s: %s",
                        self.rank, step, self.local.url, exc)


class _Connection:
    """A connected socket and the server's token, closed on leaving the ``with`` block."""

    def __init__(self, sock: socket.socket, token: str) -> None:
        self.sock, self.token = sock, token

    def __enter__(self) -> tuple[socket.socket, str]:
        return self.sock, self.token

    def __exit__(self, *_exc: object) -> None:
        self.sock.close()
