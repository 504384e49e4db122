"""Every format version this code reads, from committed files (tests/format/golden/, written by the versions that
wrote them; see tests/format/golden/make_golden.py): each copy restores into a live state and loads without one, with
the saved values, and ``tierckpt verify`` finds it intact; a flipped byte in any of them is found."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import CheckpointManager
from tierckpt.cli import main as cli
from tierckpt.format.manifest import READS_VERSIONS

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import METADATA, STEP, golden_state  # noqa: E402

VERSIONS = sorted(int(p.name[1:]) for p in GOLDEN.glob("v*") if p.is_dir())


def _copy(tmp_path: Path, version: int) -> Path:
    """A writable copy (a manager takes a lock and may clean up)."""
    dst = tmp_path / f"v{version}"
    shutil.copytree(GOLDEN / f"v{version}", dst)
    return dst


def _empty_like(obj: Any) -> Any:
    if isinstance(obj, torch.nn.Module):
        torch.manual_seed(123)  # other weights than the saved ones
        return type(obj)(obj.in_features, obj.out_features)
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, np.ndarray):
        return np.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _empty_like(v) for k, v in obj.items()}
    return obj


def _assert_values(got: dict[str, Any], want: dict[str, Any]) -> None:
    model = got["model"] if isinstance(got["model"], dict) else got["model"].state_dict()
    for k, v in want["model"].state_dict().items():
        assert torch.equal(model[k], v), k
    for k, v in want["extra"].items():
        assert got["extra"][k].dtype == v.dtype and torch.equal(got["extra"][k], v), k
    assert np.array_equal(got["arr"], want["arr"]) and got["arr"].dtype == want["arr"].dtype
    for k in ("step", "lr", "name", "betas", "none"):
        assert got[k] == want[k], k


def test_every_readable_version_has_golden_files() -> None:
    assert sorted(READS_VERSIONS) == VERSIONS, f"golden copies for {VERSIONS}, the reader accepts {READS_VERSIONS}"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tier", ["local", "remote"])
def test_golden_copy_restores_and_loads(tmp_path: Path, version: int, tier: str) -> None:
    root = _copy(tmp_path, version)
    local = root / "local" if tier == "local" else tmp_path / "empty"
    with CheckpointManager(local, remote=str(root / "remote"), log_records=False) as mgr:
        want = golden_state()
        state = _empty_like(want)
        assert mgr.restore(state, source=tier) == STEP
        _assert_values(state, want)
        loaded = mgr.load(source=tier)
        assert (loaded.step, loaded.tier, loaded.metadata) == (STEP, tier, METADATA)
        _assert_values(loaded.state, want)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("tier", ["local", "remote"])
def test_golden_copy_verifies_and_a_flipped_byte_is_found(tmp_path: Path, version: int, tier: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path, version) / tier
    assert cli(["verify", str(root)]) == 0
    data = next(root.glob("step-*/*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert cli(["verify", str(root)]) == 1
    assert data.name in capsys.readouterr().out
