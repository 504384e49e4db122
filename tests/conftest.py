"""Shared fixtures: a real S3-protocol server on loopback (moto), stores of every backend; how the suite shares
parallel workers.

The S3 server is started once per session (``ThreadedMotoServer`` on 127.0.0.1, port chosen by the OS); each test
gets its own bucket. Credentials are dummies set in the environment only while the session runs. Under
pytest-xdist (``scripts/test.sh`` runs ``--dist loadfile``, two workers a core) a session is one worker:
each worker has its own server, on its own port, and its own buckets.

Parallel runs: a test file runs whole on one worker (its module-scoped fixtures are built once), the files that
import Lightning or transformers all on the same worker (:data:`SAME_WORKER`), the files with the slowest work
are handed out first (:data:`SLOW_FIRST`), and the tests that measure a process's memory, mount a
file system or drop the page cache take turns across workers (:data:`SERIAL`, :data:`SERIAL_FIXTURES`).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")  # each worker has its own server, and its own names
    name = f"tierckpt-test-{worker}-{next(_bucket_ids)}-{secrets.token_hex(3)}"
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


# --------------------------------------------------------------------------------------------- parallel workers
#: Tests that must not run at the same time as another test of their group, on any worker, by node id prefix (a
#: module, or a test of it): "process-memory", they measure a process's memory (its RSS, peak, huge pages, traced
#: allocations, an address-space limit); "page-cache", they drop the whole machine's page cache (the benchmarks'
#: cold reads) or assert how much of a file it holds.
SERIAL = {
    "tests/snapshot/test_staging_memory.py": "process-memory",
    "tests/snapshot/test_staging_huge_pages.py": "process-memory",
    "tests/reliability/test_soak.py": "process-memory",
    "tests/reliability/test_resource_limits.py": "process-memory",
    "tests/reliability/test_hostile.py": "process-memory",
    "tests/bench/test_adjacent.py": "page-cache",
    "tests/bench/test_restart.py": "page-cache",
    "tests/storage/test_local_direct_reads.py": "page-cache",
    "tests/tiers/test_bounce.py": "page-cache",
    "tests/engine/test_restore_guarded.py": "page-cache",
    "tests/cli/test_remote.py::test_sync_writes_a_posix_remote_around_the_page_cache": "page-cache",
}
#: The same by a fixture the test uses: "mount", they mount a tmpfs (root only).
SERIAL_FIXTURES = {"tiny_fs": "mount", "read_only_dir": "mount"}

#: The files with the slowest work (about 10 s or more on 2 cores, see --durations), handed out first in this
#: order; the other files follow in collection order. A missing or renamed entry only changes the order.
SLOW_FIRST = (
    "tests/project/test_examples.py",
    "tests/distributed/test_multi_process.py",
    "tests/bench/test_request_counts.py",
    "tests/integrations/test_lightning.py",
    "tests/reliability/test_resource_limits.py",
    "tests/reliability/test_outage.py",
    "tests/integrations/test_dcp.py",
    "tests/distributed/test_reshard.py",
    "tests/reliability/test_rollback_uploads.py",
    "tests/reliability/test_shared_remote.py",
    "tests/cli/test_faults.py",
    "tests/reliability/test_remote_s3_faults.py",
    "tests/bench/test_restart.py",
    "tests/storage/test_s3upload.py",
    "tests/integrations/test_teardown_outage.py",
)


#: Files that run on one worker, one after another, because they import the same heavy frameworks (Lightning,
#: transformers: about 7 s of CPU for each worker that imports them); the first of them in :data:`SLOW_FIRST` order
#: sets the group's place.
SAME_WORKER = {
    path: "frameworks"
    for path in ("tests/integrations/test_lightning.py", "tests/integrations/test_lightning_logging.py",
                 "tests/integrations/test_hf.py", "tests/integrations/test_hf_logging.py",
                 "tests/integrations/test_teardown_outage.py", "tests/integrations/test_export.py",
                 "tests/docs/test_doc_blocks.py")
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` hands out whole files, and the files of :data:`SAME_WORKER` as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SAME_WORKER.get(path, path)

    return Scheduling(config, log)


def _serial_group(item: pytest.Item) -> str | None:
    for prefix, group in SERIAL.items():
        if item.nodeid == prefix or item.nodeid.startswith((prefix + "::", prefix + "[")):
            return group
    return next((SERIAL_FIXTURES[n] for n in getattr(item, "fixturenames", ()) if n in SERIAL_FIXTURES), None)


@pytest.fixture(autouse=True)
def _serial_across_workers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, a test of a serial group (:data:`SERIAL`, :data:`SERIAL_FIXTURES`) holds its
    group's lock, a file shared by this run's workers only, for its whole length (set up before its other
    fixtures)."""
    group = _serial_group(request.node)
    if group is None or not hasattr(request.config, "workerinput"):
        yield
        return
    import fcntl

    # a worker's base folder is <this run's folder>/popen-gwN: the parent is this run's, and no other run's
    path = tmp_path_factory.getbasetemp().parent / f"serial-{group}.lock"
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker: the files of :data:`SLOW_FIRST` first, in its order (``--dist loadfile`` hands
    out whole files in collection order with ``--no-loadscope-reorder``), so that the workers finish together.
    Every worker sorts alike; a run without xdist is left as collected."""
    if not hasattr(config, "workerinput"):
        return
    rank = {prefix: i for i, prefix in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(SLOW_FIRST)))  # stable: files stay whole
