"""Ranged reads kept in flight (``storage/readahead.py``): the helper itself, then restores, verification and the CLI
reading from the moto S3 server on loopback with several reads of one file in flight."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import pytest
import torch

from tests._support.helpers import REPO_ROOT, assert_tree_equal, cli_output, subprocess_env
from tests._support.procs import run_python
from tests._support.steps import build_step, write_step
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.format import layout
from tierckpt.storage.faulty import FaultyFileSystem
from tierckpt.storage.fsspec_store import DEFAULT_READ_CONCURRENCY, FsspecStore
from tierckpt.storage.readahead import ReadAhead, each
from tierckpt.tiers import reader
from tierckpt.tiers.listing import list_root
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.verify import verify_step

pytestmark = pytest.mark.timeout(180)


class _File:
    """A file's bytes behind a ``read(offset, view)`` that counts reads in flight and can be slowed or broken."""

    def __init__(self, data: bytes, *, delay: float = 0.0, fail_at: int | None = None, short_at: int | None = None):
        self.data, self.delay, self.fail_at, self.short_at = data, delay, fail_at, short_at
        self.lock = threading.Lock()
        self.inflight = self.max_inflight = self.calls = 0
        self.threads: set[str] = set()

    def read(self, offset: int, view: memoryview) -> int:
        with self.lock:
            self.inflight += 1
            self.calls += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            self.threads.add(threading.current_thread().name)
        try:
            if self.delay:
                time.sleep(self.delay)
            if self.fail_at is not None and offset <= self.fail_at < offset + len(view):
                raise ConnectionResetError(f"injected: read at {offset}")
            end = len(self.data) if self.short_at is None else self.short_at
            got = self.data[offset : min(end, offset + len(view), offset + 1000)]  # short reads: callers must loop
            view[: len(got)] = got
            return len(got)
        finally:
            with self.lock:
                self.inflight -= 1


def _data(n: int) -> bytes:
    return bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8).numpy())


@pytest.mark.parametrize("size,chunk,window", [(0, 4096, 4), (1, 4096, 4), (4096, 4096, 4), (10_000, 4096, 1),
                                               (10_000, 4096, 3), (100_003, 7000, 8), (100_003, 7000, 64)])
@pytest.mark.parametrize("into", [True, False])
def test_chunks_come_back_in_order_and_exact(size: int, chunk: int, window: int, into: bool) -> None:
    f = _File(_data(size))
    out = memoryview(bytearray(size)) if into else None
    got, offsets = bytearray(), []
    with ReadAhead(f.read, 0, size, chunk=chunk, window=window, into=out) as chunks:
        for pos, view in chunks:
            offsets.append(pos)
            assert len(view) == min(chunk, size - pos)
            got += view
    assert bytes(got) == f.data
    assert offsets == list(range(0, size, chunk))
    if into:
        assert bytes(out) == f.data  # read in place, not into buffers of its own


def test_a_sub_range_and_its_offsets() -> None:
    f = _File(_data(50_000))
    with ReadAhead(f.read, 1234, 40_000, chunk=5000, window=4) as chunks:
        parts = [(pos, bytes(view)) for pos, view in chunks]
    assert [p for p, _ in parts] == list(range(1234, 40_000, 5000))
    assert b"".join(b for _, b in parts) == f.data[1234:40_000]


def test_several_reads_are_in_flight_but_never_more_than_the_window() -> None:
    f = _File(_data(64 * 1000), delay=0.01)
    with ReadAhead(f.read, 0, len(f.data), chunk=1000, window=6) as chunks:
        assert b"".join(bytes(v) for _, v in chunks) == f.data
    assert 2 <= f.max_inflight <= 6
    assert all(name.startswith("tierckpt-readahead") for name in f.threads)


def test_window_one_reads_on_the_callers_thread_one_at_a_time() -> None:
    f = _File(_data(20_000), delay=0.001)
    with ReadAhead(f.read, 0, len(f.data), chunk=3000, window=1) as chunks:
        assert b"".join(bytes(v) for _, v in chunks) == f.data
    assert f.max_inflight == 1
    assert f.threads == {threading.current_thread().name}


