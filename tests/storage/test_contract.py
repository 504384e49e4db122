"""One contract suite for every storage backend: the local tier, a POSIX remote folder, fsspec ``memory://`` and S3
through s3fs on a real S3-protocol server (moto, loopback). Each test runs once per backend (``store`` fixture)."""

from __future__ import annotations

import array
import ctypes

import pytest

from tests._support.steps import build_step, write_step
from tierckpt.errors import CheckpointError, StorageError
from tierckpt.format import layout
from tierckpt.storage.base import join
from tierckpt.storage.commit import protocol_for, read_step_manifest
from tierckpt.tiers.listing import list_steps
from tierckpt.tiers.steps import delete_step

BIG = (5 << 20) + 12345  # more than one S3 part at the tests' 5 MiB part size


def test_list_exists_size(store):
    store.makedirs("d/e")
    store.write_bytes("d/e/f.bin", b"abc")
    store.write_bytes("d/g.bin", b"")
    store.write_bytes("top.bin", b"x" * 10)
    assert store.list("") == ["d", "top.bin"]
    assert store.list("d") == ["e", "g.bin"]
    assert store.list("d/e") == ["f.bin"]
    assert store.list("missing") == []
    assert store.list("top.bin") == []  # a file is not a folder
    assert store.exists("d") and store.exists("d/e/f.bin") and store.exists("top.bin")
    assert not store.exists("nope") and not store.exists("d/nope")
    assert store.size("d/e/f.bin") == 3
    assert store.size("d/g.bin") == 0
    with pytest.raises(FileNotFoundError):
        store.size("d/missing.bin")


def test_read_bytes_max_size(store):
    store.makedirs("a")
    store.write_bytes("a/small", b"0123456789")
    store.write_bytes("a/empty", b"")
    assert store.read_bytes("a/small", max_size=10) == b"0123456789"
    assert store.read_bytes("a/small", max_size=1 << 20) == b"0123456789"
    assert store.read_bytes("a/empty", max_size=10) == b""
    with pytest.raises(CheckpointError):
        store.read_bytes("a/small", max_size=9)
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/missing", max_size=10)


def test_readinto_offsets(store):
    data = bytes(range(256)) * 4
    store.write_bytes("f", data)
    buf = bytearray(100)
    assert store.readinto("f", 0, memoryview(buf)) == 100 and bytes(buf) == data[:100]
    assert store.readinto("f", 500, memoryview(buf)) == 100 and bytes(buf) == data[500:600]
    buf = bytearray(100)
    assert store.readinto("f", 1000, memoryview(buf)) == 24 and bytes(buf[:24]) == data[1000:]
    assert bytes(buf[24:]) == bytes(76)  # nothing written past what was read
    assert store.readinto("f", 1024, memoryview(buf)) == 0  # at EOF
    assert store.readinto("f", 5000, memoryview(buf)) == 0  # past EOF
    assert store.readinto("f", 3, memoryview(bytearray(0))) == 0
    store.write_bytes("empty", b"")
    assert store.readinto("empty", 0, memoryview(buf)) == 0
    with pytest.raises(FileNotFoundError):
        store.readinto("missing", 0, memoryview(buf))


def test_readinto_direct_reads_what_readinto_reads(store):
    """Every store: ``readinto_direct`` is ``readinto`` (around the page cache where ``direct_reads``), and
    ``uncached`` only ever says yes where a direct read can follow."""
    data = bytes(range(256)) * (3 * 4096 + 7)  # an aligned bulk and an unaligned tail
    store.write_bytes("d", data)
    raw = bytearray(len(data) + 2 * 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(raw))
    view = memoryview(raw)[-addr % 4096 :][: len(data)]  # page-aligned, as a restore's staging buffer is
    assert store.readinto_direct("d", 0, view) == len(data) and bytes(view) == data
    assert store.readinto_direct("d", 4096, view) == len(data) - 4096 and bytes(view[: len(data) - 4096]) == data[4096:]
    assert store.uncached("d", 0, len(data)) in (True, False)
    if store.uncached("d", 0, len(data)):
        assert store.direct_reads
    with pytest.raises(FileNotFoundError):
        store.readinto_direct("missing", 0, view)


def test_open_read_and_iter_chunks(store):
    data = bytes(range(251)) * 40
    store.makedirs("s")
    store.write_bytes("s/f", data)
    with store.open_read("s/f") as f:
        assert f.read(10) == data[:10]
        assert f.read(5) == data[10:15]
        f.seek(9000)
        assert f.read() == data[9000:]
        assert f.read(10) == b""
    chunks = list(store.iter_chunks("s/f", 1000))
    assert b"".join(chunks) == data and all(len(c) <= 1000 for c in chunks)
    assert b"".join(store.iter_chunks("s/f", 333, start=100, length=2000)) == data[100:2100]
    assert b"".join(store.iter_chunks("s/f", 333, start=10000)) == data[10000:]
    with pytest.raises(FileNotFoundError):
        store.open_read("s/missing").read(1)


