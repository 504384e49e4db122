"""Corruption of real checkpoint files is detected by `tierckpt verify` (exit 1, names the file) and by
`restore` (falls back to the older intact step; an explicit bad step raises CorruptCheckpointError)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests._support.helpers import (
    assert_tensor_equal,
    cli_output,
    data_files,
    edit_manifest_value,
    flip_byte,
    rank_manifests,
    run_cli_parallel,
    step_manifest,
    step_path,
    truncate_half,
)
from tierckpt import CheckpointError, CheckpointManager, CheckpointNotFoundError, CorruptCheckpointError

pytestmark = pytest.mark.timeout(180)


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "step": step,
    }


def _fresh() -> dict:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "step": -1}


def _assert_is_step(state: dict, step: int) -> None:
    want = _state(step)
    assert state["step"] == step
    assert_tensor_equal(state["w"], want["w"], "w")
    assert_tensor_equal(state["b"], want["b"], "b")


def _two_steps(root: Path) -> None:
    with CheckpointManager(root, keep_local=3) as mgr:
        mgr.save(1, _state(1), metadata={"note": "one"})
        mgr.save(2, _state(2), metadata={"note": "two"})
        mgr.wait()


def _flip(folder: Path) -> Path:
    p = data_files(folder)[0]
    flip_byte(p, offset_from_end=3)
    return p


def _truncate(folder: Path) -> Path:
    p = data_files(folder)[0]
    truncate_half(p)
    return p


def _delete(folder: Path) -> Path:
    p = data_files(folder)[0]
    p.unlink()
    return p


def _edit_step_manifest(folder: Path) -> Path:
    p = step_manifest(folder)
    edit_manifest_value(p)
    return p


def _edit_rank_manifest(folder: Path) -> Path:
    p = rank_manifests(folder)[0]
    edit_manifest_value(p)
    return p


CORRUPTIONS: dict[str, Callable[[Path], Path]] = {
    "flipped_byte": _flip,
    "truncated": _truncate,
    "missing_file": _delete,
    "edited_step_manifest": _edit_step_manifest,
    "edited_rank_manifest": _edit_rank_manifest,
}


@pytest.fixture(scope="module")
def corrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """One root per kind of corruption: steps 1 and 2 committed, then step 2 damaged."""
    roots: dict[str, tuple[Path, Path]] = {}
    for kind, corrupt in CORRUPTIONS.items():
        root = tmp_path_factory.mktemp(kind) / "ckpt"
        _two_steps(root)
        roots[kind] = (root, corrupt(step_path(root, 2)))
    return roots


@pytest.fixture(scope="module")
def combined(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One root with step 1 intact and steps 2..6 each damaged in one way; the CLI runs on it once per view."""
    root = tmp_path_factory.mktemp("combined") / "ckpt"
    with CheckpointManager(root, keep_local=10) as mgr:
        for step in range(1, 2 + len(CORRUPTIONS)):
            mgr.save(step, _state(step))
        mgr.wait()
    bad = {kind: corrupt(step_path(root, i + 2)) for i, (kind, corrupt) in enumerate(CORRUPTIONS.items())}
    whole, folder, one = run_cli_parallel(
        [("verify", root), ("verify", step_path(root, 3)), ("verify", root, "--step", "1")]
    )
    return {"root": root, "bad": bad, "whole": whole, "folder": folder, "one": one}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_detected_by_verify(combined, kind: str) -> None:
    proc, bad = combined["whole"], combined["bad"][kind]
    out = cli_output(proc)
    assert proc.returncode == 1, f"verify exit {proc.returncode}:\n{out}"
    assert bad.name in out, f"verify output does not name {bad.name} ({kind}):\n{out}"


def test_verify_single_corrupt_step_folder_and_intact_step(combined) -> None:
    proc = combined["folder"]
    bad = combined["bad"]["truncated"]  # step 3
    assert bad.parent == step_path(combined["root"], 3)
    assert proc.returncode == 1 and bad.name in cli_output(proc), cli_output(proc)
    one = combined["one"]
    assert one.returncode == 0, f"verify --step 1 (intact) exit {one.returncode}:\n{cli_output(one)}"


def test_restore_skips_every_corrupt_step(combined) -> None:
    with CheckpointManager(combined["root"], keep_local=10) as mgr:
        state = _fresh()
        assert mgr.restore(state) == 1
        _assert_is_step(state, 1)
        for step in range(2, 2 + len(CORRUPTIONS)):
            with pytest.raises(CorruptCheckpointError):
                mgr.restore(_fresh(), step=step)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_detected_by_restore(corrupted, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    root, bad = corrupted[kind]
    # restore(step=None) falls back to step 1, with a warning naming the bad file
    with CheckpointManager(root, keep_local=3) as mgr:
        assert mgr.latest_step() in (1, 2)
        state = _fresh()
        with caplog.at_level(logging.WARNING):
            got = mgr.restore(state)
        assert got == 1, f"restore picked {got} with step 2 {kind}"
        _assert_is_step(state, 1)

        # an explicit bad step raises, and leaves the state untouched
        state2 = _fresh()
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.restore(state2, step=2)
        assert isinstance(ei.value, CheckpointError)
        assert torch.equal(state2["w"], torch.zeros(256, 64)) and state2["step"] == -1
        # an absent step is not found (and a FileNotFoundError)
        with pytest.raises(CheckpointNotFoundError) as ei2:
            mgr.restore(_fresh(), step=3)
        assert isinstance(ei2.value, FileNotFoundError)
        # the intact step can still be asked for explicitly
        state3 = _fresh()
        assert mgr.restore(state3, step=1) == 1
        _assert_is_step(state3, 1)

    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert warned, "no warning logged when restore skipped the corrupt step 2"
    assert bad.name in warned, f"the fallback warning does not name the bad file {bad.name}: {warned!r}"


def test_only_step_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(4, _state(4))
        mgr.wait()
    _flip(step_path(root, 4))
    with CheckpointManager(root) as mgr:
        state = _fresh()
        # the only step is corrupt: nothing to restore, and the state is untouched (or a corrupt error)
        try:
            got = mgr.restore(state)
        except CorruptCheckpointError:
            got = "raised"
        assert got in (None, "raised")
        assert torch.equal(state["w"], torch.zeros(256, 64))
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(_fresh(), step=4)


def test_new_save_replaces_corrupt_step_left_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _two_steps(root)
    _flip(step_path(root, 2))
    with CheckpointManager(root, keep_local=3) as mgr:
        state = _fresh()
        assert mgr.restore(state) == 1
        # the run continues from 1 and saves step 2 again: replaces the corrupt copy
        new2 = _state(22)
        new2["step"] = 2
        mgr.save(2, new2)
        mgr.wait()
        got = _fresh()
        assert mgr.restore(got, step=2) == 2
        assert_tensor_equal(got["w"], _state(22)["w"], "w")
    with CheckpointManager(root, keep_local=3) as mgr:
        got = _fresh()
        assert mgr.restore(got) == 2
        assert_tensor_equal(got["w"], _state(22)["w"], "w")
