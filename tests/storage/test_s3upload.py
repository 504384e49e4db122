"""Uploads to S3 with parts in flight (tierckpt.storage.s3upload), against moto's real S3 protocol on loopback."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tierckpt
from tierckpt.errors import CheckpointError
from tierckpt.format import layout
from tierckpt.storage.fsspec_store import FsspecStore, _FsspecWriteStream
from tierckpt.storage.s3upload import S3MultipartStream

MiB = 1 << 20


class _Calls:
    """Wraps a store's ``fs.call_s3``: counts calls per operation and parts in flight; can delay or fail parts."""

    def __init__(self, store: FsspecStore, *, delay: float = 0.0, fail_part: int | None = None) -> None:
        self.real = store.fs.call_s3
        self.delay, self.fail_part = delay, fail_part
        self.ops: list[str] = []
        self.kwargs: list[dict] = []
        self.in_flight = self.most = self.parts = 0
        self.lock = threading.Lock()
        store.fs.call_s3 = self  # an instance attribute: this store's filesystem only

    def __call__(self, method: str, *args, **kwargs):
        with self.lock:
            self.ops.append(method)
            self.kwargs.append({k: v for k, v in kwargs.items() if k != "Body"})
        if method != "upload_part":
            return self.real(method, *args, **kwargs)
        with self.lock:
            self.parts += 1
            n = self.parts
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.delay)
            if n == self.fail_part:
                raise OSError(f"injected failure of part request {n}")
            return self.real(method, *args, **kwargs)
        finally:
            with self.lock:
                self.in_flight -= 1


def _store(make_store, **kw) -> FsspecStore:
    store = make_store("s3", **kw)
    assert isinstance(store, FsspecStore)
    return store


