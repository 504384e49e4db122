"""tierckpt's DCP reader never hands DCP's planner bytes that only a full unpickle can load.

DCP stores every non-tensor value as a ``BYTE_IO`` item, ``torch.save``d, and its ``DefaultLoadPlanner.load_bytes``
unpickles it with ``torch.load(weights_only=False)``: whoever can write a tier could run code on every rank that
loads (tierckpt's checksums are unkeyed). By default ``tierckpt.dcp.StorageReader`` loads each byte item with
``weights_only=True`` first and refuses one that does not load that way (a ``CheckpointError`` naming the item's
FQN and the step, before the planner sees any of its bytes); ``allow_pickle=True`` hands trusted checkpoints' bytes
on as they are.

Real DCP saves through tierckpt's writer, a real unpickling payload (it creates a marker file), real loads.
"""

from __future__ import annotations

import builtins
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tierckpt
import tierckpt.dcp as tdcp
from tierckpt.errors import CheckpointError

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore")]


class _Payload:
    """Unpickled with ``weights_only=False``, this opens (creates) the marker file: code the checkpoint runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (self.marker, "w"))


@dataclasses.dataclass
class _Custom:
    """A harmless Python object of a type weights-only loading does not know."""

    name: str
    count: int


def _failure(exc: CheckpointException) -> BaseException:
    (err, _tb), = exc.failures.values()
    return err


@pytest.fixture
def mgr(tmp_path: Path):
    m = tierckpt.CheckpointManager(tmp_path / "local", keep_local=5)
    yield m
    m.close()


def _state(extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": extra}


def _target(keys: list[str]) -> dict[str, Any]:
    return {"model": {"w": torch.zeros(2, 3)}, "extra": dict.fromkeys(keys)}


def test_a_pickle_payload_is_refused_before_the_planner_unpickles_it(mgr: tierckpt.CheckpointManager,
                                                                     tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save(_state({"epoch": 3, "evil": _Payload(marker)}), storage_writer=tdcp.StorageWriter(mgr, 4))
    assert not marker.exists()  # saving pickled it; nothing ran yet
    target = _target(["epoch", "evil"])
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=tdcp.StorageReader(mgr))
    err = _failure(info.value)
    assert isinstance(err, CheckpointError) and err.step == 4
    assert "extra.evil" in str(err) and "allow_pickle=True" in str(err) and "io.open" in str(err), str(err)
    assert not marker.exists(), "the checkpoint ran code on load"
    # with verify=False too (the refusal is in read_data, not in the verification of read_metadata)
    with pytest.raises(CheckpointException):
        dcp.load(_target(["epoch", "evil"]), storage_reader=tdcp.StorageReader(mgr, verify=False))
    assert not marker.exists()
    # the explicit opt-in for trusted checkpoints hands the bytes on, as DCP's own reader does
    target = _target(["epoch", "evil"])
    dcp.load(target, storage_reader=tdcp.StorageReader(mgr, allow_pickle=True))
    assert marker.exists() and target["extra"]["epoch"] == 3
    target["extra"]["evil"].close()


def test_a_custom_object_needs_the_opt_in(mgr: tierckpt.CheckpointManager) -> None:
    dcp.save(_state({"obj": _Custom("run", 7)}), storage_writer=tdcp.StorageWriter(mgr, 1))
    with pytest.raises(CheckpointException) as info:
        dcp.load(_target(["obj"]), storage_reader=tdcp.StorageReader(mgr))
    assert "extra.obj" in str(_failure(info.value)) and "_Custom" in str(_failure(info.value))
    target = _target(["obj"])
    dcp.load(target, storage_reader=tdcp.StorageReader(mgr, allow_pickle=True))
    assert target["extra"]["obj"] == _Custom("run", 7)
    assert torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))


def test_plain_values_load_by_default(mgr: tierckpt.CheckpointManager) -> None:
    extra = {"epoch": 7, "name": "run", "blob": b"\x00\x01", "betas": (0.9, 0.999), "ids": [1, 2, None],
             "lr": 0.1, "flags": {True, False}, "shape": torch.Size([2, 3]), "dtype": torch.bfloat16}
    dcp.save(_state(extra), storage_writer=tdcp.StorageWriter(mgr, 2))
    target = _target(list(extra))
    dcp.load(target, storage_reader=tdcp.StorageReader(mgr))
    assert target["extra"] == extra
    assert torch.equal(target["model"]["w"], torch.arange(6.0).reshape(2, 3))
