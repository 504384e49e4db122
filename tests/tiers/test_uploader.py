"""The replication engine: real local steps (built with the format modules) copied to a POSIX remote, ``memory://``
and S3 on the moto loopback server; compression, verification, skip-if-committed, faults, deadlines, cancel and the
bandwidth cap."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from tests._support.steps import build_step, write_step
from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StepConflictError, UploadError
from tierckpt.format import layout
from tierckpt.storage.base import join
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.faulty import FaultyFileSystem, FaultyStore
from tierckpt.storage.retry import RetryPolicy
from tierckpt.tiers.listing import list_steps
from tierckpt.tiers.reader import fetch_file, read_file_into, read_manifests
from tierckpt.tiers.uploader import TokenBucket, replicate_step

FAST = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)


@pytest.fixture
def local(make_store):
    return make_store("local", "local")


def _remote_files(remote, step):
    """{data file name (as in the local tier): bytes as restored through fetch_file} of a committed remote step,
    checksums verified."""
    manifest, rms = read_manifests(remote, step)
    out = {}
    for rm in rms:
        for i, rec in enumerate(rm.files):
            buf = bytearray(rec.size)
            fetch_file(remote, layout.step_dir(step), rec, memoryview(buf))
            check = bytearray(rec.size)
            read_file_into(remote, rm, i, memoryview(check))  # the reader's own path: hashes every byte
            assert check == buf
            # an object store holds each data file under its fan-out name, a POSIX remote under the local one
            assert rec.name == layout.stored_name(rec.name, remote.spread_keys)
            out[layout.plain_name(rec.name)] = bytes(buf)
    return manifest, rms, out


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("kind", ["posix_remote", "memory", "s3"])
def test_replicate_round_trip(make_store, local, kind, compression):
    built = build_step(100, sizes=(6 << 20, 1000, 0, 37) if kind == "s3" else (70000, 1000, 0, 37), zeros=True)
    write_step(local, built)
    remote = make_store(kind, "remote")
    res = replicate_step(local, remote, 100, compression=compression, verify=True, retry=FAST, threads=2,
                         part_size=1 << 20)
    assert not res.skipped and res.files == 2 and res.bytes_read == built.manifest.total_bytes
    assert list_steps(remote) == {100: "committed"}
    manifest, rms, files = _remote_files(remote, 100)
    assert files == built.files
    assert manifest.save_id == built.save_id and manifest.total_bytes == built.manifest.total_bytes
    if compression:
        assert all(r.compression == "zstd" and r.stored_size < r.size for r in rms[0].files)
        assert res.bytes_written < res.bytes_read // 10  # zeros compress
        assert manifest.ranks != built.manifest.ranks  # re-sealed with the new rank manifest
        assert [r.checksum for r in rms[0].files] == [r.checksum for r in built.rank_manifest.files]
    elif remote.spread_keys:  # the same files under their fan-out names: the manifests re-sealed with them
        assert [r.name for r in rms[0].files] == [layout.spread_name(r.name) for r in built.rank_manifest.files]
        assert rms[0].tensors == built.rank_manifest.tensors and manifest.save_id == built.manifest.save_id
        assert res.bytes_written == res.bytes_read
    else:
        assert rms[0] == built.rank_manifest and manifest == built.manifest
        assert res.bytes_written == res.bytes_read
    assert not [n for n in remote.list("") if layout.is_leftover(n)]
    assert list_steps(local) == {100: "committed"}  # local untouched


def test_random_data_compressed_round_trip(make_store, local):
    built = build_step(1, sizes=(300000, 5, 0))
    write_step(local, built)
    remote = make_store("memory")
    replicate_step(local, remote, 1, compression="zstd", compression_level=1, part_size=65536, retry=FAST)
    assert _remote_files(remote, 1)[2] == built.files


def test_skip_when_already_committed(make_store, local):
    built = build_step(3)
    write_step(local, built)
    remote = FaultyStore(make_store("memory"))
    replicate_step(local, remote, 3, retry=FAST)
    writes = remote.calls["open_write"] + remote.calls["write_bytes"]
    res = replicate_step(local, remote, 3, retry=FAST)
    assert res.skipped and res.bytes_written == 0
    assert remote.calls["open_write"] + remote.calls["write_bytes"] == writes  # nothing re-uploaded


def test_another_save_of_a_committed_remote_step_is_never_replaced(make_store, local):
    """A committed remote step of another save (another run's, or a rolled-back run's) stays as it is: the upload
    raises StepConflictError before writing anything, and the remote still restores the other save's bytes."""
    remote = make_store("memory")
    old = build_step(4, seed=1)
    write_step(remote, old)
    before = {n: remote.read_bytes(f"{layout.step_dir(4)}/{n}", max_size=1 << 30)
              for n in remote.list(layout.step_dir(4))}
    new = build_step(4, seed=2)
    write_step(local, new)
    with pytest.raises(StepConflictError) as ei:
        replicate_step(local, remote, 4, retry=FAST)
    assert ei.value.step == 4 and old.save_id in str(ei.value) and new.save_id in str(ei.value)
    assert isinstance(ei.value, UploadError) and ei.value.transient is False
    assert read_step_manifest(remote, layout.step_dir(4), 4).save_id == old.save_id
    after = {n: remote.read_bytes(f"{layout.step_dir(4)}/{n}", max_size=1 << 30)
             for n in remote.list(layout.step_dir(4))}
    assert after == before  # not a byte written, not a file removed


