"""Every state type round-trips bit-exactly through a real checkpoint folder; saving never touches the RNGs;
the checkpoint holds the values at save() even when tensors change right after; the handle's futures."""

from __future__ import annotations

import concurrent.futures
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests._support.helpers import (
    assert_array_equal,
    assert_tensor_equal,
    assert_tree_equal,
    clone_tree,
    module_snapshot,
    train_steps,
)
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(120)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight  # tied
        self.norm = nn.LayerNorm(6)
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.norm(x))))


def _train_a_bit(model: nn.Module, opt: torch.optim.Optimizer, sched, steps: int, seed: int) -> None:
    train_steps(model, opt, steps, seed, (4, 6), sched)
    model.counter += steps


def _make_training_objects(seed: int):
    torch.manual_seed(seed)
    model = Tied()
    opt = torch.optim.AdamW(
        [
            {"params": [model.a.weight, model.a.bias, model.b.bias], "lr": 1e-2},
            {"params": list(model.norm.parameters()), "lr": 3e-3, "weight_decay": 0.0},
        ],
        betas=(0.8, 0.95),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def test_modules_optimizer_scheduler_round_trip(tmp_path: Path) -> None:
    model, opt, sched = _make_training_objects(0)
    _train_a_bit(model, opt, sched, steps=5, seed=1)
    want_model = module_snapshot(model)
    want_opt = clone_tree(opt.state_dict())
    want_sched = clone_tree(sched.state_dict())
    assert set(want_opt["state"]) == {0, 1, 2, 3, 4}  # int keys, really present

    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(10, {"model": model, "opt": opt, "sched": sched})
        mgr.wait()

    model2, opt2, sched2 = _make_training_objects(123)  # fresh, different values, never stepped
    assert not torch.equal(model2.a.weight, model.a.weight)
    with CheckpointManager(tmp_path / "ckpt") as mgr2:
        got = mgr2.restore({"model": model2, "opt": opt2, "sched": sched2})
    assert got == 10 and type(got) is int

    assert model2.a.weight is model2.b.weight, "tied parameters came back untied"
    assert model2.a.weight.data_ptr() == model2.b.weight.data_ptr()
    for k, v in want_model.items():
        assert_tensor_equal(model2.state_dict()[k], v, f"model.{k}")
    assert_tree_equal(opt2.state_dict(), want_opt, "opt")
    assert_tree_equal(sched2.state_dict(), want_sched, "sched")
    assert sched2.get_last_lr() == sched.get_last_lr()
    # the restored optimizer drives the same parameters as the restored model
    assert opt2.param_groups[0]["params"][0] is model2.a.weight


def test_grad_scaler_round_trip(tmp_path: Path) -> None:
    amp = getattr(torch, "amp", None)
    if amp is None or not hasattr(amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler not available")
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    except (RuntimeError, TypeError, ValueError) as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"no CPU GradScaler: {exc}")
    if not scaler.is_enabled():
        pytest.skip("CPU GradScaler disabled in this build")
    # move it away from its defaults: one overflow step (backoff) and one good step (growth tracker)
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for bad in (True, False):
        opt.zero_grad()
        loss = (p * (float("inf") if bad else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    want = clone_tree(scaler.state_dict())
    assert want["scale"] == 512.0 and want["_growth_tracker"] == 1

    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"scaler": scaler})
        mgr.wait()
        fresh = torch.amp.GradScaler("cpu")
        assert mgr.restore({"scaler": fresh}) == 1
    assert_tree_equal(fresh.state_dict(), want, "scaler")
    assert fresh.get_scale() == 512.0


def _rng_state() -> dict:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    for _ in range(3):
        random.random()
        np.random.rand()
        torch.rand(1)
    gen = torch.Generator().manual_seed(77)
    torch.rand(5, generator=gen)
    return {
        "py": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "gen": gen.get_state(),
    }


def test_rng_states_round_trip_and_drive_identical_draws(tmp_path: Path) -> None:
    state = _rng_state()
    want = clone_tree(state)
    assert type(state["py"]) is tuple and type(state["py"][1]) is tuple
    assert type(state["np"]) is tuple and isinstance(state["np"][1], np.ndarray)

    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(3, state)
        mgr.wait()

    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    fresh = {
        "py": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "gen": torch.Generator().manual_seed(5).get_state(),
    }
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.restore(fresh) == 3

    assert type(fresh["py"]) is tuple, f"random.getstate() came back as {type(fresh['py']).__name__}"
    assert type(fresh["py"][1]) is tuple, "inner tuple of random.getstate() not a tuple"
    assert fresh["py"] == want["py"]
    assert type(fresh["np"]) is tuple
    assert fresh["np"][0] == want["np"][0] and type(fresh["np"][0]) is str
    assert_array_equal(fresh["np"][1], want["np"][1], "np[1]")
    assert fresh["np"][2:] == want["np"][2:]
    assert [type(x) for x in fresh["np"][2:]] == [type(x) for x in want["np"][2:]]
    assert_tensor_equal(fresh["torch"], want["torch"], "torch")
    assert_tensor_equal(fresh["gen"], want["gen"], "gen")

    # the restored states produce the same draws as the original ones
    random.setstate(fresh["py"])
    a = [random.random() for _ in range(5)]
    random.setstate(want["py"])
    assert a == [random.random() for _ in range(5)]
    np.random.set_state(fresh["np"])
    b = np.random.rand(5)
    np.random.set_state(want["np"])
    assert np.array_equal(b, np.random.rand(5))
    g1, g2 = torch.Generator(), torch.Generator()
    g1.set_state(fresh["gen"])
    g2.set_state(want["gen"])
    assert torch.equal(torch.rand(5, generator=g1), torch.rand(5, generator=g2))


def _tensor_zoo() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    f16 = torch.randn(17, generator=g).to(torch.float16)
    f16[0], f16[1], f16[2] = float("inf"), float("nan"), -0.0
    base = torch.randn(5, 8, generator=g)
    return {
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "f16": f16,
        "f32": torch.randn(3, 5, 7, generator=g),
        "f64": torch.randn(6, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-1000, 1000, (2, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar_f32": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "scalar_bool": torch.tensor(True),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(4, 0, dtype=torch.bfloat16),
        "transposed": base.t(),
        "sliced": base[1:4, ::3],
    }


def _fresh_like(zoo: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in zoo.items():
        if k == "transposed":
            out[k] = torch.zeros(5, 8).t()
        elif k == "sliced":
            out[k] = torch.zeros(5, 8)[1:4, ::3]
        else:
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
    return out


def test_tensor_dtypes_shapes_and_views_round_trip(tmp_path: Path) -> None:
    zoo = _tensor_zoo()
    assert not zoo["transposed"].is_contiguous() and not zoo["sliced"].is_contiguous()
    want = {k: v.clone() for k, v in zoo.items()}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, zoo)
        mgr.wait()
        fresh = _fresh_like(zoo)
        targets = dict(fresh)
        assert mgr.restore(fresh) == 1
    for k, v in want.items():
        assert_tensor_equal(fresh[k], v, k)
        # tensors are loaded in place (copy_), including into non-contiguous views
        assert fresh[k] is targets[k], f"{k}: tensor replaced instead of copied into"


def test_numpy_arrays_round_trip(tmp_path: Path) -> None:
    rs = np.random.RandomState(5)
    base = rs.standard_normal((6, 4))
    arrays = {
        "f64": rs.standard_normal(10),
        "f32": rs.standard_normal((3, 4)).astype(np.float32),
        "f16": rs.standard_normal(7).astype(np.float16),
        "i32": rs.randint(-50, 50, size=(2, 2, 2)).astype(np.int32),
        "u32": rs.randint(0, 2**31, size=624).astype(np.uint32),
        "bool": rs.rand(9) > 0.3,
        "empty": np.zeros((0, 5)),
        "zero_d": np.array(2.5),
        "view": base.T[:, ::2],
    }
    want = {k: v.copy() for k, v in arrays.items()}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {"arrays": arrays})
        mgr.wait()
        fresh_arrays = {k: np.zeros_like(v) for k, v in arrays.items()}
        fresh = {"arrays": fresh_arrays}
        assert mgr.restore(fresh) == 1
    for k, v in want.items():
        assert_array_equal(fresh["arrays"][k], v, k)


def _nested_plain() -> dict:
    return {
        "ints": [0, -1, 2**62, -(2**63)],
        "floats": [1.5, float("inf"), float("-inf"), float("nan"), -0.0, 1e-310, 0.1],
        "strs": ["", "héllo wörld", "\x00nul", "a\nb"],
        "flags": [True, False, None],
        "bytes": b"\x00\xff\x10binary",
        "empty_bytes": b"",
        "tuple": (1, (2.0, "x", (None, b"y")), []),
        "int_keys": {0: "zero", 7: [1, 2], -3: {"x": 1}},
        "empty": {"list": [], "dict": {}, "tuple": ()},
        "deep": {"a": {"b": {"c": [{"d": (1, 2)}]}}},
    }


def test_nested_plain_values_round_trip(tmp_path: Path) -> None:
    plain = _nested_plain()
    want = clone_tree(plain)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, generator=g)
    state = {
        "cfg": plain,
        "mixed": {"t": t, 5: (torch.arange(4), "tag")},
        "step": 41,
        "lr": 0.25,
        "name": "run",
    }
    want_t, want_arange = t.clone(), torch.arange(4)
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(2, state, metadata={"note": "plain"})
        mgr.wait()
        old = _nested_plain()  # same structure, other values
        old["ints"] = [9, 9, 9, 9]
        old["floats"] = [0.0] * 7
        old["strs"] = ["old"] * 4
        old["flags"] = [False, True, 1]
        old["bytes"] = b"old"
        old["tuple"] = (0, (0.0, "", (1, b"")), [])
        old["int_keys"] = {0: "", 7: [0, 0], -3: {"x": 0}}
        fresh = {
            "cfg": old,
            "mixed": {"t": torch.zeros(3), 5: (torch.zeros(4, dtype=torch.int64), "old")},
            "step": 0,
            "lr": 0.0,
            "name": "",
        }
        assert mgr.restore(fresh) == 2

    assert_tree_equal(fresh["cfg"], want, "cfg")
    assert fresh["step"] == 41 and type(fresh["step"]) is int
    assert fresh["lr"] == 0.25 and type(fresh["lr"]) is float
    assert fresh["name"] == "run"
    assert_tensor_equal(fresh["mixed"]["t"], want_t, "mixed.t")
    tup = fresh["mixed"][5]
    assert type(tup) is tuple and len(tup) == 2
    assert_tensor_equal(tup[0], want_arange, "mixed[5][0]")
    assert tup[1] == "tag"
    assert math.isnan(fresh["cfg"]["floats"][3])
    assert math.copysign(1.0, fresh["cfg"]["floats"][4]) == -1.0


def test_shared_tensor_in_plain_state_round_trips(tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.float32)
    state = {"x": t, "y": t, "nested": [t]}
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, state)
        mgr.wait()
        u = torch.zeros(10)
        fresh = {"x": u, "y": u, "nested": [u]}
        assert mgr.restore(fresh) == 1
    assert fresh["x"] is u and fresh["y"] is u
    assert_tensor_equal(u, torch.arange(10, dtype=torch.float32), "shared")