def test_without_into_memory_is_bounded_by_the_window() -> None:
    f = _File(_data(200 * 1000))
    buffers: set[int] = set()
    with ReadAhead(f.read, 0, len(f.data), chunk=1000, window=4) as chunks:
        for _, view in chunks:
            buffers.add(id(view.obj))
    assert len(buffers) <= 5  # window + the one handed back


def test_a_file_shorter_than_asked_ends_the_chunks_early() -> None:
    f = _File(_data(50_000), short_at=23_456)
    with ReadAhead(f.read, 0, 50_000, chunk=5000, window=4) as chunks:
        got = b"".join(bytes(v) for _, v in chunks)
    assert got == f.data[:23_456]


def test_a_failed_read_raises_at_its_chunk_and_leaves_nothing_running() -> None:
    f = _File(_data(60_000), delay=0.002, fail_at=31_000)
    seen = bytearray()
    with pytest.raises(ConnectionResetError, match="injected"), \
            ReadAhead(f.read, 0, 60_000, chunk=5000, window=8) as chunks:
        for _, view in chunks:
            seen += view
    assert bytes(seen) == f.data[:30_000]  # every chunk before the bad one, in order, and nothing after it
    assert f.inflight == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("tierckpt-readahead")]


def test_check_stops_new_reads_and_close_waits_for_running_ones() -> None:
    f = _File(_data(80_000), delay=0.005)
    stop = threading.Event()

    def check() -> None:
        if stop.is_set():
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"), \
            ReadAhead(f.read, 0, 80_000, chunk=1000, window=4, check=check) as chunks:
        for i, _ in enumerate(chunks):
            if i == 3:
                stop.set()
    assert f.inflight == 0
    assert f.calls < 80  # it stopped well before the end


def test_bad_arguments_are_refused() -> None:
    f = _File(b"x" * 10)
    with pytest.raises(ValueError, match="chunk"):
        ReadAhead(f.read, 0, 10, chunk=0, window=2)
    with pytest.raises(ValueError, match="range"):
        ReadAhead(f.read, 5, 4, chunk=1, window=2)
    with pytest.raises(ValueError, match="into"):
        ReadAhead(f.read, 0, 10, chunk=4, window=2, into=memoryview(bytearray(9)))


