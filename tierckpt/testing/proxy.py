"""A TCP forwarder on loopback whose behaviour is switched at run time (:class:`FaultProxy`): forward, refuse
connections, accept and never answer, reset every connection, or deliver bytes slowly.

It forwards only to loopback upstreams: a test tool, never to be put in front of a real network.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from ._loopback import CHUNK, JOIN_S, LOOPBACK, POLL_S, Endpoint, shutdown

log = logging.getLogger(__name__)

MODES = ("forward", "refuse", "silent", "reset", "slow")
"""The modes of :class:`FaultProxy`."""

_UPSTREAM_CONNECT_S = 5.0


def _parse_upstream(upstream: str) -> tuple[str, int]:
    """``"host:port"`` or ``"http://host:port[/...]"`` -> ``(host, port)``; the host must be a loopback one.

    Raises:
        ValueError: the string has no port, or names a host that is not loopback.
    """
    text = upstream.strip()
    parts = urlsplit(text if "://" in text else f"//{text}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:  # a port that is not a number, or out of range
        raise ValueError(f"bad upstream {upstream!r}: {e}") from None
    if not host or port is None:
        raise ValueError(f"upstream {upstream!r} must be 'host:port' or 'http://host:port'")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"upstream {upstream!r} is not a loopback address (only loopback is allowed)")
    return host, port


def _abort(sock: socket.socket | None) -> None:
    """Close ``sock`` with an RST (SO_LINGER 0) rather than a FIN; never raises."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Conn:
    """One accepted client connection and, while it is forwarded, its upstream connection.

    The sockets are closed only by the last of its threads to finish (``users`` counts them), so no thread
    ever uses a closed (possibly reused) file descriptor; other threads only set flags and call ``shutdown``.
    """

    def __init__(self, client: socket.socket, blackholed: bool) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.blackholed = blackholed  # bytes from the client are read and discarded; nothing goes back
        self.aborted = False  # close both sides with an RST
        self.done = threading.Event()  # every thread of this connection must finish
        self.released = threading.Event()  # the sockets are closed
        self.users = 1