def test_write_stream_close_and_abort(store):
    ints = array.array("i", range(1000))
    store.makedirs("w")
    with store.open_write("w/ok", size_hint=4 * 1000 + 3) as w:
        w.write(memoryview(ints))  # a non-byte memoryview is written as its bytes
        w.write(b"end")
    assert store.read_bytes("w/ok", max_size=1 << 20) == ints.tobytes() + b"end"
    w = store.open_write("w/gone")
    w.write(b"partial")
    w.abort()
    assert not store.exists("w/gone")
    assert "gone" not in store.list("w")
    with pytest.raises(RuntimeError), store.open_write("w/boom") as w:
        w.write(b"half")
        raise RuntimeError("writer died")
    assert not store.exists("w/boom")
    store.write_bytes("w/ok", b"replaced")  # write_bytes replaces an old file
    assert store.read_bytes("w/ok", max_size=100) == b"replaced"


def test_big_stream_and_aborted_big_stream(store):
    block = bytes(range(256)) * 4096  # 1 MiB
    store.makedirs("big")
    w = store.open_write("big/ok", size_hint=BIG)
    left = BIG
    while left:
        n = min(left, len(block))
        w.write(block[:n])
        left -= n
    w.close()
    assert store.size("big/ok") == BIG
    buf = bytearray(300)
    assert store.readinto("big/ok", (5 << 20) - 100, memoryview(buf)) == 300
    assert bytes(buf) == (block * 6)[(5 << 20) - 100 : (5 << 20) + 200]
    w = store.open_write("big/aborted")
    for _ in range(6):  # past one part: an S3 multipart upload is under way
        w.write(block)
    w.abort()
    assert not store.exists("big/aborted")
    assert store.list("big") == ["ok"]


def test_remove_tree(store):
    for folder in ("t/a", "t/b/c", "keep"):
        store.makedirs(folder)  # the contract: folders are made before files go in (object stores ignore it)
    for rel in ("t/a/1", "t/a/2", "t/b/c/3", "t/4", "keep/5"):
        store.write_bytes(rel, b"x")
    store.remove("t/a/1")
    assert store.list("t/a") == ["2"]
    store.remove("t")
    assert not store.exists("t") and store.list("") == ["keep"]
    store.remove("t")  # missing is fine
    store.remove("keep/none")
    with pytest.raises(CheckpointError):
        store.remove("")
    assert store.read_bytes("keep/5", max_size=1) == b"x"


def test_paths_never_leave_the_root(store):
    for bad in ["../x", "a/../../x", "a/..", "a\\b", "a\x00b"]:
        with pytest.raises(CheckpointError):
            join("step", bad)
        with pytest.raises(CheckpointError):
            store.write_bytes(bad, b"x")
        with pytest.raises(CheckpointError):
            store.read_bytes(bad, max_size=10)
        with pytest.raises(CheckpointError):
            store.remove(bad)


def test_capabilities(store):
    assert store.tier in ("local", "remote")
    if store.atomic_rename:
        assert store.local_path is not None
    else:
        assert store.local_path is None
    assert "secret" not in store.url and "testing-key" not in store.url



def test_read_ahead_over_the_store_reads_every_byte_in_order(store):
    """A store's ``readinto`` from several threads at once (what ``read_concurrency`` > 1 promises), through the
    read-ahead every reader uses; stores that say 1 are read one chunk at a time on the caller's thread."""
    from functools import partial

    from tierckpt.storage.readahead import ReadAhead

    assert isinstance(store.read_concurrency, int) and store.read_concurrency >= 1
    data = bytes(range(251)) * 997  # 250,247 bytes: chunks that do not divide it
    store.write_bytes("ra", data)
    for window in {1, store.read_concurrency, 6}:
        out = memoryview(bytearray(len(data)))
        with ReadAhead(partial(store.readinto, "ra"), 0, len(data), chunk=10_000, window=window, into=out) as chunks:
            offsets = [pos for pos, _ in chunks]
        assert offsets == list(range(0, len(data), 10_000)) and bytes(out) == data, window
        with ReadAhead(partial(store.readinto, "ra"), 0, len(data) + 5000, chunk=7000, window=window) as chunks:
            assert b"".join(bytes(v) for _, v in chunks) == data  # a file shorter than asked ends early


