"""Tensors no checkpoint holds: nested (strided and jagged layouts), sparse (COO, CSR), quantized and meta tensors.

``save()`` raises ``TypeError`` naming the key path and what the tensor is, before a staging slot is taken or a
byte is written, whether the tensor sits alone under its key, in a dict of tensors that the flatten encodes in one
batch, or in a module's ``state_dict()``; the manager keeps working and the same step number saves and restores
afterwards. A lazy save reports it from its futures and the next call, as for every tensor only the flatten sees.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal, leftovers
from tierckpt import CheckpointManager, StateMismatchError

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore")]


def _nested_strided() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])


def _nested_jagged() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)


KINDS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "nested_strided": (_nested_strided, "nested tensor"),
    "nested_jagged": (_nested_jagged, "nested tensor"),
    "sparse_coo": (lambda: torch.randn(4, 4).to_sparse(), r"sparse tensor \(torch.sparse_coo\)"),
    "sparse_csr": (lambda: torch.randn(4, 4).to_sparse_csr(), r"sparse tensor \(torch.sparse_csr\)"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
                  r"quantized tensor \(torch.qint8\)"),
    "meta": (lambda: torch.empty(4, device="meta"), "meta tensor"),
}


class _WithBuffer(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("odd", value)


def _placed(where: str, value: torch.Tensor) -> tuple[dict[str, Any], str]:
    """A state holding ``value`` ``where``, and the key path the error must name."""
    if where == "alone":
        return {"model": {"x": value, "w": torch.ones(3)}}, r"state\['model'\]\['x'\]"
    if where == "batch":  # enough plain tensors for the flatten's one-batch encoding of the dict
        many: dict[str, Any] = {f"t{i}": torch.ones(2) for i in range(9)}
        many["t5"] = value
        return {"model": many}, r"state\['model'\]\['t5'\]"
    return {"model": _WithBuffer(value)}, r"state\['model'\]\['odd'\]"


@pytest.mark.parametrize("where", ["alone", "batch", "module"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_save_refuses_with_the_key_path_and_the_manager_goes_on(tmp_path: Path, kind: str, where: str) -> None:
    make, what = KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = make()
    state, path = _placed(where, value)
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        with pytest.raises(TypeError, match=what) as info:
            mgr.save(1, state)
        assert path.replace("\\", "") in str(info.value), str(info.value)
        assert leftovers(root) == [] and mgr.steps() == []  # nothing written, no step taken
        good = {"model": {"w": torch.arange(3.0)}, "step": 1}
        mgr.save(1, good).persisted.result(30)  # the same step number: the failed save took nothing
        target = {"model": {"w": torch.zeros(3)}, "step": 0}
        assert mgr.restore(target) == 1
    assert_tree_equal(target, good)


def test_a_nested_tensor_fails_a_lazy_save_and_the_next_call(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, lazy_snapshot=True) as mgr:
        handle = mgr.save(1, {"model": {"x": _nested_strided()}})
        with pytest.raises(TypeError, match="nested tensor"):
            handle.persisted.result(30)
        with pytest.raises(TypeError, match=r"state\['model'\]\['x'\]"):
            mgr.wait()
        mgr.save(2, {"w": torch.ones(3)}).persisted.result(30)
        assert [s.step for s in mgr.steps()] == [2]


@pytest.mark.parametrize("where", ["alone", "batch", "module"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_restore_into_such_a_tensor_is_refused_before_anything_changes(tmp_path: Path, kind: str,
                                                                       where: str) -> None:
    """The other way round: a checkpoint of dense tensors, restored into a state holding one of these tensors where
    a dense one was saved (a copy into a sparse or nested tensor is not defined; one into a meta tensor does
    nothing, so the restore would report success having loaded nothing)."""
    make, what = KINDS[kind]
    what = f"into the state's {what}"
    saved, _ = _placed(where, torch.full((4, 4), 2.0))
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, saved).persisted.result(30)
        for in_place in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target, path = _placed(where, make())
            plain = target["model"].lin.weight if where == "module" else target["model"]["w" if where == "alone"
                                                                                          else "t0"]
            before = plain.detach().clone()
            with pytest.raises(StateMismatchError, match=what) as info:
                mgr.restore(target, in_place=in_place)
            assert path.replace("\\", "") in str(info.value), str(info.value)
            assert torch.equal(plain, before)  # nothing changed
