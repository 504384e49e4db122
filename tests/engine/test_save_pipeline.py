"""Pipelined copy and write: the local tier's writers start on each file's first bytes while the rest of the
snapshot is still being copied, and hashing runs on its own threads.

The invariants checked here: a file's watermark never covers a byte that is not copied yet; writers really start
before the copy ends; a copy that fails mid-way is reported once (by ``save()``, or by the lazy snapshot's
background error), leaves no committed step and no temporary folder, and frees its slot; hashing on separate
threads gives the same checksums as hashing in the writer.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal, clone_tree, leftovers, rank_manifests, step_path, zeros_like_tree
from tierckpt import CheckpointManager
from tierckpt.format.plan import make_plan
from tierckpt.snapshot import copier, hostcopy, staging, tree
from tierckpt.storage import local as local_store
from tierckpt.tiers import writer

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _state(n: int, numel: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model = {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}
    model["bias_bf16"] = torch.randn(1000, generator=g).to(torch.bfloat16)
    return {"model": model, "step": 3}


def _assert_restores(mgr: CheckpointManager, want: dict[str, Any], step: int) -> None:
    fresh = zeros_like_tree(want)
    fresh["step"] = 0
    assert mgr.restore(fresh) == step
    assert_tree_equal(fresh, want)


class _CheckedProgress(staging.CopyProgress):
    """Checks, at every advance, that the slot holds the reference image's bytes up to the new watermark."""

    def __init__(self, sizes: list[int], slot: staging.Slot, ref: torch.Tensor, offsets: list[int]) -> None:
        super().__init__(sizes)
        self.slot, self.ref, self.offsets = slot, ref, offsets
        self.calls: list[tuple[int, int]] = []

    def advance(self, part: int, end: int) -> None:
        start = self.offsets[part]
        assert self.slot.buffer is not None
        got = self.slot.buffer[start : start + end]
        assert torch.equal(got, self.ref[start : start + end]), f"watermark {end} of file {part} covers uncopied bytes"
        self.calls.append((part, end))
        super().advance(part, end)


def _checked_copy(state: dict[str, Any], file_bytes: int, waves: int, threads: int = 1) -> tuple[Any, list[Any]]:
    """Copy ``state`` pipelined under :class:`_CheckedProgress` and check every file image against a copy made in
    one go; returns the plan and the (part, watermark) calls in order."""
    flat = tree.flatten(state)
    plan = make_plan(flat.specs, file_bytes=file_bytes, min_files=2)
    locations = staging.leaf_locations(plan)
    pool = staging.StagingPool(slots=2, pin=False)
    try:
        ref_slot = pool.acquire(plan.buffer_bytes)
        copier.copy_into(ref_slot, plan, locations, flat)  # the reference image, copied in one go
        assert ref_slot.buffer is not None
        slot = pool.acquire(plan.buffer_bytes)
        assert slot is not ref_slot and slot.buffer is not None
        slot.buffer.fill_(0xA5)
        flat = tree.flatten(state)  # copy_into's caller owns the values list; a fresh one
        progress = _CheckedProgress([f.size for f in plan.files], slot, ref_slot.buffer,
                                    [f.buffer_offset for f in plan.files])
        copier.copy_into(slot, plan, locations, flat, progress=progress, waves=waves,
                          executor=pool.copy_executor() if threads > 1 else None)
        progress.finish()
        for f in plan.files:  # every file image complete (the padding between images is never written)
            image = slice(f.buffer_offset, f.buffer_offset + f.size)
            assert torch.equal(slot.buffer[image], ref_slot.buffer[image]), f"file {f.part}"
        for part in range(len(plan.files)):  # every file's watermark rises to its end
            ends = [e for p, e in progress.calls if p == part]
            assert ends == sorted(ends) and ends[-1] == plan.files[part].size, (part, ends)
        return plan, progress.calls
    finally:
        pool.close()


