"""The batched encodings of ``snapshot.tree`` (a dict of tensors, and a dict of such dicts, e.g. an optimizer's
per-parameter state) must produce exactly what the item-by-item path produces: the same tree, leaf order, paths,
names, dtypes, shapes and aliases, on the first flatten and with the previous flatten's memo.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests._support.helpers import small_mlp_after_one_step
from tierckpt.snapshot import tree


def _optimizer_like(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    model, opt = small_mlp_after_one_step(g)
    state: dict[str, Any] = {"model": model, "optim": opt}
    # a hand-made per-key state: int and str keys, an empty inner dict, an empty tensor, mixed dtypes
    state["extra"] = {
        0: {"step": torch.tensor(3.0), "m": torch.randn(4, generator=g), "v": torch.randn(2, 2, generator=g)},
        1: {},
        "w": {"": torch.zeros(0), "q": torch.randint(0, 9, (3,), generator=g, dtype=torch.int64)},
        7: {"b": torch.randn(5, generator=g).to(torch.bfloat16), "h": torch.randn(1, generator=g).half()},
    }
    return state


def _flatten_both(state: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                  memo: tuple[Any, Any] = (None, None)) -> tuple[tree.FlatState, tree.FlatState]:
    batched = tree.flatten(state, memo[0])
    with monkeypatch.context() as m:
        m.setattr(tree, "BATCH_MIN", 10**9)  # every dict item by item
        m.setattr(tree._Flattener, "encode_tensor_dicts", lambda *a: None)
        itemwise = tree.flatten(state, memo[1])
    return batched, itemwise


def _same(a: tree.FlatState, b: tree.FlatState) -> None:
    assert json.dumps(a.tree, sort_keys=True) == json.dumps(b.tree, sort_keys=True)
    assert a.specs == b.specs
    assert a.paths == b.paths
    assert a.kinds == b.kinds and a.all_cpu == b.all_cpu
    assert len(a.values) == len(b.values)
    # the same memory (a module's state_dict() returns new tensor objects over its parameters every call)
    assert [(x.data_ptr(), x.dtype, x.shape) for x in a.values] == [(y.data_ptr(), y.dtype, y.shape) for y in b.values]
    for flat in (a, b):  # the addresses the save's copy reuses are those of the values, on every path
        assert len(flat.ptrs) == len(flat.values)
        for ptr, value, spec in zip(flat.ptrs, flat.values, flat.specs, strict=True):
            if isinstance(value, torch.Tensor) and spec.nbytes:
                assert ptr == value.data_ptr(), spec.name


def test_nested_batch_encodes_like_the_per_item_path(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _optimizer_like(1)
    calls: list[int] = []
    real = tree._Flattener.encode_tensor_dicts

    def spy(self: Any, obj: dict, path: str, prefix: str | None) -> Any:
        out = real(self, obj, path, prefix)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(tree._Flattener, "encode_tensor_dicts", spy)
    batched = tree.flatten(state)
    assert any(calls), "no dict of dicts took the batched path"
    monkeypatch.undo()
    b2, itemwise = _flatten_both(state, monkeypatch)
    _same(batched, itemwise)
    _same(b2, itemwise)
    # with each path's memo of the last flatten, after the values changed in place and a key was added
    state["extra"][0]["m"].add_(1)
    state["extra"][1]["new"] = torch.ones(2)
    again, again_itemwise = _flatten_both(state, monkeypatch, (b2.memo, itemwise.memo))
    _same(again, again_itemwise)
    assert "new" in json.dumps(again.tree)


def test_nested_batch_falls_back_for_aliases_and_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(8)
    state = {
        "tied": {0: {"a": w, "b": torch.randn(3)}, 1: {"c": w, "d": torch.randn(2)}, 2: {"e": torch.randn(9)},
                 3: {"f": torch.randn(4), "g": torch.randn(4), "h": torch.randn(4)}},  # w twice: stored once
        "mixed": {0: {"a": torch.randn(3), "n": 5}, 1: {"b": torch.randn(2)}, 2: {"c": torch.randn(2)},
                  3: {"d": torch.randn(2), "e": torch.randn(2), "f": torch.randn(2), "g": torch.randn(2)}},
    }
    batched, itemwise = _flatten_both(state, monkeypatch)
    _same(batched, itemwise)
    assert sum(v is w for v in batched.values) == 1
    assert json.dumps(batched.tree).count('"$tensor"') == len(batched.values) + 1  # the alias is referenced twice