# --- commit protocols ---------------------------------------------------------------------------------------------
def test_create_exclusive_writes_once_and_never_replaces(store):
    """The first create wins and later ones leave its bytes; where the store says ``exclusive_create``, of 8
    threads racing on an empty name exactly one succeeds."""
    import threading

    assert store.create_exclusive("id.json", b"first") is True
    assert store.create_exclusive("id.json", b"second") is False
    assert store.read_bytes("id.json", max_size=100) == b"first"
    assert not [n for n in store.list("") if n != "id.json"]  # no temporary left behind
    if not store.exclusive_create:
        return
    won: list[bytes] = []
    go = threading.Barrier(8)

    def race(i: int) -> None:
        go.wait()
        if store.create_exclusive("race.json", b"%d" % i):
            won.append(b"%d" % i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and store.read_bytes("race.json", max_size=100) == won[0]


def test_uncommitted_step_is_never_committed(store):
    built = build_step(7)
    write_step(store, built, commit=False)
    assert list_steps(store) == {7: "incomplete"}
    assert read_step_manifest(store, layout.step_dir(7), 7) is None


def test_commit_makes_step_visible(store):
    built = build_step(10)
    write_step(store, built)
    assert list_steps(store) == {10: "committed"}
    folder = layout.step_dir(10)
    assert read_step_manifest(store, folder, 10) == built.manifest
    assert sorted(store.list(folder)) == sorted([layout.STEP_MANIFEST, built.manifest.ranks[0].name, *built.files])
    for name, data in built.files.items():
        assert store.read_bytes(join(folder, name), max_size=1 << 20) == data
    assert not [n for n in store.list("") if layout.is_leftover(n)]


def test_recover_removes_leftovers(store):
    write_step(store, build_step(1))
    write_step(store, build_step(2), commit=False)
    actions = protocol_for(store).recover(store)
    assert actions
    assert list_steps(store) == {1: "committed"}
    assert store.list("") == [layout.step_dir(1)]
    assert protocol_for(store).recover(store) == []  # nothing left to do


def test_recover_keeps_committed_step_and_drops_stray_files(store):
    built = build_step(3)
    write_step(store, built)
    other = build_step(3)  # a crashed re-save of the same step, next to (or in) the committed one
    write_step(store, other, commit=False)
    protocol_for(store).recover(store)
    assert list_steps(store) == {3: "committed"}
    folder = layout.step_dir(3)
    assert read_step_manifest(store, folder, 3).save_id == built.save_id
    assert sorted(store.list(folder)) == sorted([layout.STEP_MANIFEST, built.manifest.ranks[0].name, *built.files])


def test_replace_keeps_old_until_new_manifest_lands(store):
    old = build_step(5, seed=1)
    write_step(store, old)
    new = build_step(5, seed=2)
    folder = layout.step_dir(5)
    protocol = protocol_for(store)
    staging = protocol.begin(store, 5, layout.new_save_id())
    for name, data in new.files.items():
        store.write_bytes(join(staging, name), data)
    store.write_bytes(join(staging, new.manifest.ranks[0].name), new.rank_manifest.to_bytes())
    # everything of the new save is written but its manifest: the old copy is intact and still the step
    assert read_step_manifest(store, folder, 5).save_id == old.save_id
    for name, data in old.files.items():
        assert store.read_bytes(join(folder, name), max_size=1 << 20) == data
    store.write_bytes(join(staging, layout.STEP_MANIFEST), new.manifest.to_bytes())
    protocol.commit(store, staging, 5)
    assert read_step_manifest(store, folder, 5).save_id == new.save_id
    assert sorted(store.list(folder)) == sorted([layout.STEP_MANIFEST, new.manifest.ranks[0].name, *new.files])
    assert list_steps(store) == {5: "committed"}


def test_abort_leaves_committed_step(store):
    old = build_step(6)
    write_step(store, old)
    protocol = protocol_for(store)
    staging = protocol.begin(store, 6, layout.new_save_id())
    store.write_bytes(join(staging, layout.data_file_name(0, 0, "deadbeef")), b"partial")
    protocol.abort(store, staging, 6)
    folder = layout.step_dir(6)
    assert read_step_manifest(store, folder, 6).save_id == old.save_id
    assert sorted(store.list(folder)) == sorted([layout.STEP_MANIFEST, old.manifest.ranks[0].name, *old.files])


def test_delete_step_decommits_first(store):
    write_step(store, build_step(8))
    write_step(store, build_step(9))
    delete_step(store, 8)
    assert list_steps(store) == {9: "committed"}
    assert not store.exists(layout.step_dir(8))
    delete_step(store, 8)  # already gone: fine


def test_corrupt_manifest_is_listed_as_corrupt(store):
    write_step(store, build_step(4))
    rel = join(layout.step_dir(4), layout.STEP_MANIFEST)
    raw = bytearray(store.read_bytes(rel, max_size=1 << 20))
    raw[raw.index(b'"step":4') + 7] = ord("5")
    store.write_bytes(rel, bytes(raw))
    assert list_steps(store) == {4: "corrupt"}


# --- opening stores -----------------------------------------------------------------------------------------------
def test_open_store_s3_url_and_missing_backend(s3_bucket, s3_server, monkeypatch):
    from tierckpt.storage.fsspec_store import FsspecStore
    from tierckpt.storage.open import open_store

    opts = s3_server.storage_options()
    store = open_store(f"{s3_bucket}/run", storage_options=opts)
    assert isinstance(store, FsspecStore) and not store.atomic_rename and store.local_path is None
    store.write_bytes("x", b"1")
    assert store.list("") == ["x"]
    assert opts["secret"] not in repr(store) and opts["secret"] not in store.url

    import fsspec.core

    def no_backend(*a, **k):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_backend)
    with pytest.raises(StorageError, match="pip install gcsfs"):
        open_store("gs://bucket/run")


def test_url_credentials_are_redacted():
    from tierckpt.storage.fsspec_store import redact_url

    assert redact_url("s3://AKIA:s3cr3t@bucket/p") == "s3://bucket/p"
    assert redact_url("memory://a/b") == "memory://a/b"