def test_save_never_touches_global_rngs(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    model, opt, sched = _make_training_objects(4)
    _train_a_bit(model, opt, sched, steps=2, seed=5)
    state = {"model": model, "opt": opt, "sched": sched, "zoo": _tensor_zoo(), "cfg": _nested_plain()}
    random.seed(21)
    np.random.seed(22)
    torch.manual_seed(23)
    before_py, before_np, before_t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    with CheckpointManager(tmp_path / "c") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
        mgr.wait()
        after_py, after_np, after_t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert after_py == before_py, "save() changed the python random state"
    assert (
        after_np[0] == before_np[0]
        and np.array_equal(after_np[1], before_np[1])
        and after_np[2:] == before_np[2:]
    )
    assert torch.equal(after_t, before_t), "save() changed the torch RNG state"
    assert random.getstate() == before_py and torch.equal(torch.get_rng_state(), before_t)


def test_in_place_change_after_save_does_not_change_checkpoint(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    big = torch.randn(1 << 20, generator=g)  # 4 MiB: the write takes a while
    small = torch.randn(7, generator=g)
    arr = np.arange(4096, dtype=np.float64)
    lin = nn.Linear(64, 64)
    state = {"big": big, "small": small, "arr": arr, "lin": lin}
    want = {"big": big.clone(), "small": small.clone(), "arr": arr.copy(), "lin": module_snapshot(lin)}
    with CheckpointManager(tmp_path / "c") as mgr:
        h = mgr.save(1, state)
        # the optimizer step, right away
        big.add_(1.0)
        small.mul_(-3.0)
        arr += 5
        with torch.no_grad():
            lin.weight.zero_()
            lin.bias.fill_(7.0)
        mgr.wait()
        assert h.persisted.done()
    fresh = {
        "big": torch.zeros_like(big),
        "small": torch.zeros(7),
        "arr": np.zeros(4096),
        "lin": nn.Linear(64, 64),
    }
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.restore(fresh) == 1
    assert_tensor_equal(fresh["big"], want["big"], "big")
    assert_tensor_equal(fresh["small"], want["small"], "small")
    assert_array_equal(fresh["arr"], want["arr"], "arr")
    for k, v in want["lin"].items():
        assert_tensor_equal(fresh["lin"].state_dict()[k], v, f"lin.{k}")


def test_handle_futures_latest_step_and_empty_restore(tmp_path: Path) -> None:
    root = tmp_path / "does" / "not" / "exist"
    with CheckpointManager(root) as mgr:
        assert root.is_dir(), "local_dir is created if missing"
        assert mgr.latest_step() is None
        sentinel = torch.ones(3)
        empty = {"t": sentinel, "v": 5}
        assert mgr.restore(empty) is None
        assert torch.equal(sentinel, torch.ones(3)) and empty["v"] == 5

        h = mgr.save(7, {"t": torch.arange(3.0)})
        for name in ("staged", "persisted", "uploaded"):
            fut = getattr(h, name)
            assert isinstance(fut, concurrent.futures.Future), f"handle.{name} is {type(fut).__name__}"
        assert h.staged.done(), "save() returned before the snapshot was staged"
        mgr.wait()
        assert h.persisted.done() and h.persisted.exception() is None
        assert h.uploaded.done() and h.uploaded.exception() is None  # no remote: nothing to wait for
        assert mgr.latest_step() == 7
        h2 = mgr.save(9, {"t": torch.arange(3.0)})
        h2.persisted.result(timeout=60)
        assert mgr.latest_step() == 9
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 9
        fresh = {"t": torch.zeros(3)}
        assert mgr.restore(fresh, step=7) == 7
        assert torch.equal(fresh["t"], torch.arange(3.0))