def _pending_uploads(store: FsspecStore) -> list:
    bucket = store.root.split("/", 1)[0]
    return store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def _payload(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def test_parts_go_out_together_and_the_object_is_exact(make_store) -> None:
    store = _store(make_store, write_concurrency=4)
    calls = _Calls(store, delay=0.15)
    data = _payload(23 * MiB + 123)
    buf = bytearray(MiB)  # the caller reuses one buffer: the stream must have copied what it was given
    w = store.open_write("f.bin")
    assert isinstance(w, S3MultipartStream)
    for off in range(0, len(data), MiB):
        piece = data[off : off + MiB]
        buf[: len(piece)] = piece
        w.write(memoryview(buf)[: len(piece)])
        buf[:] = b"\xee" * MiB
    assert not store.exists("f.bin")  # nothing visible before the completion
    w.close()
    assert store.size("f.bin") == len(data)
    out = bytearray(len(data))
    assert store.readinto("f.bin", 0, memoryview(out)) == len(data)
    assert bytes(out) == data
    assert calls.parts == 5  # 4 full 5 MiB parts and the rest
    assert 2 <= calls.most <= 4
    assert calls.ops.count("create_multipart_upload") == 1 and calls.ops.count("complete_multipart_upload") == 1
    assert _pending_uploads(store) == []


def test_bytes_of_every_size_arrive_in_order(make_store) -> None:
    store = _store(make_store, write_concurrency=3)
    pieces = [_payload(n, seed=i) for i, n in enumerate([3 * MiB, 7 * MiB, 5 * MiB, 1, 12 * MiB + 7, 0, 2 * MiB])]
    with store.open_write("g.bin") as w:
        for i, p in enumerate(pieces):
            w.write(p if i % 2 == 0 else memoryview(bytearray(p)))
    data = b"".join(pieces)
    out = bytearray(len(data))
    assert store.readinto("g.bin", 0, memoryview(out)) == len(data)
    assert bytes(out) == data


@pytest.mark.parametrize("size", [0, 1, 5 * MiB - 1])
def test_a_file_under_one_part_is_one_put(make_store, size: int) -> None:
    store = _store(make_store)
    calls = _Calls(store)
    data = _payload(size)
    with store.open_write("small.bin") as w:
        w.write(data)
    assert calls.ops == ["put_object"]
    assert store.size("small.bin") == size
    assert store.read_bytes("small.bin", max_size=size) == data


def test_an_exact_multiple_of_the_part_size(make_store) -> None:
    store = _store(make_store)
    calls = _Calls(store)
    data = _payload(10 * MiB)
    with store.open_write("even.bin") as w:
        w.write(data)
    assert calls.parts == 2 and store.size("even.bin") == len(data)
    assert store.read_bytes("even.bin", max_size=len(data)) == data


def test_a_failed_part_fails_the_file_and_aborts_the_upload(make_store) -> None:
    store = _store(make_store, write_concurrency=2)
    calls = _Calls(store, delay=0.05, fail_part=2)
    w = store.open_write("bad.bin")
    with pytest.raises(OSError, match="part request 2"):
        try:
            for _ in range(6):
                w.write(_payload(5 * MiB))
            w.close()
        except BaseException:
            w.abort()
            raise
    assert not store.exists("bad.bin")
    assert _pending_uploads(store) == []
    assert "abort_multipart_upload" in calls.ops
    assert calls.in_flight == 0
    uploads = store._part_uploads
    assert uploads is not None and uploads._permits._value == uploads.concurrency  # every permit back


def test_abort_leaves_no_object_and_no_upload(make_store) -> None:
    store = _store(make_store, write_concurrency=2)
    calls = _Calls(store, delay=0.1)
    w = store.open_write("gone.bin")
    w.write(_payload(12 * MiB))  # two parts handed over, the rest buffered
    w.abort()
    assert calls.in_flight == 0  # abort waited for the parts being sent
    assert not store.exists("gone.bin")
    assert _pending_uploads(store) == []
    with pytest.raises(CheckpointError, match="closed upload"):
        w.write(b"x")


def test_parts_in_memory_are_bounded_by_the_store(make_store) -> None:
    store = _store(make_store, write_concurrency=2)
    calls = _Calls(store, delay=0.1)
    uploads = store._part_uploads
    assert uploads is not None
    held = {"now": 0, "most": 0}
    lock = threading.Lock()
    submit = uploads.submit

    def counting_submit(fn, *args, **kwargs):  # parts handed over and not yet ended: their bytes are in memory
        fut = submit(fn, *args, **kwargs)
        with lock:
            held["now"] += 1
            held["most"] = max(held["most"], held["now"])

        def ended(_):
            with lock:
                held["now"] -= 1

        fut.add_done_callback(ended)
        return fut

    uploads.submit = counting_submit
    streams = [store.open_write(f"m{i}.bin") for i in range(2)]

    def fill(w) -> None:
        for _ in range(4):
            w.write(_payload(5 * MiB))
        w.close()

    threads = [threading.Thread(target=fill, args=(w,)) for w in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls.parts == 8 and calls.most <= 2  # two files, one store: 2 parts in flight at most
    assert held["most"] <= 2  # and never more than 2 parts' bytes handed over (writers wait for a permit)
    assert all(store.size(f"m{i}.bin") == 20 * MiB for i in range(2))


def test_storage_options_reach_every_request(make_store, s3_server) -> None:
    """s3fs adds ``s3_additional_kwargs`` (here server-side encryption) to the multipart calls as to its own."""
    opts = {**s3_server.storage_options(), "s3_additional_kwargs": {"ServerSideEncryption": "AES256"}}
    bucket = make_store("s3").root.split("/", 1)[0]
    store = FsspecStore(f"s3://{bucket}/sse", storage_options=opts, tier="remote", part_size=5 * MiB)
    try:
        with store.open_write("enc.bin") as w:
            w.write(_payload(11 * MiB))
        head = store.fs.call_s3("head_object", Bucket=bucket, Key="sse/enc.bin")
        assert head.get("ServerSideEncryption") == "AES256"
    finally:
        store.close()


def test_write_concurrency_one_keeps_the_backend_file_and_bad_values_are_refused(make_store) -> None:
    store = _store(make_store, write_concurrency=1)
    with store.open_write("one.bin") as w:
        assert isinstance(w, _FsspecWriteStream)
        w.write(_payload(6 * MiB))
    assert store.size("one.bin") == 6 * MiB
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(CheckpointError, match="write_concurrency must be a positive int"):
            make_store("s3", name=f"bad{bad!s}", write_concurrency=bad)
    with pytest.raises(ValueError, match="remote_write_concurrency must be an int >= 1"):
        tierckpt.CheckpointManager(os.devnull + "-never", remote_write_concurrency=0)


def test_other_backends_and_small_parts_keep_the_backend_file(make_store) -> None:
    mem = make_store("memory")
    assert mem._part_uploads is None
    small = make_store("s3", name="small", part_size=1 * MiB)  # under S3's 5 MiB minimum: s3fs refuses it itself
    assert small._part_uploads is None


def test_closing_the_store_stops_its_part_threads(make_store) -> None:
    store = _store(make_store)
    with store.open_write("t.bin") as w:
        w.write(_payload(11 * MiB))
    assert any(t.name.startswith("tierckpt-remote-part") for t in threading.enumerate())
    late = S3MultipartStream(w.fs, w.path, part_size=5 * MiB, uploads=store._part_uploads, tier="remote", url="x")
    store.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("tierckpt-remote-part") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "part threads still running after close()"
        time.sleep(0.01)
    with pytest.raises(CheckpointError, match="store is closed"):  # a stream outliving its store starts no thread
        late.write(_payload(6 * MiB))
    late.abort()
    assert not any(t.name.startswith("tierckpt-remote-part") for t in threading.enumerate())


def test_a_step_uploaded_in_parallel_parts_restores_from_s3_alone(tmp_path, s3_bucket, s3_server) -> None:
    state = {"w": torch.randn(2 * MiB), "b": torch.arange(MiB, dtype=torch.float64)}  # 16 MiB: one file, 4 parts
    url = f"{s3_bucket}/ckpt"
    with tierckpt.CheckpointManager(tmp_path / "a", remote=url, storage_options=s3_server.storage_options(),
                                    upload_part_mb=5, remote_write_concurrency=3) as mgr:
        calls = _Calls(mgr.remote)
        mgr.save(7, state)
        mgr.wait()
        assert mgr.remote.exists(f"{layout.step_dir(7)}/manifest.json")
    assert calls.ops.count("create_multipart_upload") >= 1 and calls.parts >= 3
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with tierckpt.CheckpointManager(tmp_path / "b", remote=url, storage_options=s3_server.storage_options()) as mgr2:
        assert mgr2.restore(target) == 7
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_cli_sync_takes_write_concurrency(tmp_path, s3_bucket, s3_server, capsys) -> None:
    from tierckpt.cli import main as cli_main
    from tierckpt.tiers.listing import list_steps

    state = {"w": torch.randn(5 * MiB)}  # 20 MiB: more than one of the CLI's 16 MiB parts
    with tierckpt.CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(3, state)
    url = f"{s3_bucket}/cli"
    ep = ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]
    assert cli_main(["sync", str(tmp_path / "local"), url, *ep, "--write-concurrency", "0"]) == 2
    assert "--write-concurrency must be >= 1" in capsys.readouterr().err
    assert cli_main(["sync", str(tmp_path / "local"), url, *ep, "--write-concurrency", "2", "--verify"]) == 0
    remote = FsspecStore(url, storage_options=s3_server.storage_options())
    try:
        assert list_steps(remote) == {3: "committed"}
        assert _pending_uploads(remote) == []
        target = {"w": torch.zeros(5 * MiB)}
        with tierckpt.CheckpointManager(tmp_path / "back", remote=url,
                                        storage_options=s3_server.storage_options()) as m:
            assert m.restore(target) == 3
        assert torch.equal(target["w"], state["w"])
    finally:
        remote.close()


def test_the_uploader_retries_a_file_whose_part_failed(tmp_path, make_store) -> None:
    """A part request that fails transiently fails that file's attempt; the uploader retries the file, the step is
    committed with exact bytes, and the failed attempt's multipart upload is gone."""
    from tierckpt.storage.local import LocalStore
    from tierckpt.storage.retry import RetryPolicy
    from tierckpt.tiers.listing import list_steps
    from tierckpt.tiers.uploader import replicate_step

    state = {"w": torch.randn(3 * MiB)}  # 12 MiB: one file, 3 parts of 5 MiB
    with tierckpt.CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(4, state)
    remote = _store(make_store, write_concurrency=2)
    calls = _Calls(remote, delay=0.02, fail_part=2)
    real = calls.__call__

    def transient(method: str, *args, **kwargs):
        try:
            return real(method, *args, **kwargs)
        except OSError as exc:
            raise ConnectionError(str(exc)) from None  # what a dropped connection looks like

    remote.fs.call_s3 = transient
    res = replicate_step(LocalStore(tmp_path / "local", tier="local"), remote, 4, part_size=5 * MiB,
                         retry=RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.01), verify=True)
    assert res.retries == 1
    assert calls.ops.count("abort_multipart_upload") == 1 and calls.ops.count("complete_multipart_upload") == 1
    assert list_steps(remote) == {4: "committed"}
    assert _pending_uploads(remote) == []


