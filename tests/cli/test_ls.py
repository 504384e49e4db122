"""`tierckpt ls` with a remote tier: where each step is."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tierckpt import CheckpointManager, cli


def test_ls_with_remote_shows_each_steps_tiers(tmp_path: Path, capsys) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=str(remote), keep_local=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((10,), float(step))})
        mgr.wait()
    capsys.readouterr()
    assert cli.main(["ls", str(local), "--remote", str(remote), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    states = {s["step"]: (s["state"], s["local"], s["remote"], s["world_size"]) for s in out["steps"]}
    assert states == {1: ("remote", False, True, 1), 2: ("remote", False, True, 1), 3: ("local+remote", True, True, 1)}
    assert cli.main(["ls", str(local), "--remote", str(remote)]) == 0
    text = capsys.readouterr().out
    assert "local+remote" in text and text.count("remote") >= 3