def test_watermarks_cover_only_copied_bytes_in_wave_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copier, "PIPELINE_GROUP_BYTES", MiB)
    state = _state(24, 96 * 1024, seed=1)  # 24 tensors of 384 KiB
    plan, calls = _checked_copy(state, 2 * MiB, waves=2)
    files = len(plan.files)
    assert files >= 4
    assert len(calls) > files, "the copy did not advance group by group"
    # files are copied a wave (the writer threads' first files) at a time, interleaved within the wave
    first_wave = {p for p, _ in calls[: len([c for c in calls if c[0] in (0, 1)])]}
    assert first_wave == {0, 1}
    assert calls[0][0] == 0 and calls[1][0] == 1


@pytest.mark.parametrize(("threads", "torch_path"), [(1, False), (2, False), (2, True)],
                         ids=["1", "2", "2-torch"])
def test_tensors_larger_than_a_group_are_copied_in_pieces(monkeypatch: pytest.MonkeyPatch, threads: int,
                                                          torch_path: bool) -> None:
    """A tensor larger than a group raises its file's watermark piece by piece (contiguous sources), or once with
    its first piece (strided ones); small tensors around it, split over copy threads (torch's path) or not, stay
    correct."""
    monkeypatch.setattr(copier, "PIPELINE_GROUP_BYTES", MiB)
    if torch_path:
        monkeypatch.setattr(hostcopy, "available", False)
    monkeypatch.setattr(copier, "PIPELINE_SPLIT_MIN_TENSORS", 8)
    g = torch.Generator().manual_seed(4)
    state: dict[str, Any] = {"small_a": {f"n{i}": torch.randn(300, generator=g) for i in range(20)}}
    state["emb"] = torch.randn(917_503, generator=g)  # 3.5 MiB less 4 bytes: the last piece is short
    state["emb_bf16"] = torch.randn(1_300_001, generator=g).to(torch.bfloat16)
    state["strided"] = torch.randn(640, 1024, generator=g).t()  # 2.5 MiB, not contiguous
    state["small_b"] = {f"n{i}": torch.randn(100, generator=g) for i in range(20)}
    assert not state["strided"].is_contiguous()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, torch_threads))
    try:
        plan, calls = _checked_copy(state, 16 * MiB, waves=1, threads=threads)
    finally:
        torch.set_num_threads(torch_threads)
    spans = {t.leaf: (f.part, t.offset, t.offset + t.nbytes) for f in plan.files for t in f.tensors}
    paths = tree.flatten(state).paths
    for name, pieces in (("emb", 4), ("emb_bf16", 3), ("strided", 3)):
        leaf = paths.index(f"state['{name}']")
        part, lo, hi = spans[leaf]
        inside = [e for p, e in calls if p == part and lo < e <= hi]
        assert len(inside) == pieces and inside[-1] == hi, (name, inside)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_checked_copy_uses_the_flattens_addresses_and_only_for_its_plan(pipelined: bool,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``copy_into(layout_checked=True)`` (an eager save: the flatten ran just before) copies from the addresses the
    flatten read, without reading layouts again, and refuses a state flattened for another plan."""
    monkeypatch.setattr(copier, "PIPELINE_GROUP_BYTES", MiB)
    state, twin = _state(12, 64 * 1024, seed=2), _state(12, 64 * 1024, seed=3)  # same layout, other values
    flat = tree.flatten(state)
    plan = make_plan(flat.specs, file_bytes=2 * MiB, min_files=2)
    locations = staging.leaf_locations(plan)
    pool = staging.StagingPool(slots=1, pin=False)
    try:
        slot = pool.acquire(plan.buffer_bytes)
        flat.ptrs[:] = tree.flatten(twin).ptrs  # white box: these addresses are what the copy reads
        progress = staging.CopyProgress([f.size for f in plan.files]) if pipelined else None
        copier.copy_into(slot, plan, locations, flat, progress=progress, layout_checked=True)
        got = copier.destination_views(slot, plan, locations, ["torch"] * len(plan.signature))
        want = [twin["model"][k] for k in twin["model"]]
        if hostcopy.available:  # the native copy takes the addresses; torch's copy_ reads the tensors themselves
            want_names = [s.name for s in plan.signature]
            assert want_names == [f"model.{k}" for k in twin["model"]]
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        else:
            assert all(torch.equal(g, w) for g, w in zip(got, tree.flatten(state).values, strict=True))
        other = tree.flatten(_state(13, 64 * 1024, seed=2))
        with pytest.raises(ValueError, match="another plan"):
            copier.copy_into(slot, plan, locations, other, layout_checked=True)
    finally:
        pool.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_only_an_eager_save_vouches_for_the_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   lazy: bool) -> None:
    """An eager save copies right after its flatten (nothing reads the layout twice); a lazy snapshot copies while
    training runs, so its copy reads every source's attributes again."""
    seen: list[bool] = []
    real = copier.copy_into

    def spy(*args: Any, layout_checked: bool = False, **kwargs: Any) -> None:
        seen.append(layout_checked)
        real(*args, layout_checked=layout_checked, **kwargs)

    monkeypatch.setattr(copier, "copy_into", spy)
    state = _state(10, 4096, seed=4)
    with CheckpointManager(tmp_path / "c", lazy_snapshot=lazy) as mgr:
        for step in (1, 2):
            mgr.save(step, state)
            mgr.snapshot_barrier()
        mgr.wait()
        _assert_restores(mgr, clone_tree(state), 2)
    assert seen == [not lazy, not lazy]


def test_copy_progress_wakes_waiters_and_reports_failure() -> None:
    progress = staging.CopyProgress([100, 200])
    woke: list[str] = []

    def waiter() -> None:
        progress.wait(1, 150)
        woke.append("ok")

    t = threading.Thread(target=waiter)
    t.start()
    progress.advance(1, 100)
    progress.advance(0, 100)
    time.sleep(0.05)
    assert not woke, "a waiter woke before its bytes were copied"
    progress.advance(1, 150)
    t.join(5)
    assert woke == ["ok"]
    progress.fail(RuntimeError("copy broke"))
    with pytest.raises(staging.StagingFailed, match="copy broke"):
        progress.wait(0, 101)


def test_hashing_waits_for_the_copy_and_for_the_caller_to_stop_waiting() -> None:
    """Hashing competes with training for the CPU: it starts only once every byte is copied *and* save() has
    released the progress (whatever happened), and gives up if the copy failed."""
    progress = staging.CopyProgress([10, 20])
    started = threading.Event()

    def hasher() -> None:
        progress.wait_released()
        started.set()

    t = threading.Thread(target=hasher)
    t.start()
    progress.release()  # released, but bytes are missing
    time.sleep(0.05)
    assert not started.is_set()
    progress.advance(0, 10)
    progress.advance(1, 19)
    time.sleep(0.05)
    assert not started.is_set()
    progress.advance(1, 20)
    t.join(5)
    assert started.is_set()
    other = staging.CopyProgress([10])
    other.finish()  # every byte copied, but save() has not returned yet
    waiting = threading.Thread(target=lambda: other.wait_released())
    waiting.start()
    time.sleep(0.05)
    assert waiting.is_alive()
    other.release()
    waiting.join(5)
    assert not waiting.is_alive()
    failed = staging.CopyProgress([10])
    failed.fail(RuntimeError("copy broke"))
    with pytest.raises(staging.StagingFailed, match="copy broke"):
        failed.wait_released()


@pytest.mark.parametrize(("small", "overlap", "torch_path"),
                         [(0, True, False), (300, True, False), (300, True, True), (0, False, False),
                          (300, False, True)],
                         ids=["large", "many_small", "many_small-torch", "large-no-overlap",
                              "many_small-no-overlap-torch"])
def test_writers_start_before_the_copy_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small: int,
                                            overlap: bool, torch_path: bool) -> None:
    """Also with more small tensors than :data:`copier.THREADED_MIN_TENSORS` (a real model's norms and biases):
    on torch's copy path their group is split over the copy threads, and the rest of the copy is still pipelined.
    With ``overlap_writes=False`` no byte is written before the copy ends."""
    monkeypatch.setattr(copier, "PIPELINE_GROUP_BYTES", 4 * MiB)
    if torch_path:
        monkeypatch.setattr(hostcopy, "available", False)
    state = _state(20, MiB, seed=2)  # 80 MiB in 20 tensors of 4 MiB, two files of 40 MiB (at most 48 MiB each)
    g = torch.Generator().manual_seed(3)
    for i in range(small):
        state["model"][f"norm{i}"] = torch.randn(256, generator=g)
    copies: list[float] = []
    copy_threads: set[str] = set()
    writes: list[float] = []
    real_copy, real_write = copier._copy_tensors, local_store._LocalWriteStream.write

    def slow_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *rest: Any) -> None:
        real_copy(dsts, srcs, *rest)
        time.sleep(0.02)  # a slow copy (a device-to-host copy of a large state)
        copies.append(time.perf_counter())
        copy_threads.add(threading.current_thread().name)

    def spy_write(self: Any, data: Any) -> None:
        if not self.path.endswith(".json"):
            writes.append(time.perf_counter())
        real_write(self, data)

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(max(2, torch_threads))  # the copy threads exist only with 2 or more
    try:
        with CheckpointManager(tmp_path / "c", file_size_mb=48, writer_threads=2, overlap_writes=overlap) as mgr:
            want = clone_tree(state)
            monkeypatch.setattr(copier, "_copy_tensors", slow_copy)
            monkeypatch.setattr(local_store._LocalWriteStream, "write", spy_write)
            handle = mgr.save(1, state)
            assert handle.staged.done() and handle.staged.exception() is None
            handle.persisted.result(60)
            monkeypatch.undo()
            assert handle.record().files == 2
            assert writes and copies
            if overlap:
                assert len(copies) >= 10, copies
                assert min(writes) < max(copies), "no data was written before the copy finished"
            else:
                assert min(writes) > max(copies), "data was written while the copy ran"
            if small and torch_path:
                assert any(n.startswith("tierckpt-copy") for n in copy_threads), copy_threads
            _assert_restores(mgr, want, 1)
    finally:
        torch.set_num_threads(torch_threads)


