"""An HTTP server on loopback that answers every request with an S3-style error (:class:`DenyingServer`): an
endpoint that is reachable but refuses access.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._loopback import CHUNK, JOIN_S, LOOPBACK, POLL_S, Endpoint, shutdown

log = logging.getLogger(__name__)


class _DenyingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _DenyingHTTPServer
    timeout = 30  # an idle keep-alive connection is dropped after this

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.open_sockets.add(self.connection)

    def finish(self) -> None:
        with self.server.lock:
            self.server.open_sockets.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _discard_body(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size_line = self.rfile.readline(1024)
                if not size_line:
                    return
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return
                self._skip(size + 2)
        else:
            self._skip(int(self.headers.get("Content-Length") or 0))

    def _skip(self, n: int) -> None:
        while n > 0:
            got = self.rfile.read(min(n, CHUNK))
            if not got:
                return
            n -= len(got)

    def _deny(self) -> None:
        with self.server.lock:
            self.server.requests += 1
        try:
            self._discard_body()
        except (OSError, ValueError):
            self.close_connection = True
        body = self.server.body
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.send_header("x-amz-request-id", "DENYINGSERVER")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _deny


class _DenyingHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int, body: bytes) -> None:
        self.lock = threading.Lock()
        self.open_sockets: set[socket.socket] = set()
        self.requests = 0
        self.status = status
        self.body = body
        super().__init__((LOOPBACK, 0), _DenyingHandler)

    def handle_error(self, request: object, client_address: object) -> None:
        log.debug("DenyingServer: a connection from %s failed", client_address, exc_info=True)


class DenyingServer(Endpoint):
    """An HTTP server on 127.0.0.1 answering every request with an S3-style error.

    GET, HEAD, PUT, POST and DELETE all get, by default, ``403`` and
    ``<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>``.

    A request body, if any (``Content-Length`` or chunked), is read and discarded; HEAD answers carry no body.
    Connections are kept alive (HTTP/1.1). Request logging is silenced.

    Args:
        status: the HTTP status of every answer.
        code: the ``<Code>`` of the XML error body.
        message: the ``<Message>`` of the XML error body.

    Use as a context manager (``with DenyingServer() as server:``) or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, *, status: int = 403, code: str = "AccessDenied",
                 message: str = "Access Denied") -> None:
        #: the HTTP status of every answer
        self.status = status
        #: the XML error document every answer (but HEAD's) carries
        self.body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        self._server: _DenyingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self._requests_before = 0

    def start(self) -> DenyingServer:
        """Bind a port chosen by the OS and start serving; a no-op if already started.

        Returns:
            ``self``.

        Raises:
            OSError: no port could be bound.
        """
        if self._server is not None:
            return self
        server = _DenyingHTTPServer(self.status, self.body)
        server.requests = self._requests_before
        self._port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_S},
                                        name=f"DenyingServer-{self._port}", daemon=True)
        self._server = server
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket and every open connection. Idempotent; never raises."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with server.lock:
            sockets = list(server.open_sockets)
            self._requests_before = server.requests
        for sock in sockets:
            shutdown(sock, socket.SHUT_RDWR)  # the handler thread then finishes and closes it
        if self._thread is not None:
            self._thread.join(JOIN_S)

    @property
    def requests(self) -> int:
        """How many requests were answered (counted when each request arrives)."""
        server = self._server
        if server is None:
            return self._requests_before
        with server.lock:
            return server.requests
