"""Resharding restores read the step's shard index, not the remote's whole ``manifest.json``: a DTensor state saved
on 4 gloo ranks restored on 2 (whose nodes hold their old shards), and one saved on 2 restored on 4 fresh nodes;
each rank's reads of the remote are counted (tests/distributed/_reshard_index_worker.py). A step without an index
(saved before indexes) and a step whose index is damaged still restore, bit for bit, from ``manifest.json``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests._support.ranks import Ranks, assert_all_ok, rank_env, run_ranks
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.verify import verify_step

pytestmark = [pytest.mark.timeout(240)]

WORKER = Path(__file__).resolve().parent / "_reshard_index_worker.py"


def launch(name: str, world: int, root: Path) -> Ranks:
    ranks = run_ranks(lambda r: [str(WORKER), name, str(r), str(world), str(root)], world, root, name,
                      env=rank_env(), timeout=150)
    assert_all_ok(ranks, name, 150)
    return ranks


def _index(remote: Path, step: int) -> Path:
    found = list((remote / f"step-{step:010d}").glob("shards-*.json"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Ranks, Ranks]:
    root = tmp_path_factory.mktemp("reshard_index")
    launch("save4", 4, root)
    shutil.copytree(root / "remote", root / "remote_old")
    _index(root / "remote_old", 1).unlink()  # a step committed before shard indexes existed
    shutil.copytree(root / "remote", root / "remote_bad")
    bad = _index(root / "remote_bad", 1)
    raw = bytearray(bad.read_bytes())
    raw[raw.index(b'"meshes"') + 12] ^= 0x01  # inside the head: its checksum no longer matches
    bad.write_bytes(bytes(raw))
    return launch("load2", 2, root), launch("load4", 4, root)


def _exact(rec: dict[str, Any], step: int) -> None:
    assert "phase_error" not in rec, rec.get("traceback")
    assert rec["restored"] == step and rec["exact"] and all(rec["exact"].values()), rec


def test_four_to_two_ranks_read_the_index_not_the_step_manifest(jobs: tuple[Ranks, Ranks]) -> None:
    load2, _ = jobs
    index_size = _index(load2.root / "remote", 1).stat().st_size
    for rank, rec in enumerate(load2.phases("indexed")):
        _exact(rec, 1)
        # each rank's node holds its own old shard; the other saved rank it needs comes from the remote, found
        # through the index: the remote's manifest.json is never read
        assert "step_manifest" not in rec["bytes"], rec
        assert rec["requests"]["index"] == 1 and 0 < rec["bytes"]["index"] <= index_size, rec
        # rank 0 needs saved ranks 0-1 (its rows and columns; the replicated tensor, stored by rank 0 only),
        # rank 1 saved ranks 2-3 and 0 (the replicated one)
        assert rec["rank_manifests"] == [["r00001"], ["r00000", "r00002", "r00003"]][rank], rec
        assert not rec["warnings"], rec
    # the index is part of the step: verify knows it
    report = verify_step(LocalStore(load2.root / "remote", tier="remote"), 1)
    assert report.ok and report.extra_files == [], report


def test_a_step_without_an_index_still_restores_from_the_step_manifest(jobs: tuple[Ranks, Ranks]) -> None:
    load2, _ = jobs
    for rec in load2.phases("old"):
        _exact(rec, 1)
        assert rec["requests"].get("step_manifest", 0) >= 1 and "index" not in rec["bytes"], rec


def test_a_damaged_index_falls_back_to_the_step_manifest_with_a_warning(jobs: tuple[Ranks, Ranks]) -> None:
    load2, _ = jobs
    for rec in load2.phases("corrupt"):
        _exact(rec, 1)
        assert rec["requests"].get("step_manifest", 0) >= 1, rec
        warned = [w for w in rec["warnings"] if "shard index" in w]
        assert warned and "step 1" in warned[0] and "shards-" in warned[0] and "remote" in warned[0], rec


def test_fsdp_over_tensor_parallel_reshards_through_the_index(jobs: tuple[Ranks, Ranks]) -> None:
    load2, _ = jobs
    saved = json.loads((load2.root / "result-save4-r0.json").read_text())["save_2d"]
    assert saved["placements"]["0.weight"] == ["_S(0, 2)", "S(0)"], saved  # FSDP2's strided shard over TP
    index_size = _index(load2.root / "remote_2d", 3).stat().st_size
    for rank, rec in enumerate(load2.phases("fsdp_from_2d")):
        _exact(rec, 3)
        assert rec["requests"]["index"] == 1 and 0 < rec["bytes"]["index"] <= index_size, rec
        # saved on (dp, tp): rank = 2 * dp + tp; the column-wise weight's rows 0-2, 3-5, 6-8, 9-11 lie on saved
        # ranks 0, 2, 1, 3 (tensor-parallel piece first). FSDP rank 0 (rows 0-5, and rows 0-2 of the row-wise
        # layer, split over tp) needs saved ranks 0, 1, 2; FSDP rank 1 needs 1, 2, 3: never all four
        assert rec["rank_manifests"] == [["r00000", "r00001", "r00002"], ["r00001", "r00002", "r00003"]][rank], rec


def test_fsdp_over_tensor_parallel_restores_into_its_own_layout_from_the_remote(jobs: tuple[Ranks, Ranks]) -> None:
    _, load4 = jobs
    for rank, rec in enumerate(load4.phases("same_2d")):
        _exact(rec, 3)
        # each rank's targets are its own saved shards, but the row-wise layer's bias is replicated over tp and
        # stored by tp 0 only: ranks at tp 1 (1 and 3) also read their tp-0 partner's manifest, found in the index
        partner = rank - rank % 2
        assert rec["rank_manifests"] == sorted({f"r{partner:05d}", f"r{rank:05d}"}), rec
        assert ("index" in rec["requests"]) == (rank != partner), rec


def test_a_strided_shard_not_one_box_and_a_partial_one_are_refused_at_save(jobs: tuple[Ranks, Ranks]) -> None:
    load2, _ = jobs
    for rank in range(4):
        rec = json.loads((load2.root / f"result-save4-r{rank}.json").read_text())["strided_not_a_box"]
        assert rec["raised"] and "_S(0, 2)" in rec["raised"] and "not one box" in rec["raised"], rec
        assert "the DTensor at state['t']" in rec["raised"], rec  # names the key
        assert rec["partial"] and "the DTensor at state['t']" in rec["partial"], rec  # and a Partial one
        assert "reduce Partial placements first" in rec["partial"], rec
        assert rec["steps"] == [], rec  # nothing saved, on any rank


def test_two_to_four_fresh_ranks_read_the_index(jobs: tuple[Ranks, Ranks]) -> None:
    _, load4 = jobs
    index_size = _index(load4.root / "remote2", 2).stat().st_size
    for rank, rec in enumerate(load4.phases("indexed")):
        _exact(rec, 2)
        # rank 0 reads manifest.json once, for the plan it hands every rank its own reference from; no other
        # rank reads it
        assert rec["requests"].get("step_manifest", 0) == (1 if rank == 0 else 0), (rank, rec)
        assert rec["requests"]["index"] == 1 and rec["bytes"]["index"] <= index_size, rec
        # saved on 2 ranks (8 rows each), restored on 4 (4 rows each): ranks 0-1 need saved rank 0, ranks 2-3 rank 1
        assert set(rec["rank_manifests"]) <= {"r00000", "r00001"}, rec
