"""Edge cases of the contract: aliasing views, colliding key names, parameters that require grad, the
safetensors format of the data files, JSON manifests, retention, leftovers, error context."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from tests._support.helpers import (
    assert_tensor_equal,
    assert_tree_equal,
    data_files,
    flip_byte,
    rank_manifests,
    step_manifest,
    step_path,
)
from tierckpt import CheckpointManager, CheckpointNotFoundError, CorruptCheckpointError

pytestmark = pytest.mark.timeout(120)


def _round_trip(tmp_path: Path, state: dict, fresh: dict, step: int = 1) -> dict:
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(step, state)
        mgr.wait()
    with CheckpointManager(tmp_path / "c") as mgr:
        assert mgr.restore(fresh) == step
    return fresh


def test_overlapping_views_and_reinterpreted_memory(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32)
    state = {
        "base": t,
        "mid": t[2:5],
        "strided": t[1::4],
        "as_int": t.view(torch.int32),
        "matrix": t.view(3, 4),
        "col": t.view(3, 4)[:, 1],
    }
    want = {k: v.clone() for k, v in state.items()}
    fresh = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    _round_trip(tmp_path, state, fresh)
    for k, v in want.items():
        assert_tensor_equal(fresh[k], v, k)


def test_colliding_key_names(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {
        "a.b": torch.randn(3, generator=g),
        "a": {
            "b": torch.randn(3, generator=g),
            1: torch.randn(2, generator=g),
            "1": torch.randn(2, generator=g),
        },
        "": torch.randn(1, generator=g),
        "x/y": torch.randn(2, generator=g),
        "ü nicode 'quoted' \"dq\"": torch.randn(2, generator=g),
    }
    want = {
        "a.b": state["a.b"].clone(),
        "a": {k: v.clone() for k, v in state["a"].items()},
        "": state[""].clone(),
        "x/y": state["x/y"].clone(),
        "ü nicode 'quoted' \"dq\"": state["ü nicode 'quoted' \"dq\""].clone(),
    }
    fresh = {
        "a.b": torch.zeros(3),
        "a": {"b": torch.zeros(3), 1: torch.zeros(2), "1": torch.zeros(2)},
        "": torch.zeros(1),
        "x/y": torch.zeros(2),
        "ü nicode 'quoted' \"dq\"": torch.zeros(2),
    }
    _round_trip(tmp_path, state, fresh)
    assert_tree_equal(fresh, want)


def test_parameters_and_grad_tensors(tmp_path: Path) -> None:
    p = nn.Parameter(torch.randn(4, 3))
    x = torch.randn(5, requires_grad=True)
    act = x * 2  # non-leaf, part of a graph
    models = [nn.Linear(2, 2), nn.Linear(2, 3)]
    state = {"p": p, "act": act, "models": models, "od": OrderedDict([("z", 1), ("a", torch.ones(2))])}
    want_p, want_act = p.detach().clone(), act.detach().clone()
    want_models = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    fresh_p = nn.Parameter(torch.zeros(4, 3))
    fresh_models = [nn.Linear(2, 2), nn.Linear(2, 3)]
    fresh = {
        "p": fresh_p,
        "act": torch.zeros(5),
        "models": fresh_models,
        "od": OrderedDict([("z", 0), ("a", torch.zeros(2))]),
    }
    _round_trip(tmp_path, state, fresh)
    assert fresh["p"] is fresh_p and fresh_p.requires_grad
    assert_tensor_equal(fresh_p.detach(), want_p, "p")
    assert_tensor_equal(fresh["act"], want_act, "act")
    for m, w in zip(fresh_models, want_models, strict=True):
        for k, v in w.items():
            assert_tensor_equal(m.state_dict()[k], v, k)
    assert list(fresh["od"].keys()) == ["z", "a"] and fresh["od"]["z"] == 1
    assert_tensor_equal(fresh["od"]["a"], torch.ones(2), "od.a")


def test_empty_state_and_big_ints(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "c") as mgr:
        mgr.save(1, {})
        mgr.save(2, {"big": 2**70, "neg": -(2**80), "nested": {"k": [2**64]}})
        mgr.wait()
        empty: dict = {}
        assert mgr.restore(empty, step=1) == 1 and empty == {}
        fresh = {"big": 0, "neg": 0, "nested": {"k": [0]}}
        assert mgr.restore(fresh, step=2) == 2
    assert_tree_equal(fresh, {"big": 2**70, "neg": -(2**80), "nested": {"k": [2**64]}})


def test_data_files_are_safetensors_and_manifests_are_json(tmp_path: Path) -> None:
    from safetensors import safe_open

    g = torch.Generator().manual_seed(4)
    state = {
        "w": torch.randn(300, 7, generator=g),
        "h": torch.randn(33, generator=g).to(torch.bfloat16),
        "i": torch.arange(10),
        "m": torch.rand(4, generator=g) > 0.5,
    }
    root = tmp_path / "c"
    with CheckpointManager(root) as mgr:
        mgr.save(3, state, metadata={"purpose": "format-check"})
        mgr.wait()
    folder = step_path(root, 3)
    found: list[torch.Tensor] = []
    for f in data_files(folder):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                found.append(sf.get_tensor(name))
    for k, v in state.items():
        hits = [t for t in found if t.dtype == v.dtype and t.shape == v.shape and torch.equal(t, v)]
        assert hits, f"tensor {k} not found (by value) in the safetensors data files"
    top = json.loads(step_manifest(folder).read_text())
    assert "checksum" in top
    assert any(isinstance(v, int) and v == 3 for v in top.values()), (
        f"step not in manifest.json: {sorted(top)}"
    )
    blob = json.dumps(top) + "".join(p.read_text() for p in rank_manifests(folder))
    assert "format-check" in blob, "user metadata not in the manifests"
    for p in rank_manifests(folder):
        doc = json.loads(p.read_text())
        assert "checksum" in doc


def test_retention_keeps_newest_local_steps(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with CheckpointManager(root, keep_local=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"t": torch.full((8,), float(step))})
            mgr.wait()
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert steps == [step_path(root, 4).name, step_path(root, 5).name], steps
    with CheckpointManager(root, keep_local=2) as mgr:
        assert mgr.latest_step() == 5
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore({"t": torch.zeros(8)}, step=3)


def test_leftovers_ignored_and_foreign_files_kept(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"t": torch.ones(4)})
        mgr.wait()
    # a crash leftover that looks like a complete newer save, minus the rename
    tmp = root / ".tmp-step-0000000009-0123abcd"
    tmp.mkdir()
    for p in step_path(root, 1).iterdir():
        (tmp / p.name).write_bytes(p.read_bytes())
    (root / "notes.txt").write_text("mine")
    (root / "other-dir").mkdir()
    with CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 1
        s = {"t": torch.zeros(4)}
        assert mgr.restore(s) == 1
        mgr.save(2, {"t": torch.ones(4) * 2})
        mgr.wait()
    assert (root / "notes.txt").read_text() == "mine" and (root / "other-dir").is_dir()
    assert not tmp.exists(), "the manager did not clean up its crash leftover"


def test_errors_carry_step_and_path(tmp_path: Path) -> None:
    root = tmp_path / "c"
    with CheckpointManager(root, keep_local=3) as mgr:
        mgr.save(1, {"t": torch.ones(100)})
        mgr.save(2, {"t": torch.ones(100)})
        mgr.wait()
    bad = data_files(step_path(root, 2))[0]
    flip_byte(bad)
    with CheckpointManager(root, keep_local=3) as mgr:
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.restore({"t": torch.zeros(100)}, step=2)
        e = ei.value
        assert e.step == 2, e.step
        assert e.path is not None
        assert "2" in str(e)
        with pytest.raises(CheckpointNotFoundError) as ei2:
            mgr.restore({"t": torch.zeros(100)}, step=7)
        assert ei2.value.step == 7
        assert "7" in str(ei2.value)
