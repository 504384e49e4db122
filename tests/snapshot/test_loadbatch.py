"""The batched checks of ``snapshot.loadbatch`` (a restore plan for a whole dict of plain tensors) must plan exactly
what the item-by-item walk of ``snapshot.load`` plans, and must leave every mismatch to that walk, which raises it
with the key path. The item-by-item walk is forced by patching ``load.plain_tensor_items`` to decline."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierckpt import CheckpointManager
from tierckpt.errors import StateMismatchError
from tierckpt.format.manifest import TensorRecord
from tierckpt.snapshot import load, loadbatch, tree


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(3, i + 1, generator=g) for i in range(10)}
    tensors["half"] = torch.randn(4, generator=g).half()
    tensors["tied"] = tensors["w3"]  # the same tensor twice: one record, referenced twice
    tensors["empty"] = torch.zeros(0)
    tensors[7] = torch.randn(2, 2, generator=g)  # an int key
    return {"plain": tensors, "nested": {"m": dict(tensors), "n": {f"k{i}": torch.ones(i) for i in range(9)}},
            "small": {"a": torch.ones(2)}, "step": 4}


def _records(state: dict[str, Any]) -> tuple[Any, tuple[TensorRecord, ...]]:
    flat = tree.flatten(state)
    recs = tuple(TensorRecord(i, s.name, p, s.dtype, s.shape, 0, 0, s.nbytes, "", k)
                 for i, (s, p, k) in enumerate(zip(flat.specs, flat.paths, flat.kinds)))
    return flat.tree, recs


def _plan_both(live: dict[str, Any], saved_tree: Any, recs: tuple[TensorRecord, ...], monkeypatch: pytest.MonkeyPatch,
               **kw: Any) -> tuple[load.RestorePlan, load.RestorePlan, int]:
    calls = []
    real = loadbatch.plain_tensor_items

    def counting(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(load, "plain_tensor_items", counting)
        batched = load.plan_restore(live, saved_tree, recs, step=1, **kw)
    with monkeypatch.context() as m:
        m.setattr(load, "plain_tensor_items", lambda *a, **k: None)
        itemwise = load.plan_restore(live, saved_tree, recs, step=1, **kw)
    return batched, itemwise, sum(calls)


def _summary(plan: load.RestorePlan) -> tuple[Any, Any, int]:
    direct = sorted((i, t.data_ptr(), t.shape) for i, t in plan.direct.items())
    copies = sorted((i, t.data_ptr(), t.shape) for t, i in plan.copies)
    return direct, copies, len(plan.actions)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("strict", [True, False])
def test_batched_plan_equals_the_item_by_item_plan(monkeypatch: pytest.MonkeyPatch, in_place: bool,
                                                   strict: bool) -> None:
    saved_tree, recs = _records(_state(0))
    live = _state(1)
    live["plain"]["strided"] = torch.zeros(2)  # not saved: allowed when not strict, so only that case has it
    if strict:
        del live["plain"]["strided"]
    batched, itemwise, n_batches = _plan_both(live, saved_tree, recs, monkeypatch, strict=strict, in_place=in_place)
    assert n_batches == 3  # "plain", "nested.m" and "nested.n" ("small" is below BATCH_MIN)
    assert _summary(batched) == _summary(itemwise)
    if in_place:
        assert batched.direct  # contiguous host tensors: read straight into


def test_batched_plan_handles_non_contiguous_neg_and_grad_tensors_like_the_walk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    saved_tree, recs = _records(_state(0))
    live = _state(2)
    live["plain"]["w5"] = torch.zeros(6, 3).t()  # right shape, strided: copied, not read into
    live["plain"]["w6"] = torch.zeros(3, 7)._neg_view()  # lazy neg bit: copied
    live["plain"]["w2"] = torch.nn.Parameter(torch.zeros(3, 3))  # requires grad: detached target, same memory
    batched, itemwise, n_batches = _plan_both(live, saved_tree, recs, monkeypatch, strict=True, in_place=True)
    assert n_batches == 3
    assert _summary(batched) == _summary(itemwise)
    targets = {t.data_ptr(): t for t in batched.direct.values()}
    w2 = targets[live["plain"]["w2"].data_ptr()]
    assert not w2.requires_grad
    assert live["plain"]["w5"].data_ptr() not in targets and live["plain"]["w6"].data_ptr() not in targets


@pytest.mark.parametrize("change, message", [
    (lambda s: s["plain"].__setitem__("w4", torch.zeros(3, 6)), r"shape mismatch.*\['plain'\]\['w4'\]"),
    (lambda s: s["plain"].__setitem__("w4", torch.zeros(3, 5, dtype=torch.float64)), r"dtype mismatch.*\['w4'\]"),
    (lambda s: s["plain"].pop("w9"), r"unexpected key in checkpoint.*\['plain'\]\['w9'\]"),
    (lambda s: s["plain"].__setitem__("new", torch.zeros(1)), r"key 'new' missing from the checkpoint"),
    (lambda s: s["plain"].__setitem__("w1", [1, 2]), r"checkpoint holds a tensor but the state has list.*\['w1'\]"),
])
def test_mismatches_in_a_batchable_dict_are_named_by_the_walk(change: Any, message: str) -> None:
    saved_tree, recs = _records(_state(0))
    live = _state(3)
    change(live)
    with pytest.raises(StateMismatchError, match=message):
        load.plan_restore(live, saved_tree, recs, strict=True, step=1)


class _Sub(torch.Tensor):
    pass


def test_batch_declines_what_it_does_not_check() -> None:
    saved_tree, recs = _records(_state(0))
    pairs = saved_tree["$dict"][0][1]["$dict"]
    live = _state(0)["plain"]
    assert loadbatch.plain_tensor_items(live, pairs, recs, strict=True) is not None

    class Mapping(dict):  # a subclass may give keys and items meanings a plain dict does not
        pass

    assert loadbatch.plain_tensor_items(Mapping(live), pairs, recs, strict=True) is None
    assert loadbatch.plain_tensor_items(live, pairs[:7], recs, strict=False) is None  # below BATCH_MIN
    bad_ref = [list(p) for p in pairs]
    bad_ref[2] = [bad_ref[2][0], {"$tensor": len(recs)}]  # out of range: the walk raises a corrupt-tree error
    assert loadbatch.plain_tensor_items(live, bad_ref, recs, strict=True) is None
    dup = [list(p) for p in pairs] + [list(pairs[0])]  # a repeated key
    assert loadbatch.plain_tensor_items(live, dup, recs, strict=False) is None
    other_tag = [list(p) for p in pairs]
    other_tag[0] = [other_tag[0][0], {"$ndarray": 0}]
    assert loadbatch.plain_tensor_items(live, other_tag, recs, strict=True) is None
    sub = dict(live)
    sub["w0"] = torch.zeros(3, 1).as_subclass(_Sub)  # a tensor subclass: the walk decides what it is
    assert loadbatch.plain_tensor_items(sub, pairs, recs, strict=True) is None


def test_restore_through_the_batches_round_trips(tmp_path: Any) -> None:
    state = _state(5)
    want = {k: v.clone() for k, v in state["plain"].items()}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state)
        mgr.wait()
        for in_place in (False, True):
            live = _state(6)
            live["plain"]["tied"] = live["plain"]["w3"]
            assert mgr.restore(live, in_place=in_place) == 1
            for k, v in want.items():
                assert torch.equal(live["plain"][k], v), (in_place, k)
            assert live["plain"]["tied"] is live["plain"]["w3"]


class _Wide(torch.nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3) for _ in range(6)])
        if extra:
            self.extra = torch.nn.Parameter(torch.full((2,), 7.0))


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "item_by_item"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_module_missing_keys_of_the_checkpoint_loads_when_not_strict(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       in_place: bool, batched: bool) -> None:
    """strict=False lets the live module have entries the checkpoint lacks (they keep their values), as
    ``load_state_dict(strict=False)`` does; strict=True names the first one. On the batched module path and item by
    item (what a module with distributed tensors or extra state takes)."""
    if not batched:
        monkeypatch.setattr(load, "plain_tensor_items", lambda *a, **k: None)
    torch.manual_seed(0)
    saved = _Wide()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"m": saved})
        mgr.wait()
        live = _Wide(extra=True)
        with pytest.raises(StateMismatchError, match="'extra' of module missing"):
            mgr.restore({"m": live}, in_place=in_place)
        assert mgr.restore({"m": live}, strict=False, in_place=in_place) == 1
        for k, v in saved.state_dict().items():
            assert torch.equal(live.state_dict()[k], v), k
        assert torch.equal(live.extra.detach(), torch.full((2,), 7.0))


def test_a_batched_module_plans_the_same_direct_targets_as_item_by_item(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    module = _Wide()
    saved_tree, recs = _records({"m": module})
    live = {"m": _Wide()}
    batched, itemwise, n_batches = _plan_both(live, saved_tree, recs, monkeypatch, strict=True, in_place=True)
    assert n_batches == 1
    assert batched.direct.keys() == itemwise.direct.keys() and len(batched.direct) == len(module.state_dict())
    assert [t.data_ptr() for t in batched.direct.values()] == [t.data_ptr() for t in itemwise.direct.values()]
    # a plain module needs no load_state_dict(): its entries were read in place; the walk still calls it
    assert not batched.actions and len(itemwise.actions) == 1 and not batched.copies


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: one saved tensor under two keys
        self.norm = torch.nn.LayerNorm(4)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(4)])  # BATCH_MIN entries and more


def _loaded_with(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, make: Any, in_place: bool) -> tuple[list[str], Any]:
    torch.manual_seed(3)
    saved = make()
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(torch.randn_like(p))
    calls: list[str] = []
    real = torch.nn.Module.load_state_dict

    def spy(self: torch.nn.Module, *a: Any, **k: Any) -> Any:
        calls.append(type(self).__name__)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "load_state_dict", spy)
    with CheckpointManager(tmp_path / str(in_place)) as mgr:
        mgr.save(1, {"m": saved})
        mgr.wait()
        live = make()
        assert mgr.restore({"m": live}, in_place=in_place) == 1
    for k, v in saved.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k
    return calls, live


@pytest.mark.parametrize("in_place", [False, True])
def test_a_plain_module_is_restored_without_load_state_dict(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                           in_place: bool) -> None:
    calls, live = _loaded_with(tmp_path, monkeypatch, _Tied, in_place)
    assert calls == []
    assert live.head.weight is live.emb.weight  # still tied


@pytest.mark.parametrize("in_place", [False, True])
def test_modules_with_their_own_loading_get_load_state_dict(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                            in_place: bool) -> None:
    seen: list[str] = []

    def hooked() -> torch.nn.Module:
        m = _Wide()
        m.layers[2].register_load_state_dict_pre_hook(lambda *a, **k: seen.append("pre-hook"))
        return m

    calls, _ = _loaded_with(tmp_path / "hook", monkeypatch, hooked, in_place)
    assert calls == ["_Wide"] and seen == ["pre-hook"]
    # BatchNorm has its own _load_from_state_dict (for num_batches_tracked); two of them: 10 entries, a batch
    calls, live = _loaded_with(tmp_path / "bn", monkeypatch,
                               lambda: torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)), in_place)
    assert calls == ["Sequential"]
