"""``snapshot.capture``: what a lazy ``save()`` takes from the state at once. Flattening the capture must give exactly
what flattening the state itself gives (same tree, leaves, paths, names), while nothing the caller changes afterwards
(containers, Python values, generators, state dicts) reaches it; only plain modules are left for later."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._support.helpers import small_mlp_after_one_step
from tierckpt import CheckpointManager
from tierckpt.snapshot import capture, tree
from tierckpt.snapshot.tree import GeneratorState, StateDictOf


class _Extra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.n = 5

    def get_extra_state(self) -> Any:
        return {"n": self.n}

    def set_extra_state(self, state: Any) -> None:
        self.n = state["n"]


def _rich_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model, opt = small_mlp_after_one_step(g)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    w = torch.randn(4, generator=g)
    return {
        "model": model, "optim": opt, "sched": sched, "extra": _Extra(),
        "plain": {f"t{i}": torch.randn(i + 1, generator=g) for i in range(9)},
        "tied": {"a": w, "b": w},
        "misc": collections.OrderedDict(
            n=3, f=2.5, s="x", none=None, flag=True, b=b"\x00\x01", ba=bytearray(b"xy"), dt=torch.float16,
            dev=torch.device("cpu"), size=torch.Size([2, 3]), tup=(1, (2.0, "z")), st={1, 2}, fs=frozenset({"q"}),
            arr=np.arange(5, dtype=np.int16), sc=np.float32(1.5), nested=[[1, 2], {"k": [3, {"z": torch.ones(2)}]}],
            ints={7: "seven", -1: [None]}),
        "gen": torch.Generator().manual_seed(seed + 1),
        "step": 12,
    }


def _flat_summary(flat: tree.FlatState) -> tuple[Any, ...]:
    return (json.dumps(flat.tree, sort_keys=True), flat.specs, flat.paths, flat.kinds, flat.stateful_paths,
            [(v.data_ptr() if isinstance(v, torch.Tensor) else v.tobytes()) for v in flat.values
             if not (isinstance(v, torch.Tensor) and v.numel() and v.dtype == torch.uint8 and v.dim() == 1)])


def test_flattening_the_capture_equals_flattening_the_state() -> None:
    state = _rich_state(0)
    direct = tree.flatten(state)
    captured = capture.capture(state)
    assert captured["model"] is state["model"]  # a plain module: its state_dict() is left for later
    assert isinstance(captured["optim"], StateDictOf) and isinstance(captured["extra"], StateDictOf)
    assert isinstance(captured["gen"], GeneratorState)
    later = tree.flatten(captured)
    assert _flat_summary(later) == _flat_summary(direct)
    # the generator's state is a copy taken at capture; the tree names it the same way
    i = later.paths.index("state['gen']")
    assert torch.equal(later.values[i], state["gen"].get_state())


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_what_changes_after_the_capture_does_not_reach_it() -> None:
    state = _rich_state(1)
    want = tree.flatten(state)
    want_gen = state["gen"].get_state().clone()
    captured = capture.capture(state)
    state["step"] = 13
    state["misc"]["nested"][1]["k"].append(4)
    state["misc"]["ba"][0] = ord("Q")
    state["plain"]["new"] = torch.zeros(1)
    del state["tied"]["b"]
    for g in state["optim"].param_groups:
        g["lr"] = 0.5
    state["sched"].step()
    state["extra"].n = 99
    torch.randn(3, generator=state["gen"])
    got = tree.flatten(captured)
    assert json.dumps(got.tree, sort_keys=True) == json.dumps(want.tree, sort_keys=True)
    assert got.specs == want.specs
    assert torch.equal(got.values[got.paths.index("state['gen']")], want_gen)


def test_only_plain_modules_are_deferred() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1)))
    assert capture.deferrable(plain)
    hooked = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    if hasattr(hooked[1], "register_state_dict_post_hook"):
        hooked[1].register_state_dict_post_hook(lambda *a: None)
    else:  # torch before 2.5
        hooked[1]._register_state_dict_hook(lambda *a: None)
    assert not capture.deferrable(hooked)
    pre = torch.nn.Linear(2, 2)
    pre.register_state_dict_pre_hook(lambda *a: None)
    assert not capture.deferrable(torch.nn.Sequential(pre))
    assert not capture.deferrable(torch.nn.Sequential(_Extra()))

    class Own(torch.nn.Linear):
        def state_dict(self, *a: Any, **k: Any) -> Any:
            return super().state_dict(*a, **k)

    assert not capture.deferrable(Own(2, 2))
    for m in (hooked, torch.nn.Sequential(pre), Own(2, 2)):
        assert isinstance(capture.capture({"m": m})["m"], StateDictOf)


@pytest.mark.parametrize("value, where", [
    (object(), r"state\['a'\]\['b'\]\[1\]"),
    (lambda: 1, r"state\['a'\]\['b'\]\[1\]"),
])
def test_values_no_checkpoint_can_hold_are_refused_with_their_path(value: Any, where: str) -> None:
    with pytest.raises(TypeError, match=where):
        capture.capture({"a": {"b": [1, value]}})
    with pytest.raises(TypeError, match="dict key of type object"):
        capture.capture({"a": {object(): 1}})
    deep: Any = 1
    for _ in range(tree.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(TypeError, match="nested deeper"):
        capture.capture({"d": deep})


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_tensor_only_the_flatten_refuses_fails_the_lazy_save_and_the_next_call(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, lazy_snapshot=True) as mgr:
        handle = mgr.save(1, {"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)})
        with pytest.raises(TypeError, match=r"quantized"):
            handle.persisted.result(30)
        with pytest.raises(TypeError, match=r"state\['q'\]"):
            mgr.wait()
        mgr.save(2, {"w": torch.ones(3)}).persisted.result(30)  # the manager goes on
        assert [s.step for s in mgr.steps()] == [2]