@pytest.mark.parametrize("algo", ["SHA256", "CRC32", "SHA1"])
def test_an_upload_with_a_checksum_algorithm_names_each_parts_checksum(make_store, s3_server, algo: str) -> None:
    """With ``ChecksumAlgorithm`` in ``s3_additional_kwargs`` S3 creates the upload with that algorithm, and the
    completion must carry every part's checksum of it."""
    opts = {**s3_server.storage_options(), "s3_additional_kwargs": {"ChecksumAlgorithm": algo}}
    bucket = make_store("s3").root.split("/", 1)[0]
    store = FsspecStore(f"s3://{bucket}/sums", storage_options=opts, tier="remote", part_size=5 * MiB)
    try:
        calls = _Calls(store)
        data = _payload(11 * MiB)
        with store.open_write("sum.bin") as w:
            w.write(data)
        complete = calls.kwargs[calls.ops.index("complete_multipart_upload")]
        parts = complete["MultipartUpload"]["Parts"]
        assert [p["PartNumber"] for p in parts] == [1, 2, 3]
        assert all(p.get(f"Checksum{algo}") for p in parts), parts
        assert store.read_bytes("sum.bin", max_size=len(data)) == data
    finally:
        store.close()


def test_more_parts_than_s3_numbers_is_refused_and_aborted(make_store, monkeypatch) -> None:
    from tierckpt.storage import s3upload

    monkeypatch.setattr(s3upload, "MAX_PARTS", 2)
    store = _store(make_store)
    w = store.open_write("big.bin")
    with pytest.raises(CheckpointError, match="more than S3's 2 parts of 5 MiB") as info:
        try:
            w.write(_payload(16 * MiB))
        except BaseException:
            w.abort()
            raise
    assert info.value.path and info.value.path.endswith("big.bin")
    assert not store.exists("big.bin") and _pending_uploads(store) == []


