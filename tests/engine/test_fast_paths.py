"""The fast paths keep every guarantee.

- ``O_DIRECT`` writes of the local tier (``direct_io=True``, the default): aligned pieces go direct, an unaligned
  piece (a file's tail, a ``bytes`` object) switches the file to buffered I/O, and the file reads back exactly;
- ``restore(in_place=True)``: CPU tensors are filled straight from the files (vectored reads), every byte is still
  verified, a corrupt newest step still falls back to an older one over the same tensors, and a restore that finds
  no intact copy says that the state was partly overwritten. Optimizer moments are read into the optimizer's own
  tensors; training continues bit-identically to a default (staged) restore.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests._support.helpers import (
    assert_tensor_equal,
    data_files,
    direct_io_supported,
    flip_byte,
    step_path,
    tensor_bytes,
    train_steps,
)
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.engine import restore as _restore
from tierckpt.host.memory import buffer_address
from tierckpt.snapshot.staging import aligned_empty
from tierckpt.storage import local as local_mod
from tierckpt.storage.local import DIRECT_ALIGN, LocalStore

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------------------------------- direct writes


def test_direct_write_stream_mixes_aligned_and_unaligned_pieces(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, direct_io=True)
    buf = aligned_empty(8 * DIRECT_ALIGN + 100, pin=False)
    buf.copy_(torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8))
    view = memoryview(buf.numpy())
    assert buffer_address(view) % DIRECT_ALIGN == 0
    expected = bytes(view) + b"tail as bytes"
    w = store.open_write("f.bin", size_hint=max(len(expected), local_mod.DIRECT_MIN_BYTES))
    opened_direct = w.direct
    w.write(view[: 4 * DIRECT_ALIGN])  # aligned: stays direct
    still_direct = w.direct
    w.write(view[4 * DIRECT_ALIGN :])  # aligned start, unaligned length: bulk direct, tail buffered
    after_tail = w.direct
    w.write(b"tail as bytes")
    w.close()
    assert (tmp_path / "f.bin").read_bytes() == expected
    if direct_io_supported(tmp_path):
        assert opened_direct and still_direct and not after_tail
    else:
        assert not opened_direct


def test_direct_write_of_an_unaligned_buffer_falls_back(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, direct_io=True)
    buf = aligned_empty(4 * DIRECT_ALIGN + 1, pin=False)
    buf.fill_(7)
    view = memoryview(buf.numpy())[1:]  # right length, wrong address
    with store.open_write("g.bin", size_hint=local_mod.DIRECT_MIN_BYTES) as w:
        w.write(view)
        assert not w.direct
    assert (tmp_path / "g.bin").read_bytes() == bytes(view)


def test_small_files_and_direct_io_off_never_go_direct(tmp_path: Path) -> None:
    with LocalStore(tmp_path, direct_io=True).open_write("small", size_hint=100) as w:
        assert not w.direct
        w.write(b"x" * 100)
    with LocalStore(tmp_path, direct_io=False).open_write("big", size_hint=1 << 24) as w:
        assert not w.direct
        w.write(b"y" * 100)
    assert (tmp_path / "small").read_bytes() == b"x" * 100


@pytest.mark.parametrize("direct_io", [True, False])
def test_checkpoints_written_either_way_round_trip(tmp_path: Path, direct_io: bool) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(300_001, generator=g), "half": torch.randn(777, generator=g).to(torch.bfloat16)}
    with CheckpointManager(tmp_path, direct_io=direct_io, file_size_mb=1) as mgr:
        mgr.save(1, state)
        mgr.wait()
    out = {"big": torch.zeros(300_001), "half": torch.zeros(777, dtype=torch.bfloat16)}
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(out) == 1
    for k in state:
        assert_tensor_equal(out[k], state[k], k)


def test_direct_io_option_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="direct_io"):
        CheckpointManager(tmp_path, direct_io="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ in-place restore


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 128)
        self.b = torch.nn.Linear(128, 8)
        self.register_buffer("scale", torch.ones(8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale.float()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    train_steps(model, opt, steps, seed, (16, 64))


def _job(seed: int) -> dict:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    return {
        "model": model,
        "optim": opt,
        "plain": torch.randn(1000, 33, generator=g),
        "strided": torch.randn(40, 30, generator=g).t(),  # non-contiguous: staged, then copied
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 5),
        "array": np.arange(seed, seed + 12, dtype=np.float32),
        "step": seed,
    }


def _saved(tmp_path: Path, steps: list[int], **kw) -> dict[int, dict]:
    jobs = {}
    with CheckpointManager(tmp_path, keep_local=len(steps), file_size_mb=1, **kw) as mgr:
        for s in steps:
            job = _job(s)
            _train(job["model"], job["optim"], 3, s)
            mgr.save(s, job)
            mgr.wait()
            jobs[s] = job
    return jobs


def _assert_job_equal(got: dict, want: dict) -> None:
    for k, v in want["model"].state_dict().items():
        assert_tensor_equal(got["model"].state_dict()[k], v, f"model.{k}")
    got_opt, want_opt = got["optim"].state_dict(), want["optim"].state_dict()
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for i, st in want_opt["state"].items():
        for name, v in st.items():
            assert_tensor_equal(got_opt["state"][i][name], v, f"optim.state[{i}].{name}")
    for k in ("plain", "strided", "scalar", "empty"):
        assert_tensor_equal(got[k], want[k], k)
    np.testing.assert_array_equal(got["array"], want["array"])
    assert got["step"] == want["step"]


@pytest.mark.parametrize("scatter_min", [0, None], ids=["all_scattered", "small_copied"])
def test_in_place_restore_is_bit_identical_and_keeps_tensor_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     scatter_min: int | None) -> None:
    """Every target read straight into (``DIRECT_READ_MIN_BYTES`` 0), or, by default, these small ones copied in
    from the verified buffer: either way each live tensor keeps its memory and gets the saved bytes."""
    if scatter_min is not None:
        monkeypatch.setattr(_restore, "DIRECT_READ_MIN_BYTES", scatter_min)
    want = _saved(tmp_path, [5])[5]
    got = _job(99)
    _train(got["model"], got["optim"], 1, 99)  # optimizer state exists, so its tensors can be read into
    ptrs = {
        "plain": got["plain"].data_ptr(),
        "weight": got["model"].a.weight.data_ptr(),
        "exp_avg": got["optim"].state[got["model"].a.weight]["exp_avg"].data_ptr(),
    }
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(got, in_place=True) == 5
    _assert_job_equal(got, want)
    assert got["plain"].data_ptr() == ptrs["plain"]
    assert got["model"].a.weight.data_ptr() == ptrs["weight"]
    # AdamW keeps the tensor it was given when dtype and device already match: the moments were read in place
    assert got["optim"].state[got["model"].a.weight]["exp_avg"].data_ptr() == ptrs["exp_avg"]


def test_in_place_and_staged_restores_continue_training_identically(tmp_path: Path) -> None:
    _saved(tmp_path, [7])
    runs = []
    for in_place in (False, True):
        job = _job(1234)
        _train(job["model"], job["optim"], 1, 1234)
        with CheckpointManager(tmp_path) as mgr:
            assert mgr.restore(job, in_place=in_place) == 7
        _train(job["model"], job["optim"], 4, 77)
        runs.append({k: tensor_bytes(v) for k, v in job["model"].state_dict().items()})
    assert runs[0] == runs[1]


def _corrupt_plain(tmp_path: Path, step: int) -> None:
    """Flip one byte inside the tensor data of the file that holds ``plain`` (the largest tensor)."""
    files = data_files(step_path(tmp_path, step))
    biggest = max(files, key=lambda p: p.stat().st_size)
    flip_byte(biggest, 5)


def test_in_place_restore_falls_back_over_a_corrupt_newest_step(tmp_path: Path) -> None:
    jobs = _saved(tmp_path, [1, 2])
    _corrupt_plain(tmp_path, 2)
    got = _job(50)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(got, in_place=True) == 1
    _assert_job_equal(got, jobs[1])


def test_failed_in_place_restore_says_the_state_was_overwritten(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_restore, "DIRECT_READ_MIN_BYTES", 0)  # "plain" (132 KB) is read straight into
    _saved(tmp_path, [3])
    _corrupt_plain(tmp_path, 3)
    staged, direct = _job(60), _job(60)
    before = tensor_bytes(staged["plain"])
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError, match="state was not changed") as e1:
            mgr.restore(staged, step=3)
        with pytest.raises(CorruptCheckpointError, match="partly overwritten") as e2:
            mgr.restore(direct, step=3, in_place=True)
    assert e1.value.step == 3 and e2.value.step == 3 and e2.value.bad_files
    assert tensor_bytes(staged["plain"]) == before  # the default restore left the state alone
    assert tensor_bytes(direct["plain"]) != before  # in place: the bytes were read into the tensor itself


def test_small_in_place_targets_get_their_bytes_only_once_verified(tmp_path: Path) -> None:
    """Below ``DIRECT_READ_MIN_BYTES`` a target is filled from the verified buffer, not by the read: a corrupt
    copy leaves it as it was (only the scattered large targets are partly overwritten)."""
    _saved(tmp_path, [3])
    _corrupt_plain(tmp_path, 3)
    got = _job(60)
    assert got["plain"].nbytes < _restore.DIRECT_READ_MIN_BYTES
    before = tensor_bytes(got["plain"])
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError, match="partly overwritten"):
        mgr.restore(got, step=3, in_place=True)
    assert tensor_bytes(got["plain"]) == before


def test_in_place_restore_from_a_posix_remote_with_local_caching(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", remote=str(remote), file_size_mb=1) as mgr:
        job = _job(8)
        _train(job["model"], job["optim"], 2, 8)
        mgr.save(8, job)
        mgr.wait()
    for cache in (False, True):
        got = _job(0)
        _train(got["model"], got["optim"], 1, 0)
        with CheckpointManager(tmp_path / f"b{cache}", remote=str(remote), cache_remote_restores=cache) as mgr:
            assert mgr.restore(got, in_place=True) == 8
        _assert_job_equal(got, job)
        # the cached local copy is complete and intact: a local-only restore verifies every byte of it
        if cache:
            again = _job(1)
            with CheckpointManager(tmp_path / f"b{cache}") as mgr:
                assert mgr.restore(again, source="local") == 8
            _assert_job_equal(again, job)


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "in_place"])
def test_tied_and_untied_targets_of_one_saved_tensor(tmp_path: Path, in_place: bool) -> None:
    """A tensor saved once under two keys (tied weights) restores into tied and into untied live tensors; a
    square matrix next to its own transpose (same memory, other strides) is two tensors and both come back."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(64, 64, generator=g)
    sq = torch.randn(32, 32, generator=g)
    state = {"a": w, "b": w, "sq": sq, "sq_t": sq.t(), "other": torch.randn(100, generator=g)}
    want = {k: v.clone() for k, v in state.items()}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert mgr.records()[-1].tensors == 4  # "b" is "a"
        tied = torch.zeros(64, 64)
        zsq = torch.zeros(32, 32)
        targets = [
            {"a": tied, "b": tied, "sq": zsq, "sq_t": zsq.t(), "other": torch.zeros(100)},
            {"a": torch.zeros(64, 64), "b": torch.zeros(64, 64), "sq": torch.zeros(32, 32),
             "sq_t": torch.zeros(32, 32).t(), "other": torch.zeros(100)},
        ]
        for live in targets:
            assert mgr.restore(live, in_place=in_place) == 1
            for k, v in want.items():
                assert_tensor_equal(live[k], v, k)


