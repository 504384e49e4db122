"""What a replica holds and how a fetched shard becomes the node's own step again, in one process (the 2 x 2 gloo
runs in test_peers.py cover the same code end to end): an incremental step's replica carries the files it
references and verifies whole; a fetched copy is committed into the local tier as a step ``tierckpt verify`` finds
intact; a local copy of another save of the step is left alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tierckpt import CheckpointManager, cli
from tierckpt.peers import replicas
from tierckpt.storage.local import LocalStore


def state(step: int) -> dict[str, torch.Tensor]:
    return {"frozen": torch.arange(8192.0), "w": torch.full((64,), float(step))}


def save(root: Path, steps: list[int], *, incremental: bool = False) -> None:
    with CheckpointManager(root, incremental=incremental) as mgr:
        for s in steps:
            mgr.save(s, state(s))
            mgr.wait()


def verified(root: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[int, bool]]:
    capsys.readouterr()
    cli.main(["verify", "--json", str(root)])
    return [(r["step"], r["ok"]) for r in json.loads(capsys.readouterr().out)["steps"]]


def materialise(sources: list[tuple[str, int, str | bytes]], folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, size, src in sources:
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        assert len(data) == size
        (folder / name).write_bytes(data)


def test_an_incremental_steps_replica_carries_what_it_references(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "node"
    save(root, [1, 2], incremental=True)
    assert json.loads((root / "step-0000000002" / "manifest.json").read_text())["refs"] == [1]
    sources = replicas.replica_sources(LocalStore(root), 2)
    assert sources[-1][0] == "manifest.json"
    replica = tmp_path / "replica" / "step-0000000002"
    materialise(sources, replica)
    assert "refs" not in json.loads((replica / "manifest.json").read_text())
    assert {n.rsplit("-", 1)[1] for n in (p.name for p in replica.glob("*.safetensors"))} == {
        n.rsplit("-", 1)[1] for n in (p.name for p in (root / "step-0000000001").glob("*.safetensors"))} | {
        n.rsplit("-", 1)[1] for n in (p.name for p in (root / "step-0000000002").glob("*.safetensors"))}
    assert verified(tmp_path / "replica", capsys) == [(2, True)]  # every byte, nothing outside its folder


def test_a_fetched_copy_is_committed_as_the_nodes_own_step(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "node"
    save(root, [1])
    fetched = root / replicas.fetch_rel(0, 1)
    names = sorted(p.name for p in (root / "step-0000000001").iterdir())
    manifest = (root / "step-0000000001" / "manifest.json").read_bytes()
    shutil.copytree(root / "step-0000000001", fetched)
    shutil.rmtree(root / "step-0000000001")  # the node lost it
    assert replicas.commit_fetched(LocalStore(root), 1, 0)
    assert (root / "step-0000000001" / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in (root / "step-0000000001").iterdir()) == names
    assert not fetched.parent.exists()
    assert verified(root, capsys) == [(1, True)]


def test_a_local_copy_of_another_save_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, other = tmp_path / "node", tmp_path / "other"
    save(root, [1])
    save(other, [1])  # the same step, another save
    before = sorted(p.name for p in (root / "step-0000000001").iterdir())
    shutil.copytree(other / "step-0000000001", root / replicas.fetch_rel(0, 1))
    assert not replicas.commit_fetched(LocalStore(root), 1, 0)
    assert sorted(p.name for p in (root / "step-0000000001").iterdir()) == before
    assert not (root / replicas.fetch_rel(0, 1)).exists()
    assert verified(root, capsys) == [(1, True)]
