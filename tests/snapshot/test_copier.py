"""The steady-state save path: many small tensors copied by several threads, and the per-save caches (flatten memo,
plan records) that must never stand in for what the new state holds.

Every check restores into freshly zeroed tensors and compares bytes, so a chunk copied twice, skipped, or copied
from a stale source fails here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tensor_equal, zeros_like_tree
from tierckpt import CheckpointManager
from tierckpt.snapshot import copier, hostcopy

pytestmark = pytest.mark.timeout(120)

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool,
           torch.float64, torch.int8]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, subnormals included), so the comparison is of bytes."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _many_small(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        dtype = _DTYPES[i % len(_DTYPES)]
        shape = (1 + i % 13, 1 + i % 5) if i % 3 else (1 + i % 37,)
        out[f"layer.{i}.w"] = _random_bits(shape, dtype, g)
    return out


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """The threaded copy uses up to ``torch.get_num_threads()`` threads: make sure there are at least 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def copy_threads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records (thread name, tensor count) of every batch copy of host tensors."""
    calls: list[tuple[str, int]] = []
    real = copier._copy_tensors

    def spy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *rest: Any) -> None:
        calls.append((threading.current_thread().name, len(dsts)))
        real(dsts, srcs, *rest)

    monkeypatch.setattr(copier, "_copy_tensors", spy)
    return calls


def _assert_state_equal(got: dict, want: dict, where: str = "state") -> None:
    assert list(got) == list(want), where
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_state_equal(got[k], v, f"{where}[{k!r}]")
        else:
            assert_tensor_equal(got[k], v, f"{where}[{k!r}]")


@pytest.fixture
def native_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the bytes of every call into the native copy."""
    if not hostcopy.available:
        pytest.skip("the native host copy (tierckpt.host._hostcopy) is not built")
    real = hostcopy._hostcopy
    calls: list[int] = []

    class Spy:
        @staticmethod
        def copy(dst: Any, src: Any, lengths: Any, *rest: Any) -> None:
            calls.append(int(lengths.sum()))
            real.copy(dst, src, lengths, *rest)

    monkeypatch.setattr(hostcopy, "_hostcopy", Spy)
    return calls


@pytest.mark.parametrize("path", ["torch", "native", "native-plain"])
def test_many_small_tensors_copied_by_threads_round_trip(tmp_path: Path, two_torch_threads: None,
                                                         copy_threads: list[tuple[str, int]], path: str,
                                                         request: pytest.FixtureRequest) -> None:
    """torch's path splits the small tensors over the pool's copy threads. The native copy takes every tensor of a
    batch in one call when all are plain ("native-plain"); with a strided source among them ("native") that batch
    goes the fallback way: large plain tensors natively, the rest through torch on the calling thread."""
    native = request.getfixturevalue("native_bytes") if path.startswith("native") else None
    if native is None:
        request.getfixturevalue("torch_copy")
    small = _many_small(copier.THREADED_MIN_TENSORS * 2 + 37, seed=1)
    g = torch.Generator().manual_seed(2)
    if path != "native-plain":
        base = _random_bits((40, 24), torch.bfloat16, g)
        small["transposed"] = base.t()  # non-contiguous source
        small["strided_rows"] = _random_bits((30, 8), torch.float32, g)[::3]
        assert not small["transposed"].is_contiguous() and not small["strided_rows"].is_contiguous()
    small["empty_f32"] = torch.empty(0)
    small["empty_bf16"] = torch.empty((4, 0), dtype=torch.bfloat16)
    small["empty_i64"] = torch.empty((0, 3), dtype=torch.int64)
    small["scalar"] = _random_bits((), torch.float64, g)
    state = {
        "small": small,
        # copied in chunks of equal cost: one by the calling thread, the others by the copy threads
        "large": {"emb": _random_bits((1024, 512), torch.float32, g),
                  "emb_bf16": _random_bits((2048, 300), torch.bfloat16, g)},
        "step": 7,
    }
    assert state["large"]["emb"].nbytes >= copier.SMALL_TENSOR_BYTES
    with CheckpointManager(tmp_path / "c") as mgr:
        for step in (1, 2, 3):  # the first save plans; later ones take the cached steady-state path
            copy_threads.clear()
            if native is not None:
                native.clear()
            want = {k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v for k, v in state.items()}
            mgr.save(step, state)
            mgr.wait()
            on_workers = sum(n for name, n in copy_threads if name.startswith("tierckpt-copy"))
            tensors = [*small.values(), *state["large"].values()]
            if native is None:
                assert on_workers >= len(small) // 4, f"small tensors were not split over copy threads: {copy_threads}"
            else:
                assert on_workers == 0, copy_threads  # the native copy has threads of its own
            if path == "native-plain":  # every byte in native batch calls, none through torch
                assert sum(native) == sum(t.nbytes for t in tensors), native
            elif native is not None:  # the fallback: the large plain ones natively, one by one
                large = [t for t in state["large"].values() if t.nbytes >= hostcopy.MIN_BYTES]
                assert len(large) == 2 and sum(native) == sum(t.nbytes for t in large), native
            assert sum(n for _, n in copy_threads) == len(small) + 2 - 3, copy_threads  # all but the 3 empty ones
            fresh = {"small": zeros_like_tree(small), "large": zeros_like_tree(state["large"]), "step": 0}
            assert mgr.restore(fresh) == step
            _assert_state_equal(fresh["small"], want["small"], "small")
            _assert_state_equal(fresh["large"], want["large"], "large")
            assert fresh["step"] == 7
            for t in list(small.values()) + list(state["large"].values()):  # new values for the next save
                if t.numel():
                    t.copy_(_random_bits(tuple(t.shape), t.dtype, g))


