"""Incremental saves in a two-rank job (real gloo ranks, one process each, each rank its own node folder, a shared POSIX
remote, then an S3 remote on the moto server): each rank writes and uploads only its changed shard bytes, the step
manifests name every rank's references, retention on both tiers keeps the referenced steps, restores are bit-exact,
``verify`` is clean, a damaged referenced file makes the restore fall back to an older step, and a resharded restore
(2 ranks -> 1 process) follows the references. The ranks: tests/distributed/_incremental_worker.py."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tests._support.ranks import Ranks, assert_all_ok, rank_env, run_ranks
from tests.distributed._incremental_worker import full
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.incremental import Incremental

pytestmark = [pytest.mark.timeout(240)]

WORKER = Path(__file__).resolve().parent / "_incremental_worker.py"
#: a rank's shard of the frozen base: 128 rows x 128 float32 columns
BASE_SHARD = 128 * 128 * 4


@pytest.fixture(scope="module")
def inc2(tmp_path_factory: pytest.TempPathFactory, s3_server: Any, s3_admin: Any) -> Ranks:
    root = tmp_path_factory.mktemp("inc2")
    bucket = f"tierckpt-inc2-{secrets.token_hex(4)}"
    s3_admin.mkdir(bucket)
    cfg = {"world": 2, "root": str(root), "store": f"file://{root}/store-{secrets.token_hex(4)}", "timeout": 20,
           "s3": f"s3://{bucket}/run", "storage_options": s3_server.storage_options()}
    cfg_path = root / "config-inc2.json"
    cfg_path.write_text(json.dumps(cfg))
    ranks = run_ranks(lambda r: [str(WORKER), "inc2", str(r), str(cfg_path)], 2, root, "inc2", env=rank_env(),
                      timeout=150)
    assert_all_ok(ranks, "inc2", 150)
    return ranks


def test_each_rank_writes_and_uploads_only_its_changed_bytes(inc2: Ranks) -> None:
    for rank, rec in enumerate(inc2.phases("save")):
        steps = rec["steps"]
        for s in ("1", "4"):  # full steps: the whole shard
            assert steps[s]["local"] > BASE_SHARD and steps[s]["remote"] > BASE_SHARD, (rank, s, steps[s])
            assert steps[s]["local_refs"] == [[], 0] and steps[s]["remote_refs"] == [[], 0]
        for s, refs in (("2", [1]), ("3", [1]), ("5", [4])):  # the adapter (and a header), the rest referenced
            assert steps[s]["local"] < 8192 and steps[s]["remote"] < 8192, (rank, s, steps[s])
            # the step manifest covers both ranks' references: both ranks' base shards and the embedding
            assert steps[s]["local_refs"][0] == refs and steps[s]["remote_refs"][0] == refs
            assert steps[s]["local_refs"][1] >= 2 * BASE_SHARD and steps[s]["remote_refs"][1] >= 2 * BASE_SHARD


def test_retention_keeps_the_referenced_step_on_both_tiers(inc2: Ranks) -> None:
    for rec in inc2.phases("save"):
        # keep 3 newest (3, 4, 5); step 2 goes; step 1 stays while step 3 references it
        assert rec["local"] == [1, 3, 4, 5] and rec["remote"] == [1, 3, 4, 5], rec


def test_restart_restores_bit_exact_and_references_what_it_finds(inc2: Ranks) -> None:
    for rank, rec in enumerate(inc2.phases("restart")):
        assert rec["restored"] == 5 and rec["exact"], (rank, rec)
        assert rec["own6"] < 8192 and rec["refs6"][0] == [4], (rank, rec)
        assert rec["verify"] == ({"local": 0, "remote": 0} if rank == 0 else {"local": 0}), rec
        # keep 4 newest (3-6), and step 1 that step 3 references
        assert rec["local"] == [1, 3, 4, 5, 6] and rec["remote"] == [1, 3, 4, 5, 6], rec


def test_a_damaged_referenced_file_falls_back_to_an_older_step(inc2: Ranks) -> None:
    for rank, rec in enumerate(inc2.phases("damaged")):
        # steps 6 and 5 reference rank 1's damaged file of step 4 (in both tiers): step 3 is the newest intact
        assert rec["restored"] == 3 and rec["exact"], (rank, rec)


def test_resharded_restore_of_an_incremental_step_onto_one_process(inc2: Ranks, tmp_path: Path) -> None:
    inc2.phases("damaged")
    manifest = json.loads((inc2.root / "remote" / "step-0000000003" / "manifest.json").read_text())
    assert manifest["refs"] == [1] and manifest["world_size"] == 2
    st: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in full(3).items()}, "step": 0}
    with tierckpt.CheckpointManager(tmp_path / "one", remote=inc2.root / "remote", rank=0, world_size=1) as m:
        assert m.restore(st, step=3) == 3
    assert st["step"] == 3
    for k, ref in full(3).items():
        assert torch.equal(st["model"][k].view(torch.uint8), ref.view(torch.uint8)), k


def test_an_upload_carries_over_the_files_of_a_step_the_remote_lacks(inc2: Ranks, tmp_path: Path) -> None:
    for rank, rec in enumerate(inc2.phases("carry")):
        assert rec["local_refs"][0] == [1] and rec["remote_refs"] == [[], 0], (rank, rec)
        assert rec["remote"] > BASE_SHARD, (rank, rec)  # the base shard, carried over
    st: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in full(3).items()}, "step": 0}
    with tierckpt.CheckpointManager(tmp_path / "one", remote=inc2.root / "remote2", rank=0, world_size=1) as m:
        assert m.restore(st, step=3) == 3
    for k, ref in full(3).items():
        assert torch.equal(st["model"][k].view(torch.uint8), ref.view(torch.uint8)), k


def test_a_resharded_restart_writes_its_first_step_whole(inc2: Ranks) -> None:
    inc2.phases("restart")
    node0 = LocalStore(inc2.root / "n0")
    same = Incremental(rank=0, world_size=2).baseline_for(node0, 100)
    assert same is not None and same.step == 6
    assert Incremental(rank=0, world_size=1).baseline_for(node0, 100) is None  # saved by 2 ranks: cut differently
    assert Incremental(rank=1, world_size=2).baseline_for(node0, 100) is None  # node 0 holds no shard of rank 1


def test_peer_copies_keep_multi_rank_steps_incremental(caplog: pytest.LogCaptureFixture) -> None:
    """A peer copy carries the files a step references (tests/distributed/test_peers.py): with peer_replicas, a
    multi-rank job still writes incremental steps."""
    from tierckpt.engine.core import Engine
    from tierckpt.options import Options

    def engine(world: int, **kw: Any) -> Engine:
        return Engine(local=None, remote=None, rank=0, world_size=world, options=Options(incremental=True, **kw),  # type: ignore[arg-type]
                      io=None, hash=None, pool=None, huge=False, coord=None)  # type: ignore[arg-type]

    assert engine(2, peer_replicas=1).incremental is not None
    assert "written whole" not in caplog.text
    inc = engine(2, full_every=3).incremental
    assert inc is not None and (inc.rank, inc.world_size, inc.full_every) == (0, 2, 3)


def test_incremental_steps_on_s3_upload_only_the_changed_shards_and_retention_keeps_what_they_reference(
        inc2: Ranks, s3_server: Any, tmp_path: Path) -> None:
    """The S3 remote, ``full_every=3`` and ``keep_remote=2``: 1 whole, 2 and 3 reference 1, 4 whole, 5 references
    4. Step 1 stays while step 2 or 3 is kept; after step 5 the remote holds 4 and 5 only. A restart on empty node
    folders restores step 5 from the remote and saves step 6."""
    recs = inc2.phases("s3")
    for rank, rec in enumerate(recs):
        steps = {int(k): v for k, v in rec["steps"].items()}
        if rank == 0:  # rank 0 applies the remote's retention before its wait() returns; rank 1 may list earlier
            assert [steps[s]["remote"] for s in range(1, 6)] == [[1], [1, 2], [1, 2, 3], [1, 3, 4], [4, 5]], rec
        assert [steps[s]["refs"] for s in range(1, 6)] == [[], [1], [1], [], [4]], (rank, rec)
        for s in (1, 4):
            assert steps[s]["own"] > BASE_SHARD, (rank, s, steps[s])
        for s in (2, 3, 5):  # this rank's adapter shard and headers only
            assert steps[s]["own"] < 8192, (rank, s, steps[s])
        assert rec["restored"] == 5 and rec["exact"], (rank, rec)
        assert rec["remote"] == [4, 5, 6], (rank, rec)  # keep 5 and 6, and step 4 that step 5 references
    assert recs[0]["verify"] == 0, recs[0]
    # a resharded restore of the remote's step 6 onto one process follows its references to step 5
    cfg = json.loads((inc2.root / "config-inc2.json").read_text())
    st: dict[str, Any] = {"model": {k: torch.zeros_like(v) for k, v in full(6).items()}, "step": 0}
    with tierckpt.CheckpointManager(tmp_path / "one", remote=cfg["s3"], storage_options=cfg["storage_options"],
                                    rank=0, world_size=1) as m:
        assert m.restore(st, step=6, source="remote") == 6
    assert st["step"] == 6
    for k, ref in full(6).items():
        assert torch.equal(st["model"][k].view(torch.uint8), ref.view(torch.uint8)), k
