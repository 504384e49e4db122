"""The receiving end of the peer channel, run by each node's leader: it keeps its source nodes' replicas
(``put``) and hands a replaced node's ranks their shards back (``get``). See :mod:`.replicas` for the layout and
:mod:`.wire` for the format."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import Any

from ..format import layout
from ..storage.local import fsync_dir
from . import replicas, wire
from .replicas import Ring

log = logging.getLogger(__name__)

#: Connections served at once; more wait in the listen backlog (a node has ``copies`` sources and its own ranks).
MAX_HANDLERS = 4


class PeerServer:
    """A TCP listener on ``host`` (port chosen by the kernel) with a thread per connection (at most
    :data:`MAX_HANDLERS`). Every request carries ``token`` (published with the address through the job's store);
    a request with another token, or a ``put`` from a node that is not one of this node's sources, is refused.
    ``keep``: replicas kept per source node; ``timeout_s``: the deadline of every socket operation."""

    def __init__(self, local_root: str, ring: Ring, *, host: str, keep: int, timeout_s: float) -> None:
        self.root, self.ring, self.keep, self.timeout_s = local_root, ring, keep, timeout_s
        self.token = secrets.token_hex(16)
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.address = (host, self._sock.getsockname()[1])
        self._slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self._stop = threading.Event()
        self.received = 0
        self._thread = threading.Thread(target=self._serve, name="tierckpt-peer-server", daemon=True)
        self._thread.start()
        log.info("tier peer: node %d serves replicas at %s:%d", ring.node, *self.address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(timeout=self.timeout_s):
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), name="tierckpt-peer-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.timeout_s)
            msg = wire.recv_msg(conn)
            if not isinstance(msg, dict) or msg.get("token") != self.token:
                raise wire.PeerError("request without this server's token")
            op = msg.get("op")
            if op == "put":
                self._put(conn, msg)
            elif op == "get":
                self._get(conn, msg)
            else:
                raise wire.PeerError(f"unknown request {op!r:.40}")
        except Exception as exc:
            log.warning("tier peer: node %d: a request failed: %s", self.ring.node, exc)
            try:
                wire.send_msg(conn, {"error": str(exc)[:1024]})
            except Exception:  # the peer is gone: nothing to tell
                pass
        finally:
            conn.close()
            self._slots.release()

    @staticmethod
    def _ints(msg: dict[str, Any], *names: str) -> list[int]:
        vals = [msg.get(n) for n in names]
        if any(type(v) is not int or v < 0 for v in vals):
            raise wire.PeerError(f"malformed request: {names}")
        return vals  # type: ignore[return-value]

    def _put(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """Receive node ``node``'s step into a temporary folder, then commit it with one rename."""
        node, step = self._ints(msg, "node", "step")
        if node not in self.ring.sources():
            raise wire.PeerError(f"node {node} is not a source of node {self.ring.node}")
        files = wire.check_files(msg.get("files"))
        if layout.STEP_MANIFEST not in {n for n, _ in files}:
            raise wire.PeerError("a replica without manifest.json")
        folder = os.path.join(self.root, replicas.node_dir(node))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{layout.TMP_PREFIX}{layout.step_dir(step)}-{layout.new_save_id()}")
        os.mkdir(tmp)
        try:
            wire.send_msg(conn, {"ok": True})
            for name, size in files:
                wire.recv_file(conn, os.path.join(tmp, name), size)
            fsync_dir(tmp)
            final = os.path.join(folder, layout.step_dir(step))
            if os.path.exists(final):  # a new save of the same step: the old copy goes first, the new one whole
                trash = os.path.join(folder, layout.trash_dir(layout.step_dir(step)))
                os.rename(final, trash)
                replicas.remove_tree(trash)
            os.rename(tmp, final)
            fsync_dir(folder)
        except BaseException:
            replicas.remove_tree(tmp)
            raise
        self.received += 1
        log.info("tier peer: node %d committed node %d's replica of step %d (%d files) at %s", self.ring.node, node,
                 step, len(files), final)
        replicas.retain(self.root, node, self.keep)
        wire.send_msg(conn, {"ok": True})

    def _get(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """Send one rank's shard of node ``node``'s replica of ``step``: ``manifest.json``, its rank manifest
        and its data files (their names start with ``r<rank>-``)."""
        node, step, rank = self._ints(msg, "node", "step", "rank")
        folder = os.path.join(self.root, replicas.node_dir(node), layout.step_dir(step))
        if step not in replicas.committed_steps(self.root, node):
            wire.send_msg(conn, {"error": f"node {self.ring.node} holds no replica of node {node}'s step {step}"})
            return
        prefix = f"r{rank:05d}-"
        names = [layout.STEP_MANIFEST] + sorted(n for n in os.listdir(folder) if n.startswith(prefix))
        files = [(n, os.path.getsize(os.path.join(folder, n))) for n in names]
        wire.send_msg(conn, {"files": [list(f) for f in files]})
        for n, size in files:
            wire.send_file(conn, os.path.join(folder, n), size)