def test_each_keeps_order_overlaps_requests_and_raises_the_first_error() -> None:
    lock, state = threading.Lock(), {"now": 0, "max": 0}

    def slow_square(x: int) -> int:
        with lock:
            state["now"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(0.005)
        with lock:
            state["now"] -= 1
        if x in (7, 11):
            raise KeyError(x)
        return x * x

    assert each(slow_square, list(range(7)), concurrency=3) == [x * x for x in range(7)]
    assert 2 <= state["max"] <= 6
    state["max"] = 0
    assert each(slow_square, list(range(5)), concurrency=1) == [0, 1, 4, 9, 16]
    assert state["max"] == 1
    with pytest.raises(KeyError) as exc:
        each(slow_square, list(range(20)), concurrency=4)
    assert exc.value.args == (7,) and state["now"] == 0  # the first in order, after every call ended


# --- end to end on S3 (moto on loopback) --------------------------------------------------------------------------
class _CountingFS:
    """The real s3fs filesystem, with ``cat_file`` (every ranged read) counted per object while in flight."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.lock = threading.Lock()
        self.inflight: dict[str, int] = {}
        self.max_per_file = 0
        self.max_total = 0

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        with self.lock:
            self.inflight[path] = self.inflight.get(path, 0) + 1
            self.max_per_file = max(self.max_per_file, self.inflight[path])
            self.max_total = max(self.max_total, sum(self.inflight.values()))
        try:
            time.sleep(0.002)  # a little latency, so overlapping requests overlap here too
            return self._fs.cat_file(path, *args, **kwargs)
        finally:
            with self.lock:
                self.inflight[path] -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300_000, generator=g), "b": torch.randn(1000, generator=g)},
            "opt": {"m": torch.randn(200_000, generator=g)}, "step": seed}


def _empty() -> dict[str, Any]:
    return {"model": {"w": torch.empty(300_000), "b": torch.empty(1000)}, "opt": {"m": torch.empty(200_000)},
            "step": -1}


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """64 KiB reads, so a 2 MB state is dozens of ranged reads a file (the default 8 MiB would make it one)."""
    monkeypatch.setattr(reader, "READ_CHUNK", 64 << 10)
    return 64 << 10


def _saved(tmp_path, s3_bucket: str, s3_server, **kw: Any) -> tuple[str, dict]:
    url, opts = f"s3://{s3_bucket}/run", s3_server.storage_options()
    with CheckpointManager(tmp_path / "a", remote=url, storage_options=opts, file_size_mb=1, **kw) as mgr:
        mgr.save(7, _state(7))
        mgr.wait()
    return url, opts


@pytest.mark.parametrize("concurrency", [1, 4])
def test_restore_from_s3_keeps_reads_in_flight(tmp_path, s3_bucket, s3_server, small_chunks, concurrency) -> None:
    url, opts = _saved(tmp_path, s3_bucket, s3_server)
    with CheckpointManager(tmp_path / "b", remote=url, storage_options=opts, writer_threads=2,
                           remote_read_concurrency=concurrency) as mgr:
        assert mgr.remote is not None and mgr.remote.read_concurrency == concurrency
        counting = _CountingFS(mgr.remote.fs)
        mgr.remote.fs = counting
        state = _empty()
        assert mgr.restore(state, source="remote") == 7
        assert_tree_equal(state, _state(7))
    if concurrency == 1:
        assert counting.max_per_file == 1
    else:
        assert 2 <= counting.max_per_file <= concurrency
    assert counting.max_total <= 2 * concurrency  # two io threads, each reading one file


def test_flipped_byte_late_in_an_s3_object_is_found(tmp_path, s3_bucket, s3_server, small_chunks) -> None:
    url, opts = _saved(tmp_path, s3_bucket, s3_server)
    store = FsspecStore(f"{s3_bucket}/run", storage_options=opts, read_concurrency=6)
    try:
        _, rms = read_manifests(store, 7)
        f = max(rms[0].files, key=lambda r: r.size)
        path = f"{s3_bucket}/run/{layout.step_dir(7)}/{f.name}"
        data = bytearray(store.fs.cat_file(path))
        where = len(data) - 70_000  # a chunk near the end: read long after the first ones were started
        data[where] ^= 0x10
        store.fs.pipe_file(path, bytes(data))
        report = verify_step(store, 7)
        assert not report.ok and report.bad_files == [f.name], report.errors
    finally:
        store.close()
    # the default restore names the file and verifies before it changes anything
    fresh = _empty()
    for t in (fresh["model"]["w"], fresh["model"]["b"], fresh["opt"]["m"]):
        t.fill_(3.0)
    with CheckpointManager(tmp_path / "d", remote=url, storage_options=opts) as mgr, \
            pytest.raises(CorruptCheckpointError, match=f.name):
        mgr.restore(fresh, step=7, source="remote")
    assert fresh["step"] == -1 and all(bool((t == 3.0).all()) for t in
                                       (fresh["model"]["w"], fresh["model"]["b"], fresh["opt"]["m"]))


def test_a_failing_ranged_read_fails_the_restore_and_stops_every_read(tmp_path, s3_bucket, s3_server,
                                                                     small_chunks) -> None:
    url, opts = _saved(tmp_path, s3_bucket, s3_server)
    store = FsspecStore(f"{s3_bucket}/run", storage_options=opts)
    store.fs = FaultyFileSystem(store.fs, fail={"cat_file": [9]}, error_factory=lambda op, n: PermissionError(
        f"injected: {op} call {n}"))
    try:
        _, rms = read_manifests(store, 7)
        out = [memoryview(bytearray(f.size)) for f in rms[0].files]
        with pytest.raises(PermissionError, match="injected"):
            for i in range(len(out)):
                reader.read_file_into(store, rms[0], i, out[i])
        assert not [t for t in threading.enumerate() if t.name.startswith("tierckpt-readahead")]
    finally:
        store.close()


def test_cli_verify_takes_threads_and_read_concurrency(tmp_path, s3_bucket, s3_server) -> None:
    url, _ = _saved(tmp_path, s3_bucket, s3_server)
    base = ["-m", "tierckpt", "verify", url, "--storage-option",
            f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return run_python([*base, *extra], env=subprocess_env(), cwd=REPO_ROOT, timeout=120)

    ok = run("--threads", "2", "--read-concurrency", "3")
    assert ok.returncode == 0 and "1 of 1 steps intact" in ok.stdout, cli_output(ok)
    bad = run("--read-concurrency", "0")
    assert bad.returncode == 2 and "--read-concurrency must be at least 1" in bad.stderr, cli_output(bad)


def test_options_are_validated(tmp_path) -> None:
    with pytest.raises(ValueError, match="remote_read_concurrency"):
        CheckpointManager(tmp_path, remote_read_concurrency=0)
    with pytest.raises(Exception, match="read_concurrency"):
        FsspecStore("memory://x/y", read_concurrency=0)
    assert FsspecStore("memory://x/y").read_concurrency == DEFAULT_READ_CONCURRENCY


def test_pull_reads_ahead_and_refuses_a_truncated_object(tmp_path, s3_bucket, s3_server, monkeypatch) -> None:
    from tierckpt.cli import remote as cli_remote
    from tierckpt.storage.local import LocalStore

    monkeypatch.setattr(cli_remote, "_CHUNK", 64 << 10)
    _saved(tmp_path, s3_bucket, s3_server)
    remote = FsspecStore(f"{s3_bucket}/run", storage_options=s3_server.storage_options(), tier="remote",
                         read_concurrency=4)
    try:
        counting = _CountingFS(remote.fs)
        remote.fs = counting
        local = LocalStore(tmp_path / "pulled")
        cli_remote.pull_step(remote, local, 7, threads=2)
        assert 2 <= counting.max_per_file <= 4
        with CheckpointManager(tmp_path / "pulled") as mgr:
            state = _empty()
            assert mgr.restore(state, source="local") == 7
            assert_tree_equal(state, _state(7))

        # a data object that lost its last bytes: named, and nothing of the step appears locally
        _, rms = read_manifests(remote, 7)
        f = max(rms[0].files, key=lambda r: r.size)
        path = f"{s3_bucket}/run/{layout.step_dir(7)}/{f.name}"
        remote.fs.pipe_file(path, remote.fs.cat_file(path)[:-100_000])
        other = LocalStore(tmp_path / "other")
        with pytest.raises(CorruptCheckpointError, match=f.name):
            cli_remote.pull_step(remote, other, 7, threads=2)
        assert not [n for n in other.list("") if n.startswith("step-")]
    finally:
        remote.close()


def test_listing_a_remote_asks_for_every_manifest_at_once(make_store) -> None:
    store = make_store("s3")
    for step in range(1, 11):
        write_step(store, build_step(step, sizes=(100,), n_files=1))
    write_step(store, build_step(11, sizes=(100,), n_files=1), commit=False)  # a crash's leftover
    expected = list_root(store)
    counting = _CountingExists(store.fs)
    store.fs = counting
    listing = list_root(store)
    assert sorted(listing.steps) == list(range(1, 11)) and listing == expected
    assert any(name.startswith("step-0000000011") for name in listing.incomplete)
    assert 2 <= counting.max_inflight <= 2 * store.read_concurrency


class _CountingExists:
    """The real s3fs filesystem, with ``exists`` (one HEAD or LIST each) counted while in flight."""

    def __init__(self, fs: Any) -> None:
        self._fs, self.lock, self.inflight, self.max_inflight = fs, threading.Lock(), 0, 0

    def exists(self, *args: Any, **kwargs: Any) -> bool:
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(0.005)
            return self._fs.exists(*args, **kwargs)
        finally:
            with self.lock:
                self.inflight -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def test_step_states_of_a_remote_are_read_together(make_store) -> None:
    from tierckpt.status import list_steps as step_infos
    from tierckpt.tiers.listing import list_steps

    store, local = make_store("s3"), make_store("local")
    for step in range(1, 9):
        write_step(store, build_step(step, sizes=(100,), n_files=1))
    store.fs.pipe_file(f"{store.root}/{layout.step_dir(8)}/{layout.STEP_MANIFEST}", b"{not json")  # corrupt
    write_step(local, build_step(3, sizes=(100,), n_files=1))
    counting = _CountingFS(store.fs)
    store.fs = counting
    assert list_steps(store) == {**{s: "committed" for s in range(1, 8)}, 8: "corrupt"}
    assert counting.max_total >= 2
    counting.max_total = 0
    infos = step_infos(local, store, set(), set())
    assert [(i.step, i.state) for i in infos] == [(1, "remote"), (2, "remote"), (3, "local+remote"), (4, "remote"),
                                                   (5, "remote"), (6, "remote"), (7, "remote"), (8, "failed")]
    assert all(i.bytes and i.bytes >= 100 for i in infos[:7]) and infos[7].bytes is None
    assert counting.max_total >= 2
    # a rename-commit store's temporary folder is an unfinished step; a committed one of the same number wins
    write_step(local, build_step(5, sizes=(100,), n_files=1), commit=False)
    write_step(local, build_step(3, sizes=(100,), n_files=1), commit=False)
    assert list_steps(local) == {3: "committed", 5: "incomplete"}


class _LyingFS(_CountingFS):
    """A memory filesystem whose ranged reads of data files can come back with one bit flipped (same size)."""

    def __init__(self, fs: Any) -> None:
        super().__init__(fs)
        self.lie = False

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> bytes:
        data = super().cat_file(path, *args, **kwargs)
        if self.lie and path.endswith(".safetensors") and data:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data


def test_upload_verification_reads_back_with_reads_in_flight(make_store) -> None:
    import secrets

    import fsspec

    from tierckpt import UploadError
    from tierckpt.storage.retry import RetryPolicy
    from tierckpt.tiers.listing import list_steps
    from tierckpt.tiers.uploader import replicate_step

    local = make_store("local")
    built = build_step(21, sizes=(4096, 3000, 37), n_files=2)
    write_step(local, built)
    fast = RetryPolicy(attempts=2, base_delay_s=0.001, max_delay_s=0.01)
    fs = _LyingFS(fsspec.filesystem("memory"))
    remote = FsspecStore(f"memory://ra-{secrets.token_hex(4)}/r", fs=fs, read_concurrency=4)
    replicate_step(local, remote, 21, verify=True, retry=fast, part_size=1024)  # ~7 chunks a file
    assert list_steps(remote) == {21: "committed"}
    assert 2 <= fs.max_per_file <= 4
    # a backend whose reads do not return what was written: never committed
    fs.lie = True
    other = FsspecStore(f"memory://ra-{secrets.token_hex(4)}/r", fs=fs, read_concurrency=4)
    with pytest.raises(UploadError, match="reads back"):
        replicate_step(local, other, 21, verify=True, retry=fast, part_size=1024)
    assert list_steps(other) == {}


def test_s3_connection_pool_matches_the_reads_in_flight(s3_bucket, s3_server) -> None:
    opts = s3_server.storage_options()
    sized = FsspecStore(f"{s3_bucket}/pool", storage_options=opts, read_concurrency=6)
    mine = FsspecStore(f"{s3_bucket}/pool", storage_options={**opts, "config_kwargs": {"max_pool_connections": 5}})
    try:
        for store in (sized, mine):
            store.write_bytes("f", b"x")  # s3fs connects on first use
        assert sized.fs.s3._client_config.max_pool_connections == 24
        assert mine.fs.s3._client_config.max_pool_connections == 5  # the caller's choice stays
        assert opts.get("config_kwargs") is None  # the caller's options are not changed
    finally:
        sized.close()
        mine.close()
