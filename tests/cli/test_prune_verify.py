"""``tierckpt prune`` never deletes the newest intact step: it verifies what it keeps (every byte, against the
checksums) before it deletes what it drops, newest first until a step verifies, and keeps that step too when the
policy would have dropped it. ``--no-verify`` skips the reads (manifests and file sizes only); ``--dry-run``
verifies and prints the plan, deleting nothing.

Real files: steps saved by a real manager, a data file bit-flipped on disk, the real CLI (a subprocess for the
local tier, ``cli.main`` for the POSIX remote), and a real restore afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal, cli_output, data_files, flip_byte, run_cli, step_path
from tierckpt import CheckpointManager
from tierckpt.cli import main as cli_main
from tierckpt.format import layout

pytestmark = pytest.mark.timeout(180)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 257, generator=g), "ids": torch.randint(0, 1 << 30, (500,), generator=g),
            "meta": {"step": step}}


def _empty() -> dict[str, Any]:
    return {"w": torch.empty(64, 257), "ids": torch.empty(500, dtype=torch.int64), "meta": {"step": -1}}


def _save(root: Path, steps: tuple[int, ...] = (1, 2, 3)) -> None:
    with CheckpointManager(root, keep_local=len(steps)) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


def _rot(root: Path, step: int) -> None:
    """Flip a byte of tensor data in the step's first data file (its manifests and file sizes still check)."""
    flip_byte(data_files(step_path(root, step))[0])


def _steps(root: Path) -> list[int]:
    return sorted(s for s in (layout.parse_step_dir(n) for n in os.listdir(root)) if s is not None)


def test_prune_keeps_the_newest_intact_step_when_the_newest_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    _rot(root, 3)
    proc = run_cli("prune", root, "--keep", "1")
    out = cli_output(proc)
    assert proc.returncode == 1, out  # corruption found (exit 1), and the prune still did what was safe
    assert "step 3: CORRUPT" in out and "keeping step 2" in out, out
    assert _steps(root) == [2, 3]
    with CheckpointManager(root) as mgr:
        state = _empty()
        assert mgr.restore(state) == 2  # the corrupt step 3 is skipped, step 2 is there to load
    assert_tree_equal(state, _state(2))


def test_prune_dry_run_and_json_show_what_is_verified_kept_and_deleted(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _save(root, (1, 2, 3, 4))
    _rot(root, 4)
    _rot(root, 3)
    capsys.readouterr()
    assert cli_main(["prune", str(root), "--keep", "1", "--dry-run"]) == 1
    out = capsys.readouterr().out
    for line in ("step 4: CORRUPT", "step 3: CORRUPT", "step 2: OK", "keeping step 2", "would delete step 1",
                 "would delete step 3"):  # a corrupt step the policy drops goes: it is no intact copy
        assert line in out, out
    assert "would delete step 2" not in out and _steps(root) == [1, 2, 3, 4]
    assert cli_main(["prune", str(root), "--keep", "1", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted"] == [1, 3] and doc["kept"] == [2, 4] and doc["newest_intact"] == 2 and not doc["ok"]
    assert [(v["step"], v["ok"]) for v in doc["verified"]] == [(4, False), (3, False), (2, True)]
    assert doc["verified"][0]["bad_files"]
    assert _steps(root) == [2, 4]


def test_prune_of_intact_steps_reads_only_the_newest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    _rot(root, 1)  # an old step's rot does not matter: it is not needed to keep an intact copy
    capsys.readouterr()
    assert cli_main(["prune", str(root), "--keep", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(v["step"], v["ok"]) for v in doc["verified"]] == [(3, True)]
    assert doc["deleted"] == [1] and doc["newest_intact"] == 3 and doc["ok"]


def test_prune_with_no_intact_step_deletes_no_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    _save(root)
    for s in (1, 2, 3):
        _rot(root, s)
    capsys.readouterr()
    assert cli_main(["prune", str(root), "--keep", "1"]) == 1
    captured = capsys.readouterr()
    assert "no step under" in captured.err and "deleting no step" in captured.err, captured
    assert _steps(root) == [1, 2, 3]


def test_prune_no_verify_trusts_the_manifests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The opt-out reads no data: a step whose data rotted (manifests and sizes intact) counts as intact."""
    root = tmp_path / "ckpt"
    _save(root)
    _rot(root, 3)
    capsys.readouterr()
    assert cli_main(["prune", str(root), "--keep", "1", "--no-verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verified"] == [] and doc["deleted"] == [1, 2]
    assert _steps(root) == [3]


def test_prune_on_a_posix_remote_keeps_its_newest_intact_step(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    local, nfs = tmp_path / "local", tmp_path / "nfs"
    _save(local)
    assert cli_main(["sync", str(local), str(nfs)]) == 0
    _rot(nfs, 3)
    capsys.readouterr()
    assert cli_main(["prune", str(nfs), "--keep", "1"]) == 1
    out = capsys.readouterr().out
    assert "step 3: CORRUPT" in out and "keeping step 2" in out, out
    assert _steps(nfs) == [2, 3]
    with CheckpointManager(tmp_path / "fresh", remote=str(nfs)) as mgr:
        state = _empty()
        assert mgr.restore(state, source="remote") == 2
    assert_tree_equal(state, _state(2))
