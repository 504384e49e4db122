"""Shared fixtures: a real S3-protocol server on loopback (moto), stores of every backend.

The S3 server is started once per session (``ThreadedMotoServer`` on 127.0.0.1, port chosen by the OS); each test
gets its own bucket. Credentials are dummies set in the environment only while the session runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tierckpt.storage.base import Store

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_SESSION_TOKEN": "testing-token",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_bucket_ids = itertools.count()


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def storage_options(self) -> dict:
        return {
            "key": _S3_ENV["AWS_ACCESS_KEY_ID"],
            "secret": _S3_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint_url},
        }


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A moto S3 server on loopback for the whole session (skipped if moto's server extra is missing)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(_S3_ENV)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with socket.create_connection((host, port), timeout=5):
        pass
    try:
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_admin(s3_server: S3Server):
    """One s3fs instance for creating and removing test buckets (making a client costs ~0.3 s)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **s3_server.storage_options())


@pytest.fixture
def s3_bucket(s3_admin) -> Iterator[str]:
    """A fresh, empty bucket; yields its ``s3://`` URL."""
    name = f"tierckpt-test-{next(_bucket_ids)}-{secrets.token_hex(3)}"
    s3_admin.mkdir(name)
    try:
        yield f"s3://{name}"
    finally:
        try:
            s3_admin.rm(name, recursive=True)
        except Exception:
            pass


STORE_KINDS = ["local", "posix_remote", "memory", "s3"]


@pytest.fixture
def torch_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host tensors are copied by torch's ``copy_`` and the copy threads (the path where the native copy is not
    built), instead of :mod:`tierckpt.snapshot.hostcopy`."""
    from tierckpt.snapshot import hostcopy

    monkeypatch.setattr(hostcopy, "available", False)


@pytest.fixture
def make_store(request, tmp_path) -> Iterator[Callable[..., Store]]:
    """``make_store(kind, name="root")``: a store of one backend, rooted in a fresh place for this test."""
    from tierckpt.storage.fsspec_store import FsspecStore
    from tierckpt.storage.local import LocalStore
    from tierckpt.storage.open import open_store

    made: list[Store] = []
    memory_roots: list[str] = []

    def make(kind: str, name: str = "root", **kw) -> Store:
        if kind == "local":
            store: Store = LocalStore(tmp_path / name, tier="local")
        elif kind == "posix_remote":
            store = open_store(str(tmp_path / f"remote-{name}"), tier="remote")
        elif kind == "memory":
            root = f"memory://tierckpt-{secrets.token_hex(6)}/{name}"
            memory_roots.append(root)
            store = FsspecStore(root, tier="remote", **kw)
        elif kind == "s3":
            bucket = request.getfixturevalue("s3_bucket")
            server = request.getfixturevalue("s3_server")
            kw.setdefault("part_size", 5 << 20)  # the S3 minimum, so multipart is exercised by small tests
            store = FsspecStore(f"{bucket}/{name}", storage_options=server.storage_options(), tier="remote", **kw)
        else:  # pragma: no cover
            raise ValueError(kind)
        made.append(store)
        return store

    yield make
    for root in memory_roots:
        import fsspec

        fs = fsspec.filesystem("memory")
        try:
            fs.rm(root.split("://", 1)[1].split("/", 1)[0], recursive=True)
        except FileNotFoundError:
            pass
    for store in made:
        store.close()


@pytest.fixture(params=STORE_KINDS)
def store(request, make_store) -> Store:
    """One store per backend kind (the contract suite runs once for each)."""
    return make_store(request.param)