def _failing_copy(monkeypatch: pytest.MonkeyPatch, fail_at: int) -> list[int]:
    calls = [0]
    real = copier._copy_tensors

    def failing(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *rest: Any) -> None:
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected copy failure")
        real(dsts, srcs, *rest)
        time.sleep(0.01)  # give the writers time to start on the first groups

    monkeypatch.setattr(copier, "_copy_tensors", failing)
    return calls


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_copy_failing_mid_way_is_reported_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool) -> None:
    monkeypatch.setattr(copier, "PIPELINE_GROUP_BYTES", 4 * MiB)
    state = _state(20, MiB, seed=3)
    root = tmp_path / "c"
    with CheckpointManager(root, file_size_mb=40, lazy_snapshot=lazy, keep_local=5, overlap_writes=True) as mgr:
        mgr.save(1, state).persisted.result(60)
        calls = _failing_copy(monkeypatch, fail_at=4)
        if lazy:
            handle = mgr.save(2, state)
            with pytest.raises(RuntimeError, match="injected copy failure"):
                handle.staged.result(60)
            with pytest.raises(RuntimeError, match="injected copy failure"):
                handle.persisted.result(60)
            with pytest.raises(RuntimeError, match="injected copy failure"):
                mgr.wait(60)
        else:
            with pytest.raises(RuntimeError, match="injected copy failure"):
                mgr.save(2, state)
        assert calls[0] == 4
        monkeypatch.undo()
        mgr.wait(60)  # reported once: nothing left to raise
        want = clone_tree(state)
        done = threading.Event()
        threading.Thread(target=lambda: (mgr.save(3, state).persisted.result(60), done.set())).start()
        assert done.wait(60), "the failed save's staging slot was never released"
        mgr.wait(60)
        assert [s.step for s in mgr.steps()] == [1, 3]
        assert not step_path(root, 2).exists()
        assert leftovers(root) == []
        assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_path(root, 1).name,
                                                                        step_path(root, 3).name]
        _assert_restores(mgr, want, 3)