def test_replaced_tensor_is_copied_from_the_new_object(tmp_path: Path, two_torch_threads: None) -> None:
    state = {"model": _many_small(600, seed=3), "opt": _many_small(40, seed=4)}
    g = torch.Generator().manual_seed(5)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        mgr.wait()
        old = state["model"]["layer.10.w"]
        kept_alive = old  # the old object stays alive and unchanged: a stale cached source would still be readable
        new = _random_bits(tuple(old.shape), old.dtype, g)
        while torch.equal(new, old):
            new = _random_bits(tuple(old.shape), old.dtype, g)
        state["model"]["layer.10.w"] = new  # same key, shape and dtype: same plan, different object
        # a new dict object holding the same tensors, and a tensor rebound in place to other memory
        state["opt"] = dict(state["opt"])
        rebound = state["opt"]["layer.3.w"]
        rebound.data = _random_bits(tuple(rebound.shape), rebound.dtype, g)
        want = {k: {n: t.clone() for n, t in v.items()} for k, v in state.items()}
        mgr.save(2, state)
        mgr.wait()
        fresh = {k: zeros_like_tree(v) for k, v in state.items()}
        assert mgr.restore(fresh) == 2
        _assert_state_equal(fresh, want)
        assert not torch.equal(fresh["model"]["layer.10.w"], kept_alive)


def test_changed_dtype_shape_and_keys_make_a_new_plan(tmp_path: Path, two_torch_threads: None) -> None:
    state = {"model": _many_small(300, seed=6)}
    g = torch.Generator().manual_seed(7)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        mgr.wait()
        first_plan = mgr.components.pipeline.plan
        changes = [
            ("dtype", lambda m: m.__setitem__("layer.4.w", m["layer.4.w"].to(torch.float64))),
            ("shape", lambda m: m.__setitem__("layer.5.w", _random_bits((9, 2), torch.float32, g))),
            ("key", lambda m: m.__setitem__("renamed", m.pop("layer.6.w"))),
            ("alias", lambda m: m.__setitem__("layer.8.w", m["layer.7.w"])),  # tied: stored once from now on
        ]
        plans = [first_plan]
        for step, (what, change) in enumerate(changes, start=2):
            change(state["model"])
            want = {n: t.clone() for n, t in state["model"].items()}
            mgr.save(step, state)
            mgr.wait()
            assert mgr.components.pipeline.plan is not plans[-1], f"a changed {what} reused the old plan"
            plans.append(mgr.components.pipeline.plan)
            fresh = {"model": zeros_like_tree(state["model"])}
            assert mgr.restore(fresh) == step
            _assert_state_equal(fresh["model"], want, what)
        assert mgr.records()[-1].tensors == len(state["model"]) - 1  # the alias is one tensor


def test_a_failing_copy_thread_fails_the_save_and_frees_the_slot(tmp_path: Path, two_torch_threads: None,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  torch_copy: None) -> None:
    state = {"model": _many_small(copier.THREADED_MIN_TENSORS * 2, seed=8)}
    real = copier._copy_tensors

    def failing(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *rest: Any) -> None:
        if threading.current_thread().name.startswith("tierckpt-copy"):
            raise RuntimeError("injected copy failure")
        real(dsts, srcs, *rest)

    mgr = CheckpointManager(tmp_path / "c")
    mgr.save(1, state)
    mgr.wait()
    monkeypatch.setattr(copier, "_copy_tensors", failing)
    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            mgr.save(2, state)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=save, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # not closing the manager: close() would wait for the hung copy too
        pytest.fail("save() hung after a copy thread failed")
    with mgr:
        assert isinstance(outcome[0], RuntimeError) and "injected" in str(outcome[0]), outcome
        monkeypatch.setattr(copier, "_copy_tensors", real)
        want = {n: t.clone() for n, t in state["model"].items()}
        mgr.save(3, state)  # the slot came back
        mgr.wait()
        fresh = {"model": zeros_like_tree(state["model"])}
        assert mgr.restore(fresh) == 3
        _assert_state_equal(fresh["model"], want)
