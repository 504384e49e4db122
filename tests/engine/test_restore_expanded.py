"""A restore into a state holding tensors whose elements share memory (``expand``: stride 0).

Such a tensor cannot take the saved values in place (a copy into it is ill-defined; torch refuses it), so:

- in a plain container (a dict or list of the state), the restore puts a fresh tensor holding the saved values in
  its place, as it replaces a read-only numpy array or a Python value, and loads everything else as usual;
- as an entry of a module's ``state_dict()`` (a buffer), which only ``load_state_dict`` could change and cannot, the
  restore raises :class:`StateMismatchError` naming the key path while it checks the state, before any byte of the
  state changes.

Every restore path: guarded (the default from local files where large tensors hold most bytes), staged (small
tensors only), and ``in_place=True``. Real files, real torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal, clone_tree
from tierckpt import CheckpointManager, StateMismatchError
from tierckpt.engine import restore as _restore
from tierckpt.snapshot.loadbatch import overlaps_itself

pytestmark = pytest.mark.timeout(120)

MODES = ["guarded", "staged", "in_place"]


def _state(seed: int, *, big: bool) -> dict[str, Any]:
    """A state with expanded tensors under a small dict, in a list, and among the tensors of a batched dict."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {
        "w": torch.randn(33, generator=g),
        "x": torch.randn(4, generator=g).expand(3, 4),
        "scalar": torch.tensor(float(seed)).expand(8),
        "items": [torch.randn(5, generator=g), torch.randn(1, 6, generator=g).expand(2, 6)],
        # at least tree.BATCH_MIN tensors: the batched checks of the save and of the restore's plan
        "many": {f"t{i}": torch.randn(7, generator=g) for i in range(9)},
        "step": seed,
    }
    state["many"]["t4"] = torch.randn(7, 1, generator=g).expand(7, 3)
    if big:  # a large tensor holds most bytes: the default restore of local files is guarded
        state["big"] = torch.randn(2 * _restore.DIRECT_READ_MIN_BYTES // 4, generator=g)
    return state


def _restore_kwargs(mode: str) -> dict[str, Any]:
    return {"in_place": True} if mode == "in_place" else {}


@pytest.mark.parametrize("mode", MODES)
def test_expanded_values_in_containers_are_replaced_by_the_saved_values(tmp_path: Path, mode: str) -> None:
    big = mode != "staged"
    saved = _state(1, big=big)
    want = clone_tree(saved)  # the saved values, materialised
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, saved)
        mgr.wait()
        target = _state(2, big=big)
        live_w, live_big = target["w"], target.get("big")
        assert mgr.restore(target, **_restore_kwargs(mode)) == 1
    assert_tree_equal(target, want)
    for got in (target["x"], target["scalar"], target["items"][1], target["many"]["t4"]):
        assert got.is_contiguous()
    # the other tensors were loaded in place, as always
    assert target["w"] is live_w
    if big:
        assert target["big"] is live_big


class _Masked(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g))
        self.register_buffer("mask", torch.randn(4, generator=g).expand(3, 4))
        for i in range(8):  # enough entries for the batched check of a module's state_dict()
            self.register_buffer(f"b{i}", torch.randn(3, generator=g))


@pytest.mark.parametrize("mode", MODES)
def test_expanded_module_buffer_is_refused_before_anything_changes(tmp_path: Path, mode: str) -> None:
    big = mode != "staged"
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, {"model": _Masked(1), **_state(1, big=big)})
        mgr.wait()
        target = {"model": _Masked(2), **_state(2, big=big)}
        before = clone_tree({"model": dict(target["model"].state_dict()), **{k: v for k, v in target.items()
                                                                            if k != "model"}})
        with pytest.raises(StateMismatchError, match=r"expand.*state\[.model.\]\[.mask.\]"):
            mgr.restore(target, **_restore_kwargs(mode))
        after = {"model": dict(target["model"].state_dict()), **{k: v for k, v in target.items() if k != "model"}}
        assert_tree_equal(clone_tree(after), before)
        # the manager keeps working: a state whose buffer has memory of its own loads the step
        fixed = {"model": _Masked(3), **_state(3, big=big)}
        fixed["model"].mask = fixed["model"].mask.clone()
        assert mgr.restore(fixed, **_restore_kwargs(mode)) == 1
        assert torch.equal(fixed["model"].mask, _Masked(1).mask)


def test_overlaps_itself_tells_shared_elements_from_strided_views() -> None:
    base = torch.arange(24.0)
    assert not overlaps_itself(base.view(4, 6))
    assert not overlaps_itself(base.view(4, 6).t())  # transposed
    assert not overlaps_itself(base[::2])  # every other element
    assert not overlaps_itself(base.as_strided((3, 2), (2, 3)))  # interleaved strides, offsets all distinct
    assert not overlaps_itself(base[:1].expand(1, 1, 5)[:, :, :1])  # a stride 0 over one element only
    assert overlaps_itself(base[:4].expand(3, 4))
    assert overlaps_itself(torch.tensor(1.0).expand(8))
    assert overlaps_itself(base.as_strided((3, 4), (1, 1)))  # sliding windows