@pytest.mark.parametrize("fail", [{"open_write": [1]}, {"write": [2]}, {"close": [1]}, {"write_bytes": [1, 2]},
                                  {"size": [1]}, {"makedirs": [1]}])
def test_transient_faults_are_retried(make_store, local, fail):
    built = build_step(5)
    write_step(local, built)
    remote = FaultyStore(make_store("memory"), fail=fail)
    res = replicate_step(local, remote, 5, retry=FAST, verify=True)
    assert res.retries >= 1
    assert list_steps(remote) == {5: "committed"}
    assert _remote_files(remote, 5)[2] == built.files


def test_random_faults_on_s3_are_retried(make_store, local):
    built = build_step(6, n_files=3)
    write_step(local, built)
    remote = FaultyStore(make_store("s3"), fail_fraction=0.25, seed=3,
                         fraction_ops=["open_write", "write", "write_bytes", "size"])
    res = replicate_step(local, remote, 6, retry=RetryPolicy(attempts=12, base_delay_s=0.001, max_delay_s=0.01))
    assert res.retries >= 1 and sum(remote.plan.failures.values()) == res.retries
    assert _remote_files(remote, 6)[2] == built.files


def test_failing_fsspec_filesystem(local):
    import fsspec

    from tierckpt.storage.fsspec_store import FsspecStore

    built = build_step(7)
    write_step(local, built)
    fs = FaultyFileSystem(fsspec.filesystem("memory"), fail={"open": [1], "pipe_file": [2], "cat_file": [1]})
    remote = FsspecStore(f"memory://faulty-{secrets.token_hex(4)}/r", fs=fs)
    res = replicate_step(local, remote, 7, retry=FAST, verify=True)
    assert res.retries >= 3 and fs.calls["open"] >= 3
    assert _remote_files(remote, 7)[2] == built.files


def test_permanent_failure_commits_nothing(make_store, local):
    built = build_step(8)
    write_step(local, built)
    inner = make_store("s3")
    remote = FaultyStore(inner, fail={"write": "all"}, error_factory=lambda op, n: PermissionError(f"denied {op}"))
    with pytest.raises(UploadError) as ei:
        replicate_step(local, remote, 8, retry=FAST)
    err = ei.value
    assert err.step == 8 and err.tier == "remote" and "r00000-p000" in str(err) and inner.url in str(err)
    assert "PermissionError" in str(err) and isinstance(err.__cause__, PermissionError)
    assert remote.plan.calls["write"] <= 2  # not retried
    assert list_steps(inner) == {} and inner.list("") == []
    assert list_steps(local) == {8: "committed"}
    assert read_manifests(local, 8)[0] == built.manifest