def test_a_file_too_large_for_the_part_numbers_gets_larger_parts_from_its_size_hint(make_store, monkeypatch) -> None:
    """With the file's size known up front (the uploader passes it), the part size grows to whole MiB so that the
    file fits S3's part numbers; the store's own part size is unchanged for other files."""
    from tierckpt.storage import s3upload

    monkeypatch.setattr(s3upload, "MAX_PARTS", 2)
    store = _store(make_store, write_concurrency=2)
    calls = _Calls(store)
    data = _payload(16 * MiB + 5)  # 4 parts of 5 MiB; 2 parts of 9 MiB
    with store.open_write("big.bin", size_hint=len(data)) as w:
        assert isinstance(w, S3MultipartStream) and w.part_size == 9 * MiB
        w.write(data)
    assert calls.parts == 2 and store.read_bytes("big.bin", max_size=len(data)) == data
    assert store.open_write("other.bin", size_hint=6 * MiB).part_size == 5 * MiB  # type: ignore[attr-defined]


@pytest.mark.parametrize(("part", "hint", "want"), [
    (16 * MiB, None, 16 * MiB),
    (16 * MiB, 16 * MiB * 10_000, 16 * MiB),  # exactly fits
    (16 * MiB, 16 * MiB * 10_000 + 1, 17 * MiB),
    (16 * MiB, 200 << 30, 21 * MiB),  # 200 GiB
    (5 * MiB, 0, 5 * MiB),
])
def test_part_size_for(part: int, hint: int | None, want: int) -> None:
    from tierckpt.storage.s3upload import MAX_PARTS, part_size_for

    got = part_size_for(part, hint)
    assert got == want and (hint is None or -(-hint // got) <= MAX_PARTS)


def test_the_connection_pool_holds_the_reads_and_parts_in_flight(s3_server, s3_bucket) -> None:
    """botocore's pool of 10 would queue requests: the store sizes it for its reads and its parts in flight,
    unless the user's ``config_kwargs`` say otherwise."""
    def pool(**kw) -> int:
        store = FsspecStore(f"s3://{s3_bucket}/pool", tier="remote", **kw)
        try:
            return store.fs.config_kwargs["max_pool_connections"]
        finally:
            store.close()

    opts = s3_server.storage_options()
    assert pool(storage_options=opts) == 32  # 4 x 8 reads in flight
    assert pool(storage_options=opts, read_concurrency=2, write_concurrency=24) == 48
    assert pool(storage_options={**opts, "config_kwargs": {"max_pool_connections": 7}}, write_concurrency=24) == 7


def test_a_failed_part_is_freed_without_the_garbage_collector(make_store) -> None:
    """The failed part's exception holds its frame (the stream and the part's bytes): once the caller drops the
    exception and the stream is aborted, reference counting alone frees them."""
    import gc
    import weakref

    store = _store(make_store, write_concurrency=2)
    _Calls(store, delay=0.02, fail_part=1)
    gc.collect()
    gc.disable()
    try:
        w = store.open_write("leak.bin")
        try:
            for _ in range(4):
                w.write(_payload(5 * MiB))
            w.close()
        except OSError:
            pass
        w.abort()
        ref = weakref.ref(w)
        del w
        assert ref() is None, "the aborted stream is only freed by the garbage collector"
    finally:
        gc.enable()


def test_closing_the_store_does_not_wait_for_parts_in_flight(make_store) -> None:
    """A manager's ``close(timeout=)`` gives up on a stalled upload and then closes the store: that must return at
    once; the stream's own ``abort()`` is what waits for its part."""
    store = _store(make_store, write_concurrency=2)
    calls = _Calls(store, delay=1.5)
    w = store.open_write("slow.bin")
    w.write(_payload(5 * MiB))  # one part handed over, sending for 1.5 s
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 0.5
    w.abort()
    assert calls.in_flight == 0 and calls.ops[-1] == "abort_multipart_upload"


def test_a_completion_whose_reply_is_lost_is_removed_by_abort(make_store) -> None:
    """S3 carried out the completion but the caller saw an error: the object exists, and the failed file must not
    stay under its name."""
    store = _store(make_store)
    calls = _Calls(store)
    real = calls.__call__

    def lost_reply(method: str, *args, **kwargs):
        out = real(method, *args, **kwargs)
        if method == "complete_multipart_upload":
            raise ConnectionError("reply lost")
        return out

    store.fs.call_s3 = lost_reply
    w = store.open_write("lost.bin")
    w.write(_payload(7 * MiB))
    with pytest.raises(ConnectionError, match="reply lost"):
        w.close()
    assert not store.exists("lost.bin")
    with pytest.raises(CheckpointError, match="aborted upload"):
        w.close()  # a close after the failure does not pretend the file is durable


@pytest.mark.parametrize("mb", [4, 5121])
def test_upload_part_mb_outside_s3s_part_sizes_is_refused(tmp_path, mb: int) -> None:
    with pytest.raises(ValueError, match="upload_part_mb must be between 5 and 5120"):
        tierckpt.CheckpointManager(tmp_path, upload_part_mb=mb)


def test_prune_leftovers_aborts_a_killed_writers_uploads_under_its_root_only(tmp_path, s3_bucket, s3_server, s3_admin,
                                                                           capsys) -> None:
    """A writer killed mid-upload leaves multipart uploads: invisible, but stored and billed. ``prune --leftovers``
    names them with ``--dry-run`` and aborts them without, and never touches another root's (``run`` vs ``run2``)."""
    import json

    from tierckpt.cli import main as cli_main

    url = f"{s3_bucket}/run"
    with tierckpt.CheckpointManager(tmp_path / "local", remote=url, storage_options=s3_server.storage_options()) as m:
        m.save(1, {"x": torch.ones(4)})
    bucket = s3_bucket.removeprefix("s3://")
    for key in (f"run/{layout.step_dir(2)}/r00000-p0000-dead.safetensors", "run2/other.bin"):
        s3_admin.call_s3("create_multipart_upload", Bucket=bucket, Key=key)

    def pending() -> list[str]:
        return sorted(u["Key"] for u in s3_admin.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))

    ep = ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]
    assert cli_main(["prune", url, "--keep", "1", "--leftovers", "--dry-run", *ep]) == 0
    out = capsys.readouterr().out
    assert f"would abort the unfinished upload of {url}/{layout.step_dir(2)}/r00000-p0000-dead.safetensors" in out
    assert "other.bin" not in out
    assert len(pending()) == 2
    from tierckpt.storage.faulty import FaultyStore

    wrapped = FaultyStore(FsspecStore(url, storage_options=s3_server.storage_options()))  # tests' wrapper passes it on
    try:
        assert len(wrapped.discard_unfinished_uploads(dry_run=True)) == 1
    finally:
        wrapped.inner.close()
    assert cli_main(["prune", url, "--keep", "1", "--leftovers", "--json", *ep]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and any("aborted the unfinished upload" in a for a in doc["leftovers"])
    assert pending() == ["run2/other.bin"]  # another root's upload in progress is left alone



def test_unfinished_uploads_reads_every_page() -> None:
    """Moto answers ``list_multipart_uploads`` in one page whatever ``MaxUploads`` says, so S3's paging is played
    here by a stand-in filesystem (the one place these tests do not use moto)."""
    from tierckpt.storage.s3upload import unfinished_uploads

    uploads = [{"Key": f"run/f{i}.bin", "UploadId": f"u{i}"} for i in range(5)]
    asked: list[dict] = []

    class PagingFS:
        def split_path(self, path: str):
            bucket, _, key = path.partition("/")
            return bucket, key, None

        def call_s3(self, method: str, **kw):
            assert method == "list_multipart_uploads"
            asked.append(kw)
            start = 0 if "KeyMarker" not in kw else next(
                i + 1 for i, u in enumerate(uploads)
                if (u["Key"], u["UploadId"]) == (kw["KeyMarker"], kw["UploadIdMarker"]))
            page = uploads[start : start + kw["MaxUploads"]]
            more = start + len(page) < len(uploads)
            out = {"Uploads": page, "IsTruncated": more}
            if more:
                out.update(NextKeyMarker=page[-1]["Key"], NextUploadIdMarker=page[-1]["UploadId"])
            return out

    found = unfinished_uploads(PagingFS(), "bucket/run", page_size=2)
    assert [u for _, _, u in found] == ["u0", "u1", "u2", "u3", "u4"]
    assert len(asked) == 3 and all(kw["Prefix"] == "run/" and kw["Bucket"] == "bucket" for kw in asked)
