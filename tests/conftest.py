"""Shared fixtures: a real S3-protocol server on loopback (moto), stores of every backend, hand-built steps.

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

from tierckpt.format import hashing, layout
from tierckpt.format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from tierckpt.format.safetensors import build_header
from tierckpt.storage.base import Store, join
from tierckpt.storage.commit import protocol_for

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


# --- hand-built steps ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuiltStep:
    step: int
    save_id: str
    manifest: StepManifest
    rank_manifest: RankManifest
    files: dict[str, bytes]  # data file name -> bytes


def build_step(step: int, *, save_id: str | None = None, sizes: tuple[int, ...] = (4096, 1000, 0, 37),
               n_files: int = 2, zeros: bool = False, seed: int = 0) -> BuiltStep:
    """A valid one-rank step: ``n_files`` safetensors files holding U8 tensors of ``sizes`` bytes each (random
    bytes, or zeros), with correct segment checksums, a rank manifest and a step manifest."""
    import random

    rng = random.Random(seed * 1000 + step)
    save_id = save_id or layout.new_save_id()
    files: dict[str, bytes] = {}
    file_records = []
    tensor_records = []
    index = 0
    for part in range(n_files):
        entries = [(f"t{part}_{i}", "U8", (n,), n) for i, n in enumerate(sizes)]
        header = build_header(entries, {"format": "pt"})
        payloads = [bytes(n) if zeros else rng.randbytes(n) for n in sizes]
        digests = [hashing.digest(header)]
        offset = len(header)
        for (name, dtype, shape, n), payload in zip(entries, payloads):
            d = hashing.digest(payload)
            digests.append(d)
            tensor_records.append(TensorRecord(index, name, f"state[{name!r}]", dtype, shape, part, offset, n, d.hex()))
            offset += n
            index += 1
        data = header + b"".join(payloads)
        fname = layout.data_file_name(0, part, save_id)
        files[fname] = data
        file_records.append(FileRecord(fname, len(data), hashing.file_checksum(digests), len(header)))
    rm = RankManifest(step=step, rank=0, world_size=1, save_id=save_id, files=tuple(file_records),
                      tensors=tuple(tensor_records), tree={"kind": "test"}, metadata={"built": "by hand"})
    raw = rm.to_bytes()
    rname = layout.rank_manifest_name(0, save_id)
    sm = StepManifest(step=step, world_size=1, save_id=save_id,
                      ranks=(RankRef(0, rname, len(raw), hashing.digest(raw).hex()),), total_bytes=rm.total_bytes,
                      metadata={"built": "by hand"})
    return BuiltStep(step, save_id, sm, rm, files)


def write_step(store: Store, built: BuiltStep, *, commit: bool = True) -> str:
    """Write a built step through the store's commit protocol; returns the staging folder. With ``commit=False``
    the data and rank manifest are written but neither ``manifest.json`` nor the commit (a crash's leftover)."""
    protocol = protocol_for(store)
    staging = protocol.begin(store, built.step, layout.new_save_id())
    for name, data in built.files.items():
        with store.open_write(join(staging, name), size_hint=len(data)) as w:
            w.write(data)
    rname = built.manifest.ranks[0].name
    store.write_bytes(join(staging, rname), built.rank_manifest.to_bytes())
    if commit:
        store.write_bytes(join(staging, layout.STEP_MANIFEST), built.manifest.to_bytes())
        protocol.commit(store, staging, built.step)
    return staging
