"""Real multi-process jobs on the gloo backend, one OS process per rank.

Every rank is a ``python tests/distributed/_dist_worker.py`` process joined through a FileStore; each "node" is its
own local folder, the remote tier is a shared POSIX folder or the S3 loopback server. One launch runs several phases
(see the worker); the fixtures here launch once per module and the tests assert on what each rank recorded, then on
the folders themselves. Single-process twins of the error paths: tests/distributed/test_single_process.py.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests._support.ranks import Ranks, assert_all_ok, rank_env, run_ranks
from tests.distributed._dist_worker import make_state, summarize
from tierckpt import cli

pytestmark = [pytest.mark.timeout(240)]

TESTS_DIR = Path(__file__).resolve().parent
WORKER = TESTS_DIR / "_dist_worker.py"
#: gloo timeout for the manager's groups (a dead peer usually fails a collective at once; this is the bound)
COLLECTIVE_TIMEOUT_S = 20


Run = Ranks  # one job's outcome (tests/_support/ranks.py)


def launch(scenario: str, world: int, root: Path, *, extra: dict[str, Any] | None = None, timeout: float = 120,
           expect_ok: bool = True) -> Run:
    """Start ``world`` rank processes of ``scenario`` and wait for all of them (killing them all past ``timeout``)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"world": world, "root": str(root), "store": f"file://{root}/store-{scenario}-{secrets.token_hex(4)}",
           "timeout": COLLECTIVE_TIMEOUT_S, **(extra or {})}
    cfg_path = root / f"config-{scenario}.json"
    cfg_path.write_text(json.dumps(cfg))
    ranks = run_ranks(lambda r: [str(WORKER), scenario, str(r), str(cfg_path)], world, root, scenario,
                      env=rank_env(), timeout=timeout)
    if ranks.timed_out or expect_ok:
        assert_all_ok(ranks, scenario, timeout)
    return ranks


def expected(rank: int, step: int) -> dict[str, Any]:
    return summarize(make_state(rank, step))


