"""What the network fault tools share: loopback addresses only, the polling timeout of their loops, the
endpoint base (a port, its URL, use as a context manager) and loopback ports nothing listens on.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import TypeVar

LOOPBACK = "127.0.0.1"
POLL_S = 0.1  # the timeout of every blocking socket call and wait in the tools' loops
CHUNK = 64 * 1024  # bytes received (or skipped) at a time
JOIN_S = 2.0  # how long stopping waits for a tool's threads


def shutdown(sock: socket.socket | None, how: int) -> None:
    """``sock.shutdown(how)``, ignoring a socket that is already closed or disconnected."""
    if sock is None:
        return
    try:
        sock.shutdown(how)
    except OSError:
        pass


_E = TypeVar("_E", bound="Endpoint")


class Endpoint:
    """What both fault endpoints share: a loopback port, its URL, and use as a context manager."""

    _port: int

    def start(self: _E) -> _E:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _E) -> _E:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The listening port (0 until :meth:`start` when the OS chooses it)."""
        return self._port

    @property
    def url(self) -> str:
        """``"http://127.0.0.1:<port>"``, the endpoint URL to give clients."""
        return f"http://{LOOPBACK}:{self._port}"


def unused_port() -> int:
    """A loopback TCP port with nothing listening on it (bound to port 0, read, closed).

    Returns:
        The port number. Nothing stops another process from taking it afterwards, so use it at once.

    Raises:
        OSError: no socket could be bound.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def refused_url() -> str:
    """``"http://127.0.0.1:<port>"`` for an :func:`unused_port`: connecting to it is refused.

    Returns:
        The URL.

    Raises:
        OSError: no socket could be bound.
    """
    return f"http://{LOOPBACK}:{unused_port()}"
