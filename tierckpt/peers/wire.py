"""The peer channel's wire format: length-prefixed JSON messages and files streamed in chunks, each followed by
its checksum, over one TCP connection with a deadline on every operation.

A message is a 4-byte big-endian length and that many bytes of JSON (at most :data:`MAX_MESSAGE_BYTES`: a message
never carries a file list longer than :data:`MAX_FILES` entries). A file is its bytes, exactly the size its header
announced, streamed :data:`CHUNK` at a time, then a message ``{"digest": <xxh3-128 hex>}`` of those bytes; the
receiver hashes as it writes and refuses a file whose digest differs. Nothing read from the wire is unpickled, and
every file name is checked to be one plain path component (:func:`tierckpt.format.layout.check_file_name`).

Every socket carries a timeout (the peer channel's deadline), so a silent peer fails the transfer after that long
instead of hanging the thread. Memory per transfer: one chunk buffer.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from ..format import hashing, layout

#: A message (header or reply) never exceeds this many bytes.
MAX_MESSAGE_BYTES = 1 << 20
#: A transfer names at most this many files (a node's step: its ranks' data files and manifests).
MAX_FILES = 65536
#: Bytes moved per send/receive and held per transfer.
CHUNK = 4 << 20

_LEN = struct.Struct(">I")


class PeerError(Exception):
    """A transfer failed: the peer is unreachable, hung past the deadline, broke the protocol, or a checksum
    differed. Always caught by the peer component: a peer copy never fails a save."""


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one JSON message. Raises PeerError for one over :data:`MAX_MESSAGE_BYTES`, OSError if the socket fails."""
    raw = json.dumps(obj, separators=(",", ":")).encode()
    if len(raw) > MAX_MESSAGE_BYTES:
        raise PeerError(f"a message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    sock.sendall(_LEN.pack(len(raw)) + raw)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes. Raises PeerError if the peer closes first, OSError (``TimeoutError``) past the deadline."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Any:
    """One JSON message. Raises PeerError for a length over :data:`MAX_MESSAGE_BYTES` or malformed JSON."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE_BYTES:
        raise PeerError(f"the peer announced a message of {n} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        return json.loads(recv_exact(sock, n))
    except ValueError as exc:
        raise PeerError(f"malformed message: {exc}") from None


def check_files(files: Any) -> list[tuple[str, int]]:
    """A header's ``[[name, size], ...]``, checked: bounded count, safe names, non-negative int sizes."""
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise PeerError("malformed file list")
    out = []
    for item in files:
        if not (isinstance(item, list) and len(item) == 2 and type(item[1]) is int and item[1] >= 0):
            raise PeerError(f"malformed file entry {item!r:.80}")
        out.append((layout.check_file_name(item[0]), item[1]))
    return out


def send_file(sock: socket.socket, path: str, size: int, *, throttle: Callable[[int], None] | None = None) -> None:
    """Stream ``size`` bytes of the file at ``path`` and then their digest. Raises PeerError if the file is not
    that size any more (retention removed or replaced it), OSError for the socket or the file."""
    h = hashing.Hasher()
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    sent = 0
    with open(path, "rb", buffering=0) as f:
        while sent < size:
            k = f.readinto(view[: min(len(buf), size - sent)])
            if not k:
                raise PeerError(f"{path} ended after {sent} of {size} bytes")
            h.update(view[:k])
            sock.sendall(view[:k])
            sent += k
            if throttle is not None:
                throttle(k)
    send_msg(sock, {"digest": h.hexdigest()})


def send_bytes(sock: socket.socket, data: bytes) -> None:
    """Stream ``data`` as a file's bytes, then their digest (what :func:`send_file` sends for a file of them)."""
    view = memoryview(data)
    for start in range(0, len(view), CHUNK):
        sock.sendall(view[start : start + CHUNK])
    send_msg(sock, {"digest": hashing.digest(data).hex()})


def recv_file(sock: socket.socket, path: str, size: int) -> None:
    """Receive ``size`` bytes into a new file at ``path`` (fsync-ed), then the sender's digest, checked against
    the bytes received. Raises PeerError on a short stream or a digest that differs (the file is left for the
    caller's temporary folder to remove), OSError for the socket or the disk."""
    h = hashing.Hasher()
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    got = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while got < size:
            k = sock.recv_into(view, min(len(buf), size - got))
            if k == 0:
                raise PeerError(f"the peer closed the connection after {got} of {size} bytes of {path}")
            h.update(view[:k])
            mv = view[:k]
            while mv:
                mv = mv[os.write(fd, mv):]
            got += k
        os.fsync(fd)
    finally:
        os.close(fd)
    reply = recv_msg(sock)
    if not isinstance(reply, dict) or reply.get("digest") != h.hexdigest():
        raise PeerError(f"checksum mismatch on receipt of {path}")