def manifest_of(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step-{step:010d}" / "manifest.json").read_text())


def files_of(root: Path, step: int) -> list[str]:
    return sorted(p.name for p in (root / f"step-{step:010d}").iterdir())


def run_cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


# ------------------------------------------------------------------------------------------------ world 2, POSIX
@pytest.fixture(scope="module")
def posix2(tmp_path_factory) -> Run:
    return launch("posix2", 2, tmp_path_factory.mktemp("posix2"))


def test_roundtrip_world2_separate_nodes(posix2: Run) -> None:
    for rank in (0, 1):
        rec = posix2.phase(rank, "roundtrip")
        assert rec["wait_error"] is None and rec["persisted"] == [True, True, True]
        assert rec["steps"] == [[1, "remote"], [2, "local+remote"], [3, "local+remote"]]  # keep_local=2
        assert rec["restored"] == 3
        assert rec["state"] == expected(rank, 3)
        assert rec["loads"] == [["local", 3]]


def test_layout_world2_node_folders_hold_own_shard_remote_holds_all(posix2: Run) -> None:
    # after the replace phase: step 4 was saved by the replaced node too
    root = posix2.root
    for rank in (0, 1):
        node = root / f"n{rank}"
        m = manifest_of(node, 4)
        assert m["world_size"] == 2 and m["holds_ranks"] == [rank]
        assert [r["rank"] for r in m["ranks"]] == [rank]  # a node's copy lists its own ranks: O(1) in the world
        names = [n for n in files_of(node, 4) if n != "manifest.json"]
        assert names and all(n.startswith(f"r{rank:05d}-") for n in names)
    m = manifest_of(root / "remote", 4)
    assert m.get("holds_ranks") is None and [r["rank"] for r in m["ranks"]] == [0, 1]
    names = files_of(root / "remote", 4)
    assert any(n.startswith("r00000-") for n in names) and any(n.startswith("r00001-") for n in names)
    assert sorted(p.name for p in (root / "remote").glob("step-*")) == [f"step-{s:010d}" for s in (1, 2, 3, 4)]
    # both ranks' manifests name the same save
    assert manifest_of(root / "n0", 4)["save_id"] == manifest_of(root / "n1", 4)["save_id"] == m["save_id"]


def test_node_replacement_restores_from_remote_without_extra_call(posix2: Run) -> None:
    r0, r1 = posix2.phase(0, "replace"), posix2.phase(1, "replace")
    assert r0["restored"] == r1["restored"] == 3
    assert r0["loads"] == [["local", 3]]
    assert r1["loads"] == [["remote", 3]]  # its disk was empty
    assert r0["state"] == expected(0, 3) and r1["state"] == expected(1, 3)
    for rec in (r0, r1):  # training goes on: the next step commits on both nodes and in the remote
        assert rec["after"]["wait_error"] is None
        assert [4, "local+remote"] in rec["steps"]


def test_failed_save_on_one_rank_uncommits_the_step_everywhere(posix2: Run) -> None:
    root = posix2.root
    for e in (posix2.phase(0, "failed_save")["wait_error"], posix2.phase(0, "failed_save")["persisted_error"]):
        assert e is not None and "CheckpointError" in e["classes"], e
        assert e["step"] == 2 and "rank(s) [1]" in e["msg"] and "rank 1: FileExistsError" in e["msg"], e
    for rank in (0, 1):
        rec = posix2.phase(rank, "failed_save")
        assert rec["first"]["wait_error"] is None
        assert rec["wait_error"] is not None and rec["persisted_error"] is not None
        assert "step-0000000002" not in rec["listing_after_failure"], rec["listing_after_failure"]
        assert rec["restored"] == 1 and rec["state"] == expected(rank, 1)
        assert rec["third"]["wait_error"] is None  # the job goes on
        assert [s for s, _ in rec["steps"]] == [1, 3]
    assert not (root / "fremote" / "step-0000000002").exists()
    for rank in (0, 1):
        assert not any(p.name.startswith(("step-0000000002", ".tmp-step-0000000002"))
                       for p in (root / f"f{rank}").iterdir())


def test_failed_save_the_failing_rank_also_gets_the_error_naming_it(posix2: Run) -> None:
    rec = posix2.phase(1, "failed_save")
    for e in (rec["wait_error"], rec["persisted_error"]):
        assert "CheckpointError" in e["classes"], e
        assert e["step"] == 2 and "rank(s) [1]" in e["msg"], e


def test_disk_full_on_one_rank_every_rank_gets_the_error_naming_it(posix2: Run) -> None:
    for rank in (0, 1):
        rec = posix2.phase(rank, "disk_full")
        assert rec["first"]["wait_error"] is None
        for e in (rec["wait_error"], rec["persisted_error"]):
            assert e is not None and "CheckpointError" in e["classes"], e
            assert e["step"] == 2 and "rank(s) [1]" in e["msg"] and "No space left" in e["msg"], e
        assert not [n for n in rec["listing_after_failure"] if "0000000002" in n], rec["listing_after_failure"]
        assert rec["restored"] == 1 and rec["state"] == expected(rank, 1)


def test_different_local_progress_agree_on_newest_common_step(posix2: Run) -> None:
    r = [posix2.phase(rank, "progress") for rank in (0, 1)]
    for rank in (0, 1):
        assert r[rank]["saved"]["wait_error"] is None
        assert r[rank]["newest_common"]["restored"] == 2, r[rank]["newest_common"]  # rank 1 lost step 3
        assert r[rank]["newest_common"]["state"] == expected(rank, 2)
        # rank 1's step 2 is corrupt: both fall back to 1, never a mix of steps
        assert r[rank]["corrupt_fallback"]["restored"] == 1, r[rank]["corrupt_fallback"]
        assert r[rank]["corrupt_fallback"]["state"] == expected(rank, 1)
        # exactly step 2, guarded: rank 0 read its intact copy into its tensors, rank 1 cannot load it; rank 0 puts
        # the old bytes back before both raise, so its state is as it was
        g = r[rank]["corrupt_explicit_guarded"]
        assert g["error"]["type"] == "CorruptCheckpointError" and g["error"]["step"] == 2, g
        assert g["state"] == summarize(_empty(rank))
        assert rank == 1 or (len(g["put_back"]) == 1 and g["put_back"][0] > 0), g
        assert r[rank]["corrupt_fallback_in_place"]["restored"] == 1, r[rank]["corrupt_fallback_in_place"]
        assert r[rank]["corrupt_fallback_in_place"]["state"] == expected(rank, 1)
        e = r[rank]["explicit_missing"]["error"]
        assert e["type"] == "CheckpointNotFoundError" and "rank(s) [1]" in e["msg"] and e["step"] == 3
        assert r[rank]["explicit_missing"]["state"] == summarize(_empty(rank))  # untouched
        assert r[rank]["nothing"] == {"restored": None, "state": summarize(_empty(rank)), "loads": []}
    d0, d1 = r[0]["disjoint"], r[1]["disjoint"]
    assert "error" in d0 and "error" in d1, (d0, d1)  # rank 0 holds {3}, rank 1 {1, 2}: no common step
    assert d0["error"]["type"] == d1["error"]["type"] and d0["error"]["detail"] == d1["error"]["detail"]
    assert d0["state"] == summarize(_empty(0)) and d1["state"] == summarize(_empty(1))


def _empty(rank: int) -> dict[str, Any]:
    from tests.distributed._dist_worker import empty_state

    return empty_state(rank)


def test_two_ranks_sharing_one_node_folder(posix2: Run) -> None:
    for rank in (0, 1):
        rec = posix2.phase(rank, "shared")
        assert rec["node_ranks"] == [0, 1]
        assert rec["wait_error"] is None
        assert rec["steps"] == [[1, "local+remote"], [2, "local+remote"]]
        assert rec["restored"] == 2 and rec["state"] == expected(rank, 2)
        assert rec["loads"] == [["local", 2]]
    shared = posix2.root / "shared"
    m = manifest_of(shared, 2)
    assert m["holds_ranks"] == [0, 1] and m["world_size"] == 2
    names = files_of(shared, 2)
    assert any(n.startswith("r00000-") for n in names) and any(n.startswith("r00001-") for n in names)
    assert manifest_of(posix2.root / "sremote", 2).get("holds_ranks") is None


def test_the_manager_creates_no_process_group_and_leaves_no_store_key(posix2: Run) -> None:
    for rank in (0, 1):
        rec = posix2.phase(rank, "groups")
        assert rec["during"] == rec["before"] == rec["after"], rec  # no gloo group: no socket to every other rank
        assert rec["saved"] == {"wait_error": None, "persisted": [True, True]}, rec
        assert rec["restored"]["restored"] == 2, rec
        # every agreement's and upload message's keys are removed by their readers (the per-rank counters of
        # managers created exist from the earlier phases, whose last messages may still be read meanwhile)
        assert rec["keys_after"] <= rec["keys_before"], rec


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_on_node_folders_and_remote(posix2: Run, capsys) -> None:
    root = posix2.root
    rc, out = run_cli(capsys, "verify", root / "n0")
    assert rc == 0, out
    assert "step 4: OK" in out and "2 ranks, shards here: [0]" in out
    rc, out = run_cli(capsys, "verify", root / "n1")
    assert rc == 0, out
    assert "step 4: OK" in out and "shards here: [1]" in out
    rc, out = run_cli(capsys, "verify", root / "remote")
    assert rc == 0, out
    assert out.count("shards here: all") == 4
    rc, out = run_cli(capsys, "verify", root / "n1", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and [s["ranks"] for s in doc["steps"]] == [[1]]
    rc, out = run_cli(capsys, "ls", root / "n0", "--json")
    assert rc == 0 and [s["step"] for s in json.loads(out)["steps"]] == [3, 4]
    rc, out = run_cli(capsys, "ls", root / "remote")
    assert rc == 0 and all(f" {s}  committed" in out for s in (1, 2, 3, 4)), out


def test_cli_names_rank1s_corrupt_shard_in_the_remote(posix2: Run, tmp_path, capsys) -> None:
    remote = tmp_path / "remote"
    shutil.copytree(posix2.root / "remote", remote)
    folder = remote / "step-0000000004"
    bad = sorted(folder.glob("r00001-p*.safetensors"))[0]
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x01
    bad.write_bytes(bytes(data))
    rc, out = run_cli(capsys, "verify", remote)
    assert rc == 1, out
    assert "step 4: CORRUPT" in out and bad.name in out
    assert all(f"step {s}: OK" in out for s in (1, 2, 3))
    rc, out = run_cli(capsys, "verify", remote, "--json")
    step4 = [s for s in json.loads(out)["steps"] if s["step"] == 4][0]
    assert rc == 1 and step4["bad_files"] == [bad.name]
    # a rank's manifest missing from a committed step: named too
    rm1 = sorted(folder.glob("r00001-*.manifest.json"))[0]
    rm1.unlink()
    rc, out = run_cli(capsys, "verify", remote, "--step", "4")
    assert rc == 1 and rm1.name in out, out


# ------------------------------------------------------------------------------------------------ world 4
@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> Run:
    return launch("world4", 4, tmp_path_factory.mktemp("world4"), timeout=150)


def test_roundtrip_world4_three_nodes(world4: Run) -> None:
    nodes = {0: [0, 1], 1: [0, 1], 2: [2], 3: [3]}
    for rank in range(4):
        rec = world4.phase(rank, "roundtrip")
        assert rec["node_ranks"] == nodes[rank]
        assert rec["wait_error"] is None and rec["persisted"] == [True, True]
        assert rec["restored"] == 2 and rec["state"] == expected(rank, 2)
        assert rec["loads"] == [["local", 2]]
    root = world4.root
    assert manifest_of(root / "B", 2)["holds_ranks"] == [2]
    assert manifest_of(root / "C", 2)["holds_ranks"] == [3]
    assert [r["rank"] for r in manifest_of(root / "remote", 2)["ranks"]] == [0, 1, 2, 3]
    assert {n[:6] for n in files_of(root / "remote", 2) if n != "manifest.json"} == {f"r{r:05d}" for r in range(4)}


def test_node_replacement_world4(world4: Run) -> None:
    for rank in range(4):
        rec = world4.phase(rank, "replace")
        assert rec["restored"] == 2 and rec["state"] == expected(rank, 2)
        assert rec["loads"] == [["remote" if rank in (0, 1) else "local", 2]]
    # the replaced node's folder holds no step (restore does not cache multi-rank steps)
    assert not list((world4.root / "A").glob("step-*"))


# ------------------------------------------------------------------------------------------------ S3
@pytest.fixture(scope="module")
def s3run(tmp_path_factory, s3_server, s3_admin) -> Iterator[Run]:
    bucket = f"tierckpt-dist-{secrets.token_hex(3)}"
    s3_admin.mkdir(bucket)
    try:
        yield launch("s3", 2, tmp_path_factory.mktemp("s3"), timeout=150,
                     extra={"remote": f"s3://{bucket}/ckpt", "storage_options": s3_server.storage_options()})
    finally:
        try:
            s3_admin.rm(bucket, recursive=True)
        except Exception:
            pass


def test_s3_remote_roundtrip_and_replacing_the_committer(s3run: Run) -> None:
    for rank in (0, 1):
        rec = s3run.phase(rank, "roundtrip")
        assert rec["wait_error"] is None
        assert rec["steps"] == [[1, "local+remote"], [2, "local+remote"]]
        assert rec["restored"] == 2 and rec["state"] == expected(rank, 2)
        assert rec["loads"] == [["local", 2]]
    for rank in (0, 1):
        rec = s3run.phase(rank, "replace")
        assert rec["restored"] == 2 and rec["state"] == expected(rank, 2)
        assert rec["loads"] == [["remote" if rank == 0 else "local", 2]]


# ------------------------------------------------------------------------------------------------ a rank killed
@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[Run, Run]:
    root = tmp_path_factory.mktemp("kill")
    first = launch("kill1", 2, root, expect_ok=False, timeout=120)
    leftovers = {r: sorted(p.name for p in (root / f"n{r}").iterdir()) for r in (0, 1)}
    (root / "leftovers.json").write_text(json.dumps(leftovers))
    second = launch("kill2", 2, root, timeout=120)
    return first, second


def test_rank_killed_mid_save_others_get_an_error_naming_the_step(killed: tuple[Run, Run]) -> None:
    first, _ = killed
    assert first.returncodes[1] == -signal.SIGKILL, first.logs[1][-3000:]
    assert first.returncodes[0] == 0, first.logs[0][-3000:]
    assert first.phase(0, "first")["wait_error"] is None
    second = first.results[0]["second"]
    for e in (second["persisted_error"], second["wait_error"]):
        assert e is not None and "CheckpointError" in e["classes"], second
        assert e["step"] == 2 and "step 2" in e["msg"], e
    assert second["seconds"] < COLLECTIVE_TIMEOUT_S + 15
    assert first.results[0].get("done") is True
    assert "second" not in first.results[1]  # rank 1 died inside it


def test_rank_killed_mid_save_the_error_names_the_dead_rank(killed: tuple[Run, Run]) -> None:
    e = killed[0].results[0]["second"]["wait_error"]
    assert e is not None and "rank 1" in e["msg"], e


def test_after_a_kill_the_previous_step_is_everyones_target(killed: tuple[Run, Run]) -> None:
    _, second = killed
    for rank in (0, 1):
        rec = second.phase(rank, "restart")
        assert rec["restored"] == 1 and rec["state"] == expected(rank, 1), rec
        # start-up recovery removed the killed save's leftovers: rank 1's temporary folder, rank 0's lone shard
        assert not [n for n in rec["listing_at_start"] if "0000000002" in n], rec["listing_at_start"]
        assert rec["again"]["wait_error"] is None  # step 2 saved again by the new run
        assert [s for s, _ in rec["steps"]] == [1, 2]
        assert rec["second_restore"]["restored"] == 2 and rec["second_restore"]["state"] == expected(rank, 2)
    leftovers = json.loads((second.root / "leftovers.json").read_text())  # before the restart: there were some
    assert "step-0000000002" in leftovers["0"] and any(n.startswith(".tmp-step-0000000002-r00001-")
                                                        for n in leftovers["1"]), leftovers


# ------------------------------------------------------------------------------------------------ remote outage
def test_remote_outage_bounds_every_nodes_local_tier_and_ranks_upload_the_same_steps(tmp_path: Path) -> None:
    """Two ranks on two nodes, the shared remote refusing every write for 8 saves: rank 0 decides which steps to
    upload, drop and delete, the other rank follows, so both nodes keep at most keep_local + max_upload_backlog
    steps (+ the one in flight) and agree; once the remote is back the newest steps are committed for both ranks."""
    run = launch("outage2", 2, tmp_path)
    recs = [run.phase(r, "outage") for r in (0, 1)]
    for r, rec in enumerate(recs):
        assert "phase_error" not in rec, rec
        assert rec["most"] <= 5, (r, rec)  # not every step on every node
        assert rec["during"][-1] == 8 and len(rec["during"]) <= 4, (r, rec)
        assert "UploadError" in rec["outcomes"] and rec["outcomes"][-1] == "UploadError", (r, rec)
        assert rec["uploaded9"] and rec["remote_after"] == [8, 9] and rec["local_after"] == [8, 9], (r, rec)
    assert recs[0]["during"] == recs[1]["during"], recs
    assert recs[0]["outcomes"] == recs[1]["outcomes"], recs


def test_no_rank_but_0_reads_a_manifest_while_a_remote_commit_is_in_progress(tmp_path: Path) -> None:
    """The ranks learn of a remote commit through the job's c10d store, not by polling ``manifest.json``."""
    run = launch("count2", 2, tmp_path)
    recs = [run.phase(r, "count") for r in (0, 1)]
    for rec in recs:
        assert "phase_error" not in rec, rec
        assert rec["wait_error"] is None and rec["remote"] == [1, 2, 3], rec
    assert recs[1]["manifest_reads"] == [], recs[1]["manifest_reads"]  # polling read it 10-15 times a second


def test_rank0_killed_mid_remote_commit_no_rank_treats_the_step_as_committed(tmp_path: Path) -> None:
    first = launch("rcommit1", 2, tmp_path, expect_ok=False, timeout=120)
    assert first.returncodes[0] == -signal.SIGKILL, first.returncodes
    rec = first.phase(1, "second")
    assert rec["upload_error"] is not None and rec["upload_error"]["type"] == "UploadError", rec
    assert "rank 0" in rec["upload_error"]["msg"], rec
    assert rec["remote"] == [1], rec  # step 2's shards are there, its manifest.json is not
    assert not rec["health"]["ok"] and rec["health"]["remote_step"] == 1, rec
    second = launch("rcommit2", 2, tmp_path, timeout=120)
    for r in (0, 1):
        out = second.phase(r, "restart")
        assert out["remote_at_start"] == [1] and out["wait_error"] is None and out["remote"] == [1, 2], out
        assert out["restore"]["restored"] == 2 and out["restore"]["state"] == expected(r, 2), out


# ------------------------------------------------------------------------------------------------ store traffic
def test_store_traffic_per_rank_is_constant_in_the_world_size_and_the_remote_steps(tmp_path: Path) -> None:
    """Real jobs, every rank's c10d store traffic counted: what each rank sends and receives for one save, a
    restart with every node intact and one with a node wiped (its ranks read from the remote) is the same at 2, 8
    and 16 ranks (each its own process), and with 1 or 8 remote-only steps (``keep_local=1``: 2 or 9 steps on the
    remote). Every agreement's keys are gone once it is over."""
    jobs = ((16, 2), (2, 2), (8, 2), (2, 9))

    def job(world: int, steps: int) -> Run:
        return launch("traffic", world, tmp_path / f"w{world}s{steps}", extra={"steps": steps}, timeout=150)

    # the 16-rank job runs next to the three others, one after another (its ranks mostly wait on each other)
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(job, *jobs[0])
        runs = dict(zip(jobs[1:], pool.map(lambda ws: job(*ws), jobs[1:])))
        runs[jobs[0]] = big.result()
    got = {}
    for (world, steps), run in runs.items():
        recs = run.phases("traffic")
        for rank, rec in enumerate(recs):
            assert rec["restart_restore"]["restored"] == steps and rec["wiped_restore"]["restored"] == steps, rec
            wiped_loads = rec["wiped_restore"]["loads"]
            assert wiped_loads == [["remote" if rank == world - 1 else "local", steps]], wiped_loads
        # no agreement leaves a key, nor does an upload message (removed by its last reader): once every rank
        # is past the save and each restart, the keys that some rank set and none removed are only each rank's
        # count of the managers it created
        for when in ("keys_after_save", "keys_after_restart", "keys_after_wiped"):
            created = {k for rec in recs for k in rec[when]["created"]}
            removed = {k for rec in recs for k in rec[when]["deleted"]}
            assert created - removed == {f"tierckpt/managers/r{r}" for r in range(world)}, (when, created - removed)
        # the last rank (not rank 0; its node is the one wiped) stands for every rank of its role
        got[(world, steps)] = {phase: recs[-1][phase] for phase in ("save", "restart", "wiped")}
    for phase in ("save", "restart", "wiped"):
        agree = {k: v[phase]["agree"]["sent"] + v[phase]["agree"]["received"] for k, v in got.items()}
        requests = {k: v[phase]["agree"]["requests"] for k, v in got.items()}
        # a digit more in a rank's or a step's number (keys in/15, out/15): nothing that grows with W or the steps
        assert max(agree.values()) - min(agree.values()) <= 48, (phase, agree)
        assert max(requests.values()) - min(requests.values()) <= 2, (phase, requests)
        # five requests an agreement (its input, the wait for the answer, its read, the input's removal, the count
        # of readers), two more for an answer of its own (its read and removal: a node leader's references in a
        # save, the manifest of a rank that reads from the remote), one for the count of managers a restart makes
        agreements, own, counter = {"save": (2, 1, 0), "restart": (5, 0, 1), "wiped": (6, 1, 1)}[phase]
        assert all(v[phase]["agree"]["requests"] <= 5 * agreements + 2 * own + counter for v in got.values()), \
            (phase, requests)
        # the last to read an answer removes it and its count of readers
        assert all(v[phase]["role"]["requests"] <= 2 * agreements for v in got.values()), got
        upload = {k: v[phase]["upload"]["sent"] + v[phase]["upload"]["received"] for k, v in got.items()}
        # the replicator's start-up decision names the remote's steps: a few bytes per step, once per start
        assert max(upload.values()) - min(upload.values()) <= 240, (phase, upload)