def test_a_default_restore_copies_many_tensors_from_the_loaded_buffer_in_one_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A default restore copies its plain tensors straight from the loaded bytes (no view per tensor) where the
    native copy is built, and gives the same state as torch's copies."""
    from tierckpt.snapshot import hostcopy

    g = torch.Generator().manual_seed(12)
    state = {"model": {f"w{i}": torch.randn(7 + i % 5, 3, generator=g) for i in range(300)},
             "half": torch.randn(1000, generator=g).to(torch.bfloat16), "step": 4}
    want = {"model": {k: v.clone() for k, v in state["model"].items()}, "half": state["half"].clone(), "step": 4}
    calls: list[int] = []
    real = hostcopy.copy_from_addresses

    def spy(dsts: list[torch.Tensor], *args: object, **kwargs: object) -> bool:
        ok = real(dsts, *args, **kwargs)  # type: ignore[arg-type]
        calls.append(len(dsts) if ok else -len(dsts))
        return ok

    monkeypatch.setattr(hostcopy, "copy_from_addresses", spy)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        mgr.wait()
        for native in (True, False):
            monkeypatch.setattr(hostcopy, "available", native and hostcopy._hostcopy is not None)
            live = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
                    "half": torch.zeros_like(want["half"]), "step": 0}
            calls.clear()
            assert mgr.restore(live) == 1
            assert live["step"] == 4
            assert_tensor_equal(live["half"], want["half"], "half")
            for k, v in want["model"].items():
                assert_tensor_equal(live["model"][k], v, k)
            assert calls == ([301] if hostcopy.available else []), calls


