"""Clear errors for unsupported values, mismatched states, out-of-order steps and background failures."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests._support.helpers import assert_tensor_equal
from tierckpt import CheckpointError, CheckpointManager

pytestmark = pytest.mark.timeout(120)


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"w": torch.ones(2), "extra": {"obj": Opaque()}}, "state['extra']['obj']"),
        ({"fn": lambda x: x}, "state['fn']"),
        ({"xs": [1, 2, {"deep": object()}]}, "state['xs'][2]['deep']"),
        ({"t": (1, {3: Opaque()})}, "state['t'][1][3]"),
    ],
    ids=["object", "lambda", "in_list", "int_key_in_tuple"],
)
def test_unsupported_value_raises_type_error_naming_key_path(tmp_path: Path, state: dict, path: str) -> None:
    with CheckpointManager(tmp_path / "c") as mgr:
        with pytest.raises(TypeError) as ei:
            mgr.save(1, state)
        assert path in str(ei.value), f"{path} not in {str(ei.value)!r}"
        mgr.wait()
        assert mgr.latest_step() is None  # nothing committed
        # the manager is still usable, and the failed save did not use up its step
        mgr.save(1, {"ok": torch.arange(3)})
        mgr.wait()
        assert mgr.latest_step() == 1


def _saved(tmp_path: Path, state: dict) -> Path:
    root = tmp_path / "c"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state)
        mgr.wait()
    return root


def test_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    root = _saved(tmp_path, {"enc": {"w": torch.ones(3, 4)}, "b": torch.ones(2)})
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError) as ei:
        mgr.restore({"enc": {"w": torch.zeros(4, 3)}, "b": torch.zeros(2)})
    assert "'w'" in str(ei.value) and "enc" in str(ei.value), str(ei.value)


def test_dtype_mismatch_names_the_key(tmp_path: Path) -> None:
    root = _saved(tmp_path, {"w": torch.ones(5), "n": np.ones(3, dtype=np.float32)})
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointError) as ei:
            mgr.restore({"w": torch.zeros(5, dtype=torch.float64), "n": np.zeros(3, dtype=np.float32)})
        assert "'w'" in str(ei.value), str(ei.value)
        with pytest.raises(CheckpointError) as ei2:
            mgr.restore({"w": torch.zeros(5), "n": np.zeros(3, dtype=np.float64)})
        assert "'n'" in str(ei2.value), str(ei2.value)


def test_module_shape_mismatch_names_the_key(tmp_path: Path) -> None:
    root = _saved(tmp_path, {"model": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))})
    with CheckpointManager(root) as mgr, pytest.raises(CheckpointError) as ei:
        mgr.restore({"model": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))})
    msg = str(ei.value)
    assert "model" in msg and ("1.weight" in msg or "['1']" in msg), msg


def test_missing_and_unexpected_keys(tmp_path: Path) -> None:
    a, b = torch.arange(4.0), torch.arange(6, dtype=torch.int64)
    root = _saved(tmp_path, {"a": a, "sub": {"b": b, "x": 3}})
    with CheckpointManager(root) as mgr:
        # the checkpoint has sub.b, the state does not
        with pytest.raises(CheckpointError) as ei:
            mgr.restore({"a": torch.zeros(4), "sub": {"x": 0}})
        assert "'b'" in str(ei.value), str(ei.value)
        # the state has a key the checkpoint lacks
        with pytest.raises(CheckpointError) as ei2:
            mgr.restore(
                {"a": torch.zeros(4), "sub": {"b": torch.zeros(6, dtype=torch.int64), "x": 0}, "new": 1}
            )
        assert "'new'" in str(ei2.value), str(ei2.value)
        # strict=False tolerates both, and loads what matches
        s1 = {"a": torch.zeros(4), "sub": {"x": 0}}
        assert mgr.restore(s1, strict=False) == 1
        assert_tensor_equal(s1["a"], a, "a")
        assert s1["sub"]["x"] == 3
        s2 = {
            "a": torch.zeros(4),
            "sub": {"b": torch.zeros(6, dtype=torch.int64), "x": 0},
            "new": torch.ones(2),
        }
        assert mgr.restore(s2, strict=False) == 1
        assert_tensor_equal(s2["sub"]["b"], b, "sub.b")
        assert torch.equal(s2["new"], torch.ones(2))  # untouched


def test_module_missing_keys_strict(tmp_path: Path) -> None:
    root = _saved(tmp_path, {"model": nn.Linear(3, 3)})
    with CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointError):
            mgr.restore({"model": nn.Linear(3, 3, bias=False)})
        m = nn.Linear(3, 3, bias=False)
        assert mgr.restore({"model": m}, strict=False) == 1


def test_step_at_or_below_last_saved_is_an_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "c", keep_local=5) as mgr:
        mgr.save(3, {"t": torch.ones(2)})
        with pytest.raises(CheckpointError):
            mgr.save(3, {"t": torch.ones(2)})
        with pytest.raises(CheckpointError):
            mgr.save(2, {"t": torch.ones(2)})
        mgr.save(4, {"t": torch.ones(2)})
        mgr.wait()
        assert mgr.latest_step() == 4


def _break_root(root: Path) -> None:
    """Replace the tier's folder by a plain file: every later write to it fails for real."""
    shutil.rmtree(root)
    root.write_bytes(b"not a folder")


def test_wait_reraises_background_error(tmp_path: Path) -> None:
    root = tmp_path / "c"
    mgr = CheckpointManager(root)
    try:
        _break_root(root)
        raised_at = None
        try:
            mgr.save(1, {"t": torch.ones(1000)})
        except (CheckpointError, OSError):
            raised_at = "save"
        if raised_at is None:
            with pytest.raises((CheckpointError, OSError)):
                mgr.wait(timeout=60)
            raised_at = "wait"
        assert raised_at == "wait", "the write failure surfaced in save(), not in the background"
    finally:
        try:
            mgr.close()
        except Exception:
            pass


def test_background_error_reraised_by_next_save(tmp_path: Path) -> None:
    root = tmp_path / "c"
    mgr = CheckpointManager(root)
    try:
        _break_root(root)
        h = mgr.save(1, {"t": torch.ones(1000)})
        assert h.persisted.exception(timeout=60) is not None, (
            "the failed write did not fail the persisted future"
        )
        with pytest.raises((CheckpointError, OSError)):
            mgr.save(2, {"t": torch.ones(1000)})
    finally:
        try:
            mgr.close()
        except Exception:
            pass


def test_close_reraises_background_error(tmp_path: Path) -> None:
    root = tmp_path / "c"
    mgr = CheckpointManager(root)
    _break_root(root)
    mgr.save(1, {"t": torch.ones(1000)})
    with pytest.raises((CheckpointError, OSError)):
        mgr.close()
