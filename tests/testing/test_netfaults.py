"""The network fault-injection kit (tierckpt.testing.netfaults): a FaultProxy in front of an echo server and
of a real S3-protocol server (moto), the DenyingServer, and the refused-port helpers."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tierckpt.testing import DenyingServer, FaultProxy, refused_url, unused_port


class EchoServer:
    """A loopback TCP server that sends back whatever it receives, one thread per connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.threads.append(threading.Thread(target=self._accept, daemon=True))
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _echo(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        with conn:
            while not self.stopping.is_set():
                try:
                    data = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def close(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(2)
        self.sock.close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    with FaultProxy(f"127.0.0.1:{echo.port}") as p:
        yield p


def roundtrip(port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_forward_roundtrips_bytes_both_ways(proxy: FaultProxy):
    assert proxy.url == f"http://127.0.0.1:{proxy.port}" and proxy.port > 0 and proxy.mode == "forward"
    assert roundtrip(proxy.port, b"hello") == b"hello"
    big = bytes(range(256)) * 4096  # 1 MiB: several chunks each way
    assert roundtrip(proxy.port, big) == big
    assert proxy.connections == 2


def test_refuse_then_forward_again_on_the_same_port(proxy: FaultProxy):
    port = proxy.port
    with socket.create_connection(("127.0.0.1", port), timeout=2) as held:  # open before the switch
        held.sendall(b"x")
        assert held.recv(10) == b"x"
        proxy.set_mode("refuse")
        assert proxy.mode == "refuse"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        try:  # the open connection was reset, not left forwarding
            assert held.recv(10) == b""
        except ConnectionResetError:
            pass
    proxy.set_mode("forward")
    assert proxy.port == port
    assert roundtrip(port, b"back again") == b"back again"


def test_silent_accepts_and_never_answers(proxy: FaultProxy):
    proxy.set_mode("silent")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as s:
        s.sendall(b"anyone there?" * 1000)
        s.settimeout(0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            s.recv(10)
        assert time.monotonic() - t0 >= 0.45
    assert proxy.connections == 1


def test_silent_stops_forwarding_on_open_connections(proxy: FaultProxy):
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as s:
        s.sendall(b"ping")
        assert s.recv(10) == b"ping"
        proxy.set_mode("silent")
        s.sendall(b"ping")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(10)


def test_reset_closes_with_rst(proxy: FaultProxy):
    proxy.set_mode("reset")
    for _ in range(3):
        # the RST can even beat connect() back to the client; wherever it lands, no byte is ever answered
        with pytest.raises(ConnectionResetError):  # noqa: SIM117 - the error may come from either line
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as s:
                time.sleep(0.05)  # let the proxy accept and reset
                s.sendall(b"x")
                s.recv(10)
    assert proxy.connections == 3


def test_slow_delays_each_chunk_and_forward_restores_speed(proxy: FaultProxy):
    proxy.set_mode("slow", delay_s=0.3)
    t0 = time.monotonic()
    assert roundtrip(proxy.port, b"slowly") == b"slowly"
    assert time.monotonic() - t0 >= 0.3
    proxy.set_mode("forward")
    t0 = time.monotonic()
    assert roundtrip(proxy.port, b"fast") == b"fast"
    assert time.monotonic() - t0 < 0.25


def test_slow_caps_throughput(proxy: FaultProxy):
    proxy.set_mode("slow", bytes_per_s=40_000)
    payload = b"z" * 20_000  # 0.5 s at the cap (the echo overlaps the two directions)
    t0 = time.monotonic()
    assert roundtrip(proxy.port, payload) == payload
    assert 0.35 <= time.monotonic() - t0 < 3


def test_bad_arguments_are_rejected(echo: EchoServer):
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("http://192.0.2.1:80")
    with pytest.raises(ValueError):
        FaultProxy("127.0.0.1")
    p = FaultProxy(f"http://127.0.0.1:{echo.port}/ignored/path")
    assert p.upstream == ("127.0.0.1", echo.port)
    with pytest.raises(ValueError, match="unknown mode"):
        p.set_mode("flaky")
    with pytest.raises(ValueError):
        p.set_mode("forward", delay_s=1)
    with pytest.raises(ValueError):
        p.set_mode("slow", bytes_per_s=0)


def test_stop_is_prompt_and_idempotent_with_open_connections(echo: EchoServer):
    p = FaultProxy(f"127.0.0.1:{echo.port}").start()
    assert p.start() is p
    fwd = socket.create_connection(("127.0.0.1", p.port), timeout=2)
    fwd.sendall(b"a")
    assert fwd.recv(1) == b"a"
    p.set_mode("silent")
    held = socket.create_connection(("127.0.0.1", p.port), timeout=2)
    t0 = time.monotonic()
    p.stop()
    p.stop()
    assert time.monotonic() - t0 < 2
    assert p.open_connections == 0
    for s in (fwd, held):
        with s:
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", p.port), timeout=2)
    with pytest.raises(RuntimeError):
        p.start()


def test_upstream_down_resets_the_client():
    with FaultProxy(f"127.0.0.1:{unused_port()}") as p:
        try:  # the reset may come before the connect returns, or on the first read
            with socket.create_connection(("127.0.0.1", p.port), timeout=2) as s:
                assert s.recv(10) == b""
        except ConnectionResetError:
            pass
        assert p.connections == 1


def test_refused_url_is_refused():
    url = refused_url()
    assert url.startswith("http://127.0.0.1:")
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


# --- DenyingServer ------------------------------------------------------------------------------------------
def test_denying_server_answers_403_access_denied():
    with DenyingServer() as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/bucket/key")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 403 and resp.getheader("Content-Type") == "application/xml"
        assert b"<Code>AccessDenied</Code>" in body and int(resp.getheader("Content-Length")) == len(body)
        # the same (kept-alive) connection: the PUT body is read and discarded, so the next request parses
        conn.request("PUT", "/bucket/key", body=b"x" * 100_000)
        resp = conn.getresponse()
        assert resp.status == 403 and b"<Code>AccessDenied</Code>" in resp.read()
        conn.request("HEAD", "/bucket/key")
        resp = conn.getresponse()
        assert resp.status == 403 and resp.read() == b""
        conn.request("DELETE", "/bucket/key")
        assert conn.getresponse().status == 403
        conn.close()
        assert server.requests == 4


def test_denying_server_stop_closes_open_connections():
    server = DenyingServer().start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("POST", "/", body=b"{}")
    assert conn.getresponse().read().startswith(b"<Error>")
    t0 = time.monotonic()
    server.stop()
    server.stop()
    assert time.monotonic() - t0 < 2
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)
    conn.close()


# --- in front of a real S3-protocol server ------------------------------------------------------------------
def test_s3fs_through_the_proxy(s3_server, s3_bucket):
    s3fs = pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    opts = s3_server.storage_options()
    with FaultProxy(s3_server.endpoint_url) as p:
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, key=opts["key"], secret=opts["secret"],
            client_kwargs={"endpoint_url": p.url},
            config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
        )
        # s3fs retries each call 5 times with backoff on top of botocore's attempts: a black-holed ls would
        # take ~15 s; 2 keeps the retry path exercised and the test short
        fs.retries = 2
        fs.pipe(f"{s3_bucket}/obj", b"payload")
        assert [x.rsplit("/", 1)[1] for x in fs.ls(s3_bucket)] == ["obj"]
        assert p.connections >= 1
        for mode in ("silent", "refuse", "reset"):
            p.set_mode(mode)
            t0 = time.monotonic()
            with pytest.raises(Exception):  # noqa: B017 - whichever error the client stack raises
                fs.ls(s3_bucket)
            assert time.monotonic() - t0 < 15, mode
        p.set_mode("forward")
        assert fs.cat(f"{s3_bucket}/obj") == b"payload"