def _manifest_sums(root: Path, step: int) -> tuple[list[str], list[str]]:
    (rm,) = rank_manifests(step_path(root, step))
    doc = json.loads(rm.read_text())
    return [f["checksum"] for f in doc["files"]], doc["tensors"]["checksum"]


def test_hashing_threads_agree_with_hashing_in_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(20, 3 * MiB // 4 + 17, seed=4)  # odd sizes: segments cross the 8 MiB chunks anywhere
    with CheckpointManager(tmp_path / "pool", file_size_mb=16) as mgr:
        mgr.save(1, state).persisted.result(60)
    real = writer.write_rank
    used: list[object] = []

    def inline(store: Any, folder: str, snap: Any, executor: Any, hash_executor: Any = None) -> Any:
        used.append(hash_executor)
        return real(store, folder, snap, executor, None)

    monkeypatch.setattr(writer, "write_rank", inline)
    with CheckpointManager(tmp_path / "inline", file_size_mb=16) as mgr:
        mgr.save(1, state).persisted.result(60)
    assert used and used[0] is not None  # the manager does give the writer its hashing threads
    pooled, inlined = _manifest_sums(tmp_path / "pool", 1), _manifest_sums(tmp_path / "inline", 1)
    assert len(pooled[0]) >= 4 and all(pooled[0]) and all(pooled[1])
    assert pooled == inlined


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_save_that_fails_before_its_job_starts_gives_the_slot_back(tmp_path: Path, lazy: bool) -> None:
    """With one staging slot, a slot kept by a save that raised before a background job took it over would make
    every later save wait forever."""
    state = _state(4, 1000, seed=5)
    with CheckpointManager(tmp_path / "c", lazy_snapshot=lazy) as mgr:
        mgr.save(1, state).persisted.result(60)
        executor = mgr.components.pipeline.snapshot_thread if lazy else mgr.components.pipeline.persist_thread
        real = executor.submit
        calls = [0]

        def refuse_once(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("cannot schedule new futures")
            return real(*a, **k)

        executor.submit = refuse_once  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="cannot schedule"):
            mgr.save(2, state)
        want = clone_tree(state)
        done = threading.Event()
        threading.Thread(target=lambda: (mgr.save(3, state).persisted.result(60), done.set()), daemon=True).start()
        assert done.wait(60), "the slot of the save that failed was never given back"
        executor.submit = real  # type: ignore[method-assign]
        mgr.wait(60)
        assert [s.step for s in mgr.steps()] == [1, 3]
        _assert_restores(mgr, want, 3)


def test_overlap_writes_is_automatic_by_cores_and_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            torch_copy: None) -> None:
    """Auto, with torch's copy_: write while copying only with a core for each copy thread and each writer;
    True/False force it."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for cores, want in ((3, False), (4, True), (64, True), (1, False)):
            monkeypatch.setattr(copier.os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
            assert copier.overlap_pays(2) is want, cores
            with CheckpointManager(tmp_path / f"auto{cores}", writer_threads=2) as mgr:
                assert mgr.components.pipeline.overlap is want
            for forced in (True, False):
                with CheckpointManager(tmp_path / f"forced{cores}", overlap_writes=forced) as mgr:
                    assert mgr.components.pipeline.overlap is forced
    finally:
        torch.set_num_threads(torch_threads)
    with pytest.raises(ValueError, match="overlap_writes"):
        CheckpointManager(tmp_path / "bad", overlap_writes="yes")  # type: ignore[arg-type]


def test_overlap_writes_is_automatic_with_the_native_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto, with the native streaming copy: write while copying whatever the core count; False still forces the
    copy first."""
    monkeypatch.setattr(hostcopy, "available", True)
    monkeypatch.setattr(copier.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert copier.overlap_pays(2) is True
    with CheckpointManager(tmp_path / "auto") as mgr:
        assert mgr.components.pipeline.overlap is True
    with CheckpointManager(tmp_path / "off", overlap_writes=False) as mgr:
        assert mgr.components.pipeline.overlap is False