def test_transient_failure_that_persists_aborts(make_store, local):
    built = build_step(9)
    write_step(local, built)
    inner = make_store("memory")
    remote = FaultyStore(inner, fail={"write_bytes": "all"})  # rank manifests never land
    with pytest.raises(UploadError, match="ConnectionError"):
        replicate_step(local, remote, 9, retry=RetryPolicy(attempts=3, base_delay_s=0.001))
    assert remote.plan.calls["write_bytes"] >= 3
    assert list_steps(inner) == {} and not inner.exists(layout.step_dir(9))


def test_short_writes_are_caught(make_store, local):
    write_step(local, build_step(10))
    inner = make_store("posix_remote")
    remote = FaultyStore(inner, short_writes=True)
    with pytest.raises(UploadError, match="bytes after upload"):
        replicate_step(local, remote, 10, retry=RetryPolicy(attempts=2, base_delay_s=0.001))
    assert list_steps(inner) == {}
    assert inner.list("") == []  # the .tmp- folder of the rename protocol is gone too


def test_stall_beyond_deadline_fails_within_deadline(make_store, local):
    write_step(local, build_step(11))
    inner = make_store("memory")
    remote = FaultyStore(inner, stall={"open_write": 5.0})
    t0 = time.monotonic()
    with pytest.raises(UploadError, match="deadline"):
        replicate_step(local, remote, 11, retry=FAST, deadline_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert list_steps(inner).get(11) != "committed"


@pytest.mark.parametrize("op", ["read_bytes", "write_bytes"])
def test_a_silent_remote_fails_the_step_within_stall_s(make_store, local, op):
    """A request that never answers (the manifest read, the manifest write): the step fails once nothing has
    moved for stall_s, long before the step's deadline or the backend's own timeouts."""
    write_step(local, build_step(14))
    inner = make_store("memory")
    gate = threading.Event()
    remote = FaultyStore(inner, stall={op: 1.0}, sleep=lambda _s: gate.wait(30))
    t0 = time.monotonic()
    with pytest.raises(UploadError, match="no request succeeded for 0.5 s"):
        replicate_step(local, remote, 14, retry=FAST, deadline_s=60, stall_s=0.5)
    assert time.monotonic() - t0 < 3.0
    gate.set()
    assert list_steps(inner).get(14) != "committed" or op == "write_bytes"


def test_stall_while_committing_never_deletes_data(make_store, local):
    built = build_step(12)
    write_step(local, built)
    inner = make_store("memory")
    remote = FaultyStore(inner, stall={"write_bytes": (1.5, [2])})  # the 2nd write_bytes is manifest.json
    with pytest.raises(UploadError, match="deadline"):
        replicate_step(local, remote, 12, retry=FAST, deadline_s=0.5)
    time.sleep(1.5)  # the stalled PUT lands late: the step must then be complete, never half there
    assert list_steps(inner) == {12: "committed"}
    assert _remote_files(inner, 12)[2] == built.files
    assert replicate_step(local, inner, 12).skipped


def test_cancel_stops_promptly(make_store, local):
    write_step(local, build_step(13, sizes=(400000,)))
    inner = make_store("memory")
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(UploadError, match="cancelled"):
        replicate_step(local, inner, 13, cancel=cancel, bandwidth_bytes_per_s=100_000, part_size=16384)
    assert time.monotonic() - t0 < 1.5
    assert list_steps(inner) == {}


def test_bandwidth_cap_slows_uploads(make_store, local):
    write_step(local, build_step(14, sizes=(1 << 20,), n_files=2))  # 2 MiB and headers
    frees = []
    for name in ("a1", "a2", "a3"):  # the best of three: one uncapped run once took 0.7 s on a busy VM
        t0 = time.monotonic()
        replicate_step(local, make_store("memory", name), 14, part_size=1 << 18)
        frees.append(time.monotonic() - t0)
    free = min(frees)
    t0 = time.monotonic()
    replicate_step(local, make_store("memory", "b"), 14, part_size=1 << 18, bandwidth_bytes_per_s=4 << 20)
    capped = time.monotonic() - t0
    assert capped >= 0.3 and capped > free  # ~0.45 s at 4 MiB/s


def test_token_bucket_on_fake_clock():
    now = [0.0]
    bucket = TokenBucket(1000, burst=100, clock=lambda: now[0])
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(500) == pytest.approx(0.5)
    now[0] = 0.5
    assert bucket.reserve(100) == pytest.approx(0.1)


def test_corrupt_or_missing_local_step_is_refused(make_store, local):
    remote = make_store("memory")
    with pytest.raises(CheckpointNotFoundError):
        replicate_step(local, remote, 15)
    built = build_step(15)
    write_step(local, built)
    rname = join(layout.step_dir(15), built.manifest.ranks[0].name)
    raw = bytearray(local.read_bytes(rname, max_size=1 << 20))
    raw[-3] ^= 1
    local.write_bytes(rname, bytes(raw))
    with pytest.raises(CorruptCheckpointError) as ei:
        replicate_step(local, remote, 15)
    assert ei.value.step == 15 and built.manifest.ranks[0].name in ei.value.bad_files
    assert list_steps(remote) == {}


def test_damaged_local_data_is_caught_by_verify(make_store, local):
    built = build_step(16)
    write_step(local, built)
    name = next(iter(built.files))
    path = local.path(join(layout.step_dir(16), name))
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    remote = make_store("memory")
    with pytest.raises(CorruptCheckpointError) as ei:
        replicate_step(local, remote, 16, verify=True, retry=FAST)
    assert ei.value.tier == "local" and name in ei.value.bad_files
    assert list_steps(remote) == {}


def test_fetch_file_bounds(make_store, local):
    import dataclasses

    built = build_step(17, zeros=True)
    write_step(local, built)
    remote = make_store("memory")
    replicate_step(local, remote, 17, compression="zstd")
    _m, rms = read_manifests(remote, 17)
    rec = rms[0].files[0]
    folder = layout.step_dir(17)
    with pytest.raises(ValueError):
        fetch_file(remote, folder, rec, memoryview(bytearray(rec.size + 1)))
    smaller = dataclasses.replace(rec, size=rec.size - 10)
    with pytest.raises(CorruptCheckpointError, match="more than"):
        fetch_file(remote, folder, smaller, memoryview(bytearray(smaller.size)))
    larger = dataclasses.replace(rec, size=rec.size + 10)
    with pytest.raises(CorruptCheckpointError, match="fewer than"):
        fetch_file(remote, folder, larger, memoryview(bytearray(larger.size)))
    remote.write_bytes(join(folder, rec.name), b"not a zstd frame at all")
    with pytest.raises(CorruptCheckpointError) as ei:
        fetch_file(remote, folder, rec, memoryview(bytearray(rec.size)))
    assert rec.name in ei.value.bad_files
    plain = built.rank_manifest.files[1]
    local_folder = layout.step_dir(17)
    with pytest.raises(CorruptCheckpointError, match="longer"):
        fetch_file(local, local_folder, dataclasses.replace(plain, size=plain.size - 1),
                   memoryview(bytearray(plain.size - 1)))
    with pytest.raises(CorruptCheckpointError, match="ends early"):
        fetch_file(local, local_folder, dataclasses.replace(plain, size=plain.size + 1),
                   memoryview(bytearray(plain.size + 1)))


def test_list_steps_states(make_store):
    store = make_store("posix_remote")
    write_step(store, build_step(1))
    write_step(store, build_step(2), commit=False)
    assert list_steps(store) == {1: "committed", 2: "incomplete"}