def test_byte_view_is_the_tensors_own_writable_bytes() -> None:
    """The in-place reader fills each target through ``byte_view``: exactly the tensor's bytes, writable, for any
    dtype (bfloat16 has no numpy dtype) and for 0-d tensors."""
    from tierckpt.snapshot.loaded import byte_view

    for t in (torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros((), dtype=torch.float64),
              torch.nn.Parameter(torch.zeros(7)).detach()):
        view = byte_view(t)
        assert not view.readonly and view.ndim == 1 and view.nbytes == t.nbytes
        src = torch.arange(t.nbytes, dtype=torch.uint8)
        view[:] = src.numpy().tobytes()
        assert torch.equal(t.reshape(-1).view(torch.uint8), src)


def test_loaded_buffer_ranges_are_bounds_checked() -> None:
    """The addresses a restore copies from are checked against its buffer: a record outside it, or one read
    elsewhere (straight into a live tensor), leaves the copy to torch."""
    from tierckpt.format.manifest import TensorRecord
    from tierckpt.snapshot.loaded import LoadedBuffer

    buf = torch.zeros(1000, dtype=torch.uint8)
    recs = (TensorRecord(0, "a", "p", "F32", (10,), 0, 8, 40, "x"),
            TensorRecord(1, "b", "p", "U8", (100,), 1, 0, 100, "x"),
            TensorRecord(2, "c", "p", "U8", (100,), 1, 850, 100, "x"),
            TensorRecord(3, "d", "p", "U8", (1,), 2, 0, 1, "x"))
    loaded = LoadedBuffer(buf, (0, 100))
    got = loaded.ranges(recs, [1, 0])
    assert got is not None
    addr, lengths = got
    assert addr.tolist() == [buf.data_ptr() + 100, buf.data_ptr() + 8] and lengths.tolist() == [100, 40]
    assert loaded.ranges(recs, [0, 2]) is None  # 100 + 850 + 100 > 1000
    assert loaded.ranges(recs, [3]) is None  # no file 2
    assert LoadedBuffer(buf, (0, 100), frozenset({0})).ranges(recs, [0, 1]) is None
    assert LoadedBuffer(buf[::2], (0, 100)).ranges(recs, [0]) is None