class FaultProxy(Endpoint):
    """A TCP forwarder on 127.0.0.1 in front of a loopback ``upstream``, its behaviour switched at run time.

    Modes (see :meth:`set_mode`): ``"forward"`` passes bytes both ways; ``"refuse"`` closes the listening
    socket, so connections are refused; ``"silent"`` accepts connections, reads and discards what clients send
    and never answers nor closes (a black hole, until :meth:`stop`); ``"reset"`` accepts and at once closes
    with an RST; ``"slow"`` forwards with a delay per chunk and/or a throughput cap.

    Args:
        upstream: ``"host:port"`` or ``"http://host:port"`` (a path is ignored); the host must be loopback.
        port: the port to listen on; 0 (the default) lets the OS choose one, kept across ``"refuse"`` periods.

    Raises:
        ValueError: ``upstream`` cannot be parsed or is not a loopback address.

    Use as a context manager (``with FaultProxy(url) as proxy:``) or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, upstream: str, *, port: int = 0) -> None:
        self._upstream = _parse_upstream(upstream)
        self._port = port
        self._lock = threading.Lock()
        self._mode = "forward"
        self._delay_s = 0.0
        self._bytes_per_s: float | None = None
        self._want_listen = True
        self._listener: socket.socket | None = None
        self._listener_closed = threading.Condition(self._lock)
        self._conns: set[_Conn] = set()
        self._threads: set[threading.Thread] = set()
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._connections = 0

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        """Bind the listening socket and start accepting; a no-op if already started.

        Returns:
            ``self``.

        Raises:
            OSError: the port cannot be bound.
            RuntimeError: the proxy was stopped (a stopped proxy cannot be restarted; make a new one).
        """
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("FaultProxy was stopped; make a new one")
            if self._acceptor is not None:
                return self
            self._listener = self._bind()
            self._acceptor = threading.Thread(target=self._accept_loop, name="FaultProxy-accept", daemon=True)
            self._acceptor.start()
            want_listen = self._want_listen
        if not want_listen:  # set_mode("refuse") before start()
            self._wait_listener_closed()
        log.debug("FaultProxy on %s -> %s:%d, mode %s", self.url, *self._upstream, self._mode)
        return self

    def stop(self) -> None:
        """Close every socket (listening, client and upstream) and join the threads (for about 2 s at most).

        Idempotent; never raises.
        """
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            acceptor = self._acceptor
            conns = list(self._conns)
        for conn in conns:
            self._kill(conn, abort=False)
        deadline = time.monotonic() + JOIN_S
        if acceptor is not None:
            acceptor.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads) or (acceptor is not None and acceptor.is_alive()):
            log.warning("FaultProxy on port %d: some threads did not finish within %.0f s",
                        self._port, JOIN_S)

    # --- public state ---------------------------------------------------------------------------------------
    @property
    def upstream(self) -> tuple[str, int]:
        """The ``(host, port)`` forwarded to."""
        return self._upstream

    @property
    def mode(self) -> str:
        """The current mode, one of :data:`MODES`."""
        return self._mode

    @property
    def connections(self) -> int:
        """How many connections were accepted since :meth:`start`, in every mode."""
        return self._connections

    @property
    def open_connections(self) -> int:
        """How many accepted connections are open now (forwarded or held silent)."""
        with self._lock:
            return len(self._conns)

    def set_mode(self, mode: str, *, delay_s: float | None = None, bytes_per_s: float | None = None) -> None:
        """Switch the behaviour for new connections, and for open ones where the mode says so.

        * ``"forward"``: pass bytes both ways.
        * ``"slow"``: forward, sleeping ``delay_s`` before each chunk and/or capping throughput at
          ``bytes_per_s`` per direction; ``delay_s`` defaults to 0.2 s, or to 0 when only ``bytes_per_s`` is
          given. Forwarded connections already open are slowed too (and sped up again by ``"forward"``).
        * ``"silent"``: accept, read and discard, never answer, never close; forwarded connections already
          open stop forwarding the same way (their upstream side is shut down) and stay open until the client
          closes.
        * ``"reset"``: accept and close at once with an RST; open connections are reset too.
        * ``"refuse"``: stop listening (connections are refused); open connections are reset. Leaving this
          mode listens again on the same port (SO_REUSEADDR).

        Returns once the change is in effect (listening socket closed or reopened, open connections closed).

        Raises:
            ValueError: unknown ``mode``, a negative ``delay_s``, a ``bytes_per_s`` that is not positive, or
                ``delay_s``/``bytes_per_s`` given for a mode other than ``"slow"``.
            OSError: the port cannot be bound again after ``"refuse"`` (something else took it meanwhile).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        if mode != "slow" and (delay_s is not None or bytes_per_s is not None):
            raise ValueError(f"delay_s and bytes_per_s only apply to mode 'slow', not {mode!r}")
        if delay_s is not None and delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        if mode == "slow" and delay_s is None:
            delay_s = 0.0 if bytes_per_s is not None else 0.2
        to_kill: list[tuple[_Conn, bool]] = []
        with self._lock:
            started = self._acceptor is not None and not self._stopping.is_set()
            want_listen = mode != "refuse"
            if want_listen and self._listener is None and started:
                self._listener = self._bind()  # raises OSError if the port was taken meanwhile
            self._want_listen = want_listen
            self._mode = mode
            self._delay_s = delay_s or 0.0
            self._bytes_per_s = bytes_per_s
            for conn in self._conns:
                if mode in ("refuse", "reset"):
                    to_kill.append((conn, True))
                elif mode == "silent" and not conn.blackholed:
                    conn.blackholed = True
                    shutdown(conn.upstream, socket.SHUT_RDWR)
        log.debug("FaultProxy on port %d: mode %s", self._port, mode)
        for conn, abort in to_kill:
            self._kill(conn, abort=abort)
        if started and not want_listen:
            self._wait_listener_closed()
        deadline = time.monotonic() + JOIN_S
        for conn, _ in to_kill:
            conn.released.wait(max(0.0, deadline - time.monotonic()))

    # --- internals ------------------------------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, self._port))
            sock.listen(128)
            sock.settimeout(POLL_S)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        return sock

    def _wait_listener_closed(self) -> None:
        with self._listener_closed:
            self._listener_closed.wait_for(lambda: self._listener is None or self._stopping.is_set(), JOIN_S)

    def _spawn(self, target: Callable[..., None], conn: _Conn, *args: object) -> threading.Thread:
        t = threading.Thread(target=target, args=(conn, *args), name=f"FaultProxy-{self._port}", daemon=True)
        self._threads.add(t)
        return t

    def _accept_loop(self) -> None:
        """Accept connections; the only place the listening socket is closed (so ``accept`` never sees a
        closed descriptor)."""
        while True:
            with self._lock:
                listener = self._listener
                if listener is not None and (self._stopping.is_set() or not self._want_listen):
                    listener.close()
                    self._listener = listener = None
                    self._listener_closed.notify_all()
            if self._stopping.is_set():
                return
            if listener is None:
                self._stopping.wait(POLL_S)
                continue
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                log.debug("FaultProxy accept failed: %s", e)
                self._stopping.wait(POLL_S)
                continue
            self._on_accept(client)

    def _on_accept(self, client: socket.socket) -> None:
        with self._lock:
            self._connections += 1
            mode = self._mode
            if mode in ("reset", "refuse") or self._stopping.is_set():
                conn = None
            else:
                client.settimeout(POLL_S)
                conn = _Conn(client, blackholed=mode == "silent")
                self._conns.add(conn)
                thread = self._spawn(self._client_side, conn)
        if conn is None:
            _abort(client)
            return
        thread.start()

    def _kill(self, conn: _Conn, *, abort: bool) -> None:
        """Make the threads of ``conn`` finish soon (they close its sockets, with an RST if ``abort``)."""
        conn.aborted = conn.aborted or abort
        conn.done.set()
        if not abort:  # a shutdown wakes the threads at once, but sends a FIN; an RST must wait for the close
            shutdown(conn.client, socket.SHUT_RDWR)
            shutdown(conn.upstream, socket.SHUT_RDWR)

    def _release(self, conn: _Conn) -> None:
        """One thread of ``conn`` is finished; the last one closes its sockets."""
        with self._lock:
            conn.users -= 1
            last = conn.users == 0
            if last:
                self._conns.discard(conn)
            self._threads.discard(threading.current_thread())
        if not last:
            return
        if conn.aborted:
            _abort(conn.upstream)
            _abort(conn.client)
        else:
            for sock in (conn.upstream, conn.client):
                if sock is not None:
                    sock.close()
        conn.released.set()

    def _client_side(self, conn: _Conn) -> None:
        """The connection's first thread: connect upstream (unless silent), then pump client -> upstream."""
        try:
            if not conn.blackholed:
                try:
                    upstream = socket.create_connection(self._upstream, timeout=_UPSTREAM_CONNECT_S)
                except OSError as e:
                    log.debug("FaultProxy: cannot connect to upstream %s:%d: %s", *self._upstream, e)
                    conn.aborted = True
                    return
                upstream.settimeout(POLL_S)
                with self._lock:
                    conn.upstream = upstream
                    if conn.blackholed or conn.done.is_set():  # the mode changed while connecting
                        shutdown(upstream, socket.SHUT_RDWR)
                    else:
                        conn.users += 1
                        self._spawn(self._upstream_side, conn).start()
            self._pump(conn, conn.client, conn.upstream, to_upstream=True)
        finally:
            self._release(conn)

    def _upstream_side(self, conn: _Conn) -> None:
        try:
            self._pump(conn, conn.upstream, conn.client, to_upstream=False)
        finally:
            self._release(conn)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket | None, *, to_upstream: bool) -> None:
        """Copy ``src`` to ``dst`` until EOF, an error or ``conn.done``; a blackholed connection reads from
        the client and discards (the upstream direction just ends)."""
        while not conn.done.is_set():
            if conn.blackholed and not to_upstream:
                return
            try:
                data = src.recv(CHUNK)
            except TimeoutError:
                continue
            except OSError:
                if not conn.blackholed or to_upstream:
                    self._kill(conn, abort=True)  # a reset on one side resets the other
                return
            if not data:
                if conn.blackholed:
                    if to_upstream:  # the client closed a silent connection
                        conn.done.set()
                    return
                shutdown(dst, socket.SHUT_WR)  # pass the half-close on
                return
            if conn.blackholed or dst is None:
                continue
            if not self._send(conn, dst, data):
                return

    def _send(self, conn: _Conn, dst: socket.socket, data: bytes) -> bool:
        """Send all of ``data``, slowed as the current mode says; False if the connection ended meanwhile."""
        with self._lock:
            slow = self._mode == "slow"
            delay_s, bytes_per_s = self._delay_s, self._bytes_per_s
        if slow and delay_s > 0 and conn.done.wait(delay_s):
            return False
        piece = len(data) if not slow or bytes_per_s is None else max(1, int(bytes_per_s * POLL_S))
        view = memoryview(data)
        while view:
            part, view = view[:piece], view[piece:]
            size, began = len(part), time.monotonic()
            while part:
                if conn.done.is_set() or conn.blackholed:
                    return False
                try:
                    n = dst.send(part)
                except TimeoutError:
                    continue
                except OSError:
                    self._kill(conn, abort=True)
                    return False
                part = part[n:]
            if slow and bytes_per_s is not None:
                wait = size / bytes_per_s - (time.monotonic() - began)
                if wait > 0 and conn.done.wait(wait):
                    return False
        return True
