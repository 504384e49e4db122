"""Peer copies (``peer_replicas=1``) with real ranks: 2 nodes x 2 ranks on gloo, each node its own local folder.

A job saves incremental steps with no remote, node B's folder is wiped, and the restarted job restores the
newest step from A's replica of B (which carries the files the step references), bit for bit, and commits it back
into B's folder; with B's copy and A's replica of it both corrupted, B's rank reads
the step from the remote. The transfer itself (a replica killed mid-transfer, a checksum that differs, a foreign
request) is tested in-process in tests/tiers/test_peer_channel.py.
"""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests._support.ranks import Ranks, assert_all_ok, rank_env, run_ranks
from tests.distributed._dist_worker import make_state, summarize
from tierckpt import cli
from tierckpt.testing import refused_url

pytestmark = [pytest.mark.timeout(240)]

WORKER = Path(__file__).resolve().parent / "_peer_worker.py"
WORLD = 4


def launch(job: str, name: str, root: Path, **extra: Any) -> Ranks:
    cfg = {"world": WORLD, "root": str(root), "name": name, "timeout": 20,
           "store": f"file://{root}/store-{name}-{secrets.token_hex(4)}", **extra}
    cfg_path = root / f"config-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    ranks = run_ranks(lambda r: [str(WORKER), job, str(r), str(cfg_path)], WORLD, root, name, env=rank_env(),
                      timeout=120)
    assert_all_ok(ranks, name, 120)
    return ranks


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def replica(root: Path, node: int, step: int) -> Path:
    return root / "replicas" / f"node-{node:05d}" / f"step-{step:010d}"


def corrupt_rank_data(folder: Path, rank: int) -> None:
    data = sorted(folder.glob(f"r{rank:05d}-p*.safetensors"))
    assert data, f"no data file of rank {rank} in {folder}"
    raw = bytearray(data[0].read_bytes())
    raw[-1] ^= 0xFF
    data[0].write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def lost_node(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Ranks, Ranks]:
    """Saved incrementally without a remote (the newest step on any remote would be older); node B wiped;
    restarted."""
    root = tmp_path_factory.mktemp("peers")
    saved = launch("save", "save", root, steps=[1, 2, 3], options={"incremental": True})
    shutil.rmtree(root / "B")
    restored = launch("restore", "restore", root, options={"incremental": True})
    return root, saved, restored


def test_saves_are_copied_to_the_partner_node_without_a_remote(lost_node: tuple[Path, Ranks, Ranks]) -> None:
    root, saved, _ = lost_node
    for rank, rec in enumerate(saved.phases("save")):
        assert rec["persisted"] == [True, True, True]
        assert rec["node"] == (0 if rank < 2 else 1)
        if rank in (0, 2):  # the node leaders copy
            assert rec["failures"] == 0 and rec["pushed"] == 3
    # A holds B's newest keep_local=2 steps as replicas, committed; nothing temporary is left
    held = sorted(p.name for p in (root / "A" / "replicas" / "node-00001").iterdir())
    assert held == ["step-0000000002", "step-0000000003"]
    assert (replica(root / "A", 1, 3) / "manifest.json").is_file()
    assert json.loads((replica(root / "A", 1, 3) / "manifest.json").read_text())["holds_ranks"] == [2, 3]
    # the steps are incremental (step 3 references the unchanged tensor's bytes in step 1's files); a replica
    # carries the referenced files into its own folder and references nothing
    assert json.loads((step_folder(root / "A", 3) / "manifest.json").read_text())["refs"] == [1]
    assert "refs" not in json.loads((replica(root / "A", 1, 3) / "manifest.json").read_text())
    for rank in (2, 3):
        data = [p.name for p in replica(root / "A", 1, 3).glob(f"r{rank:05d}-p*.safetensors")]
        assert len({n.rsplit("-", 1)[1] for n in data}) == 2, data  # its own save's file and step 1's