def test_in_place_option_is_validated(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr, pytest.raises(ValueError, match="in_place"):
        mgr.restore({}, in_place=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------ file plan


@pytest.mark.parametrize(("mib", "threads", "want"),
                         [(100, 2, 2), (1100, 2, 4), (1100, 3, 3), (40, 4, 1), (2100, 4, 8)])
def test_file_count_is_a_multiple_of_the_writer_threads(mib: int, threads: int, want: int) -> None:
    """Each writer/reader thread gets the same number of files of about the same size (3 files on 2 threads would
    leave one thread a whole file behind)."""
    from tierckpt.format.plan import LeafSpec, make_plan

    leaves = [LeafSpec(f"t{i}", "F32", (mib * 2**20 // 4 // 50,), mib * 2**20 // 50) for i in range(50)]
    plan = make_plan(leaves, file_bytes=512 << 20, min_files=threads)
    assert len(plan.files) == want
    sizes = [f.size for f in plan.files]
    assert max(sizes) - min(sizes) <= max(leaf.nbytes for leaf in leaves) + 8192


# ------------------------------------------------------------------------------------------------ manifest encoding


def test_manifest_encoding_is_the_dataclass_encoding() -> None:
    """Manifests are encoded field by field (fast for 10,000 tensors); the bytes must be exactly what encoding
    ``dataclasses.asdict`` gives (with the tensor records as the version-2 table), and they must parse back to the
    same manifest."""
    import dataclasses

    from tierckpt.format.manifest import (
        FORMAT,
        FileRecord,
        RankManifest,
        RankRef,
        StepManifest,
        TensorRecord,
        _seal,
    )

    tensors = (
        TensorRecord(0, "a", "state['a']", "F32", (2, 3), 0, 4096, 24, "ab" * 16, "torch",
                     {"global_shape": [4, 3], "offset": [2, 0], "mesh": [[0, 1]]}),
        TensorRecord(1, "b", "state['b']", "BF16", (), 0, 4120, 2, "cd" * 16, "numpy"),
    )
    rm = RankManifest(step=3, rank=1, world_size=2, save_id="abcd", files=(FileRecord("f", 4122, "ef" * 16, 4096),),
                      tensors=tensors, tree={"$dict": [["a", {"$tensor": 0}]]}, metadata={"m": [1, 2.5, None]})
    want = dataclasses.asdict(rm)
    want["format"] = FORMAT + ".rank"
    # format version 2: the tensor records as a table, one list per field (the index is the position)
    want["tensors"] = {f: [getattr(t, f) for t in tensors] for f in TensorRecord._fields if f != "index"}
    # a file held in the step's own folder, without segment list, is written as version 2 wrote it
    want["files"] = [{k: v for k, v in f.items() if k not in ("in_step", "cuts")} for f in want["files"]]
    assert rm.to_bytes() == _seal(want)
    assert RankManifest.from_bytes(rm.to_bytes()) == rm
    sm = StepManifest(step=3, world_size=2, save_id="abcd",
                      ranks=(RankRef(0, "r0", 10, "00"), RankRef(1, "r1", 11, "11")),
                      total_bytes=4122, holds_ranks=(1,))
    want = dataclasses.asdict(sm)
    want["format"] = FORMAT + ".step"
    # a rank's mesh index is written only where it has one (no DTensor shards: the entry is as it always was)
    want["ranks"] = [{k: v for k, v in r.items() if k != "mesh"} for r in want["ranks"]]
    del want["refs"], want["shared_bytes"]  # written only by a step that references earlier ones
    assert sm.to_bytes() == _seal(want)
    indexed = dataclasses.replace(sm, ranks=(RankRef(0, "r0", 10, "00", (("2", (0,)),)), RankRef(1, "r1", 11, "11")))
    want = dataclasses.asdict(indexed)
    want["format"] = FORMAT + ".step"
    want["ranks"][0]["mesh"] = {"2": [0]}
    del want["ranks"][1]["mesh"], want["refs"], want["shared_bytes"]
    assert indexed.to_bytes() == _seal(want)
    assert StepManifest.from_bytes(indexed.to_bytes()) == indexed


def test_manifest_bytes_are_the_checksum_then_the_canonical_json() -> None:
    """On disk: ``{"checksum":"<hex>",`` and then the rest of the canonical JSON the checksum covers. Manifests in
    the earlier layout (fields in writing order, checksum last; format version 1) still parse."""
    import dataclasses
    import json

    import xxhash

    from tierckpt.format.hashing import canonical_json
    from tierckpt.format.manifest import FORMAT, RankRef, StepManifest

    sm = StepManifest(step=3, world_size=1, save_id="abcd", ranks=(RankRef(0, "r0", 10, "00"),), total_bytes=7,
                      metadata={"z": 1, "a": [2.5, None]})
    raw = sm.to_bytes()
    doc = json.loads(raw)
    claimed = doc.pop("checksum")
    canon = canonical_json(doc)
    assert raw == b'{"checksum":"' + claimed.encode() + b'",' + canon[1:]
    assert xxhash.xxh3_128_hexdigest(canon) == claimed
    assert StepManifest.from_bytes(raw) == sm
    old = {"step": 3, "world_size": 1, "save_id": "abcd",
           "ranks": [{"rank": 0, "name": "r0", "size": 10, "checksum": "00"}], "total_bytes": 7,
           "metadata": {"z": 1, "a": [2.5, None]}, "created": sm.created, "holds_ranks": None,
           "library_version": sm.library_version, "format_version": 1, "hash_algorithm": "xxh3_128",
           "format": FORMAT + ".step"}
    old["checksum"] = xxhash.xxh3_128_hexdigest(canonical_json(old))
    old_raw = json.dumps(old, separators=(",", ":")).encode()
    assert old_raw != raw and StepManifest.from_bytes(old_raw) == dataclasses.replace(sm, format_version=1)


# ------------------------------------------------------------------------------------------ no task outlives a call


def test_a_failed_file_task_waits_for_the_others_before_raising() -> None:
    """Readers write into a staging slot (or, in place, into the caller's tensors) that is released or reused as
    soon as the call fails; ``Executor.map`` would raise while the other reads still run."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tierckpt.tiers.tasks import run_all

    finished = threading.Event()

    def task(i: int) -> int:
        if i == 0:
            raise OSError("file 0 is unreadable")
        time.sleep(0.3)
        finished.set()
        return i

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(OSError, match="file 0"):
            run_all(pool, task, [0, 1])
        assert finished.is_set()
        assert run_all(pool, lambda i: i * 2, range(5)) == [0, 2, 4, 6, 8]


# ------------------------------------------------------------------------------------ manifest tensor records


def test_fast_tensor_record_checks_accept_exactly_what_the_field_checks_accept() -> None:
    """``_well_formed_tensors`` (the fast path for 10,000 records) must never accept a record the field-by-field
    checks reject; when it declines, those checks decide. Every field is mutated to each kind of bad value."""
    import copy

    from tierckpt.errors import CorruptCheckpointError as Corrupt
    from tierckpt.format.manifest import FileRecord, _checked_tensors, _well_formed_tensors

    files = [FileRecord("f0", 4096 + 64, "00", 4096), FileRecord("f1", 8192 + 6, "11", 8192)]
    good = [
        {"index": 0, "name": "a", "path": "state['a']", "dtype": "F32", "shape": [2, 4], "file": 0, "offset": 4096,
         "nbytes": 32, "checksum": "ab", "kind": "torch"},
        {"index": 1, "name": "b", "path": "state['b']", "dtype": "BF16", "shape": [], "file": 0, "offset": 4128,
         "nbytes": 2, "checksum": "cd", "kind": "numpy", "shard": None},
        {"index": 2, "name": "c", "path": "state['c']", "dtype": "U8", "shape": [0, 3], "file": 1, "offset": 8192,
         "nbytes": 0, "checksum": "", "kind": "torch"},
        {"index": 3, "name": "d", "path": "state['d']", "dtype": "I16", "shape": [3], "file": 1, "offset": 8192,
         "nbytes": 6, "checksum": "ef", "kind": "torch"},
    ]
    want_good = _checked_tensors(good, files, None, None)
    assert _well_formed_tensors(copy.deepcopy(good), files) == want_good
    # a record of the right size with another key in place of "shard" is read like the field-by-field loop reads it
    odd = copy.deepcopy(good)
    odd[1].pop("shard")
    odd[1]["extra"] = 1
    got = _well_formed_tensors(odd, files)
    assert got == want_good and got is not None and not hasattr(got[1], "extra")
    bad_values: list[object] = [None, True, -1, 1.0, "1", [], {}, 2**63, 10**6]
    cases = 0
    for i in range(len(good)):
        for key in [*good[i], "missing"]:
            for value in bad_values + (["F64", "XX", "torch2", [2, 4, 1], [2, -4], [1] * 65, [2**48]]):
                items = copy.deepcopy(good)
                if key == "missing":
                    items[i].pop("dtype")
                else:
                    items[i][key] = value
                try:
                    want = _checked_tensors(items, files, None, None)
                except Corrupt:
                    want = None
                before = copy.deepcopy(items)
                got = _well_formed_tensors(items, files)
                cases += 1
                if got is None:  # declined: the field-by-field loop gets the records as parsed
                    assert items == before, (i, key, value)
                if want is None:
                    assert got is None, (i, key, value)
                elif got is not None:
                    assert got == want, (i, key, value)
    assert cases > 500