def test_ls_and_verify_see_the_replicas(lost_node: tuple[Path, Ranks, Ranks],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = lost_node[0]
    assert cli.main(["ls", "--json", str(root / "A")]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == {"1": [2, 3]}
    corrupt_rank_data(replica(root / "A", 1, 2), 3)
    assert cli.main(["verify", str(root / "A")]) != 0  # the damaged replica is found
    out = capsys.readouterr().out
    # A's own steps 1-3 (step 1 held: the later steps reference it) and B's two replicas
    assert "replica under" in out and "4 of 5 steps intact; corrupt: [2]" in out


def test_a_wiped_node_restores_the_newest_step_from_its_partners_replica(
        lost_node: tuple[Path, Ranks, Ranks]) -> None:
    root, _, restored = lost_node
    for rank, rec in enumerate(restored.phases("restore")):
        assert rec["step"] == 3, rec
        assert rec["state"] == summarize(make_state(rank, 3))  # every value, bit for bit (float32 -> JSON exact)
        assert rec["frozen"] is True  # the referenced bytes too
        tiers = {tier for tier, _ in rec["loads"]}
        assert tiers == ({"local"} if rank < 2 else {"peer"}), rec["loads"]
        assert rec["fetched"] == [], rec  # what a rank fetched went into the local tier, nothing is left behind


def test_the_fetched_shards_are_committed_back_into_the_replaced_nodes_local_tier(
        lost_node: tuple[Path, Ranks, Ranks], capsys: pytest.CaptureFixture[str]) -> None:
    """B's ranks each fetched only their own shard; each moved it into B's own step folder, and the last one wrote
    the step's manifest.json: B holds step 3 again as its own save left it, so the next restart (or retention)
    reads it from the local tier."""
    root = lost_node[0]
    own = step_folder(root / "B", 3)
    assert (own / "manifest.json").read_bytes() == (replica(root / "A", 1, 3) / "manifest.json").read_bytes()
    names = sorted(p.name for p in own.iterdir())
    assert names == sorted(p.name for p in replica(root / "A", 1, 3).iterdir())  # the layout of B's own save
    assert {n[:6] for n in names if n != "manifest.json"} == {"r00002", "r00003"}
    assert not (root / "B" / "replicas" / ".fetch-r00002").exists()
    assert not (root / "B" / "replicas" / ".fetch-r00003").exists()
    assert cli.main(["verify", "--json", str(root / "B")]) == 0  # every byte, against the manifests
    doc = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"], r["ranks"], r["extra_files"]) for r in doc["steps"]] == [(3, True, [2, 3], [])], doc


def test_rank_0s_node_lost_while_the_remote_is_down_restores_from_the_replica(tmp_path: Path) -> None:
    """The remote refuses every connection throughout: the saves reach the local tiers and the partners' replicas
    all the same (their uploads fail), rank 0's node is lost, and the restart restores the newest step."""
    options = {"storage_options": {"client_kwargs": {"endpoint_url": refused_url()}, "key": "k", "secret": "s"}}
    saved = launch("save", "save-a", tmp_path, steps=[1, 2], remote="s3://bucket/run", options=options)
    for rec in saved.phases("save"):
        assert rec["persisted"] == [True, True] and rec["failures"] == 0, rec
        assert rec["wait_error"]["type"] == "UploadError", rec  # the remote is down: nothing reached it
    assert {rec["pushed"] for rec in saved.phases("save")} >= {2}  # each node leader copied step 2 to its partner
    assert replica(tmp_path / "B", 0, 2).is_dir() and replica(tmp_path / "A", 1, 2).is_dir()
    shutil.rmtree(tmp_path / "A")  # rank 0's node: it alone lists the remote, which refuses
    restored = launch("restore", "restore-a", tmp_path, remote="s3://bucket/run", options=options)
    for rank, rec in enumerate(restored.phases("restore")):
        assert rec["step"] == 2, rec
        assert rec["state"] == summarize(make_state(rank, 2))
        assert [t for t, _ in rec["loads"]] == (["peer"] if rank < 2 else ["local"]), rec["loads"]
    # A's ranks committed what they fetched back into A's own folder
    assert (step_folder(tmp_path / "A", 2) / "manifest.json").read_bytes() == \
        (replica(tmp_path / "B", 0, 2) / "manifest.json").read_bytes()


def test_a_job_on_one_node_is_told_peer_copies_need_another_node(tmp_path: Path) -> None:
    ran = launch("one_node", "one-node", tmp_path)
    for rec in ran.phases("one_node"):
        assert rec["error"]["type"] == "CheckpointError"
        assert "peer_replicas=1 needs at least 2 nodes" in rec["error"]["msg"] and "has 1" in rec["error"]["msg"]


def test_with_both_copies_corrupted_a_rank_falls_back_to_the_remote(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    launch("save", "save-remote", tmp_path, steps=[1, 2, 3], remote=str(remote))
    assert (step_folder(remote, 3) / "manifest.json").is_file()
    corrupt_rank_data(step_folder(tmp_path / "B", 3), 2)  # B's own copy of rank 2's shard
    corrupt_rank_data(replica(tmp_path / "A", 1, 3), 2)  # and A's replica of it
    restored = launch("restore", "restore-remote", tmp_path, remote=str(remote))
    for rank, rec in enumerate(restored.phases("restore")):
        assert rec["step"] == 3, rec
        assert rec["state"] == summarize(make_state(rank, 3))
        assert [t for t, _ in rec["loads"]] == (["remote"] if rank == 2 else ["local"]), rec["loads"]
    assert "in tier peer is corrupt" in restored.logs[2]
