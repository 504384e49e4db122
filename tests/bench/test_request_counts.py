"""benchmarks/request_counts.py: the counting S3 server counts what a client really sends, by operation, key and
prefix, and under the phase a rank's request is tagged with; the ranks' local-tier call counter counts what a known
sequence of calls makes; and a 1-, 2- and 8-rank job's requests, local calls and bytes read per save and per restart
come out as the protocol says (exact where it is deterministic, within a constant of each other across W where the
protocol promises O(1) per rank). Each world size's ranks are launched once and run every phase, each phase in a
process group of its own, so that a rank imports torch once rather than once per phase."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("moto")
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

pytestmark = [pytest.mark.timeout(240)]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its scripts import harness.py there

import _request_counts_rank as rank_script  # noqa: E402
import _request_counts_report as report  # noqa: E402
import _request_counts_server as counting  # noqa: E402
import harness  # noqa: E402
import request_counts as bench  # noqa: E402

from tests._support.procs import Child, start_python  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with counting.counting_s3_server("bench-requests-test", trace=True) as s3:
        yield s3


def _forked(argv: list[str], log: Path, cwd: Path | None, env: dict[str, str]) -> Child:
    """A rank process forked from the server that has imported torch, its output in ``log``."""
    log.write_text("")
    return start_python(argv, env=env, cwd=cwd, stdout=log)


@pytest.fixture(scope="module")
def launches(server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[str, Any]]]:
    """Every phase for 1, 2 and 8 ranks, one launch per world size (each rank checks the bytes it restored, or the
    launch raises); the ranks start from the suite's forkserver."""
    scratch = tmp_path_factory.mktemp("requests")
    harness.start_process = _forked
    try:
        yield {world: bench.run_world(server, world, scratch, steps=STEPS, numel=64 * 1024, timeout_s=180)
               for world in (1, 2, 8)}
    finally:
        harness.start_process = harness.popen


@pytest.fixture(scope="module")
def runs(launches: dict[int, dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """The summary of every phase for each world size."""
    return {w: {p: bench.summarize_launch(launch, STEPS) for p, launch in by_phase.items()}
            for w, by_phase in launches.items()}


def n(summary: dict[str, Any], label: str) -> int:
    """How many requests of "METHOD kind" a phase's summary counted."""
    return summary["by_kind"].get(label, {"n": 0})["n"]


def test_classify_names_the_operations() -> None:
    c = counting.classify
    assert c("GET", "/b", "list-type=2&prefix=run%2F&delimiter=%2F", {}) == "list"
    assert c("GET", "/b", "uploads", {}) == "list-uploads"
    assert c("GET", "/b/run/step-0000000003/manifest.json", "", {}) == "step-manifest"
    assert c("GET", "/b/run/step-0000000003/r00012-0a1b2c3d.manifest.json", "", {}) == "rank-manifest"
    assert c("HEAD", "/b/run/step-0000000003/r00012-p0000-0a1b2c3d.safetensors", "", {}) == "data"
    assert c("POST", "/b/run/x.safetensors", "uploads", {}) == "mpu-create data"
    assert c("PUT", "/b/run/x.safetensors", "partNumber=2&uploadId=u", {}) == "mpu-part data"
    assert c("POST", "/b/run/x.safetensors", "uploadId=u", {}) == "mpu-complete data"
    assert c("DELETE", "/b/run/x.safetensors", "uploadId=u", {}) == "mpu-abort data"
    assert c("PUT", "/b/k", "", {"x-amz-copy-source": "b/j"}) == "copy other-object"
    assert c("POST", "/b", "delete", {}) == "delete-multi"
    assert c("PUT", "/b", "", {}) == "create-bucket"


def test_the_server_counts_what_a_client_sends(server: Any) -> None:
    """A known sequence of S3 calls, one request each (through boto3, tagged as rank 5), is counted exactly: by
    kind, by rank, with the bytes of each body."""
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config

    opts = server.storage_options
    s3 = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=opts["key"],
                      aws_secret_access_key=opts["secret"], region_name="us-east-1",
                      config=Config(user_agent_extra="tierckpt-rank/5"))
    b, base = server.bucket, "known/step-0000000001"
    server.app.counter.take()
    s3.put_object(Bucket=b, Key=f"{base}/manifest.json", Body=b"x" * 100)
    assert s3.get_object(Bucket=b, Key=f"{base}/manifest.json")["Body"].read() == b"x" * 100
    with pytest.raises(s3.exceptions.ClientError):
        s3.head_object(Bucket=b, Key=f"{base}/r00005-0a1b2c3d.manifest.json")  # not there: a 404
    data = f"{base}/r00005-p0000-0a1b2c3d.safetensors"
    up = s3.create_multipart_upload(Bucket=b, Key=data)["UploadId"]
    parts = [{"PartNumber": i, "ETag": s3.upload_part(Bucket=b, Key=data, UploadId=up, PartNumber=i,
                                                      Body=body)["ETag"]}
             for i, body in ((1, b"y" * (5 << 20)), (2, b"z" * 1000))]
    s3.complete_multipart_upload(Bucket=b, Key=data, UploadId=up, MultipartUpload={"Parts": parts})
    listed = s3.list_objects_v2(Bucket=b, Prefix=f"{base}/", Delimiter="/")
    assert len(listed["Contents"]) == 2
    s3.delete_object(Bucket=b, Key=f"{base}/manifest.json")
    got = server.app.counter.take()
    kinds = {k: t.n for k, t in got.by_kind().items()}
    assert kinds == {"PUT step-manifest": 1, "GET step-manifest": 1, "HEAD rank-manifest": 1,
                     "POST mpu-create data": 1, "PUT mpu-part data": 2, "POST mpu-complete data": 1,
                     "GET list": 1, "DELETE step-manifest": 1}, got.trace
    # the trace names each request: rank, method, its path and query, status
    assert (5, "PUT", f"/{b}/{base}/manifest.json", 200) in got.trace, got.trace
    assert (5, "HEAD", f"/{b}/{base}/r00005-0a1b2c3d.manifest.json", 404) in got.trace, got.trace
    tallies = got.by_kind()
    assert tallies["PUT step-manifest"].bytes_in == 100
    assert tallies["GET step-manifest"].bytes_out == 100
    assert tallies["PUT mpu-part data"].bytes_in == (5 << 20) + 1000
    assert tallies["HEAD rank-manifest"].errors == 1 and tallies["GET list"].errors == 0
    assert got.by_rank() == {5: 9}
    assert got.total(rank=5, kinds=["PUT mpu-part data", "GET list"]) == 3
    assert server.app.counter.take().total() == 0  # taken: the next phase starts from zero
    # a request tagged with a phase, as the ranks tag theirs, is counted under that phase only
    tagged = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1",
                          config=Config(user_agent_extra="tierckpt-rank/3 tierckpt-phase/restart-wiped"))
    tagged.head_bucket(Bucket=b)
    assert server.app.counter.take().total() == 0
    assert server.app.counter.take("restart-wiped").by_rank() == {3: 1}


@pytest.mark.parametrize("world", [1, 2, 8])
def test_save_and_restart_requests_are_exact_where_deterministic(runs: dict[int, Any], world: int) -> None:
    save, restart, wiped = (runs[world][p] for p in ("save", "restart", "restart-wiped"))
    assert save["untagged"] == restart["untagged"] == wiped["untagged"] == 0
    # rank 0 commits each step with one manifest.json; each rank puts one data file (2 MiB < a part) and one rank
    # manifest per save, never a multipart upload, and nothing is deleted (keep_remote=3 >= STEPS)
    assert n(save, "PUT step-manifest") == STEPS
    assert n(save, "PUT data") == n(save, "PUT rank-manifest") == world * STEPS
    assert not [k for k in save["by_kind"] if "mpu" in k or k.startswith("DELETE")], save["by_kind"]
    assert save["rank0"] > 0 and all(int(r) in range(world) for r in save["by_rank"])
    # a restart with every local folder intact reads no data and writes nothing
    assert n(restart, "GET data") == 0
    assert not [k for k in restart["by_kind"] if k.startswith(("PUT", "POST", "DELETE"))], restart["by_kind"]
    # with the folders wiped, every rank reads its own data file (one ranged GET: smaller than a read chunk) and
    # its rank manifest from the remote, and writes nothing
    assert n(wiped, "GET data") == world
    assert n(wiped, "GET rank-manifest") == world
    # and manifest.json, which lists every rank, once in all: rank 0 reads it and hands each rank its own entry
    assert n(wiped, "GET step-manifest") == 1
    assert not [k for k in wiped["by_kind"] if k.startswith(("PUT", "POST", "DELETE"))], wiped["by_kind"]


def test_two_ranks_cost_each_rank_about_what_one_rank_costs(runs: dict[int, Any]) -> None:
    """O(1) requests per rank per save and per restart: at W=2 no rank sends much more than the single rank did,
    and the rank that is not 0 sends fewer than rank 0 (it lists nothing and commits nothing)."""
    report = {w: {p: (s["per_rank"], s["rank0"], s["max_other_rank"]) for p, s in runs[w].items()}
              for w in (1, 2)}
    print("per rank, rank 0, busiest other rank:", report)
    for phase in ("save", "restart", "restart-wiped"):
        one, two = runs[1][phase], runs[2][phase]
        assert two["per_rank"] <= one["per_rank"] + 2, (phase, report)
        assert two["rank0"] <= one["rank0"] + 3, (phase, report)
        assert two["max_other_rank"] <= one["rank0"], (phase, report)
        assert two["max_other_rank"] < two["rank0"], (phase, report)


def test_eight_ranks_cost_each_rank_what_two_ranks_cost(runs: dict[int, Any]) -> None:
    """The growth law at the largest world this machine runs in the suite: per-rank requests per save and per
    restart at 8 ranks stay within a constant of those at 2 (an O(W) term per rank would add 6 or more), and so do
    rank 0's (its job-wide work is one listing page, one GET and one PUT per save, whatever W)."""
    report = {w: {p: (s["per_rank"], s["rank0"], s["max_other_rank"]) for p, s in runs[w].items()}
              for w in (2, 8)}
    print("per rank, rank 0, busiest other rank:", report)
    for phase in ("save", "restart", "restart-wiped"):
        two, eight = runs[2][phase], runs[8][phase]
        assert eight["per_rank"] <= two["per_rank"] + 2, (phase, report)
        assert eight["rank0"] <= two["rank0"] + 2, (phase, report)
        assert eight["max_other_rank"] <= two["max_other_rank"] + 1, (phase, report)


@pytest.mark.parametrize("world", [2, 8])
def test_no_rank_but_rank_0_reads_the_step_manifest_during_saves(launches: dict[int, Any], world: int) -> None:
    """Commits go through the c10d store: while steps are being committed no other rank GETs (or HEADs) a step's
    manifest.json, not even once, and none lists the remote; rank 0 asks for it a bounded number of times per step
    (committed already? one GET; the commit's existence checks, HEADs), whatever W."""
    counts = launches[world]["save"].counts
    step_manifest = ["GET step-manifest", "HEAD step-manifest"]
    for rank in range(1, world):
        assert counts.total(rank=rank, kinds=step_manifest) == 0, (rank, counts.trace)
        assert counts.total(rank=rank, kinds=["GET list"]) == 0, (rank, counts.trace)
    assert 0 < counts.total(rank=0, kinds=step_manifest) <= 3 * STEPS, counts.trace


def test_a_rank_that_restores_the_wrong_step_fails_the_launch(server: Any, tmp_path: Path) -> None:
    """The ranks' check is real: a job told that it saved one step more than it did restores the last step it did
    save, and the launch fails naming the mismatch."""
    folder = tmp_path / "job"
    folder.mkdir()
    remote = f"s3://{server.bucket}/mismatch"
    bench.launch(server, 1, folder, remote, phases=["save"], steps=1, numel=1024, timeout_s=120)
    with pytest.raises(RuntimeError, match="restored step 1, expected 2"):
        bench.launch(server, 1, folder, remote, phases=["restart"], steps=2, numel=1024, timeout_s=120)


def test_growth_fit_recovers_known_laws() -> None:
    fit = report.fit_growth
    const = fit({1: 5, 2: 5, 4: 5, 8: 5})
    assert const["exponent"] == pytest.approx(0.0) and const["model"] == "a + b*W"
    assert const["linear"]["8192"] == pytest.approx(5.0)
    lin = fit({1: 3, 2: 6, 4: 12, 8: 24})
    assert lin["exponent"] == pytest.approx(1.0) and lin["exponent_tail"] == pytest.approx(1.0)
    assert lin["power"]["1024"] == pytest.approx(3 * 1024)
    assert lin["b"] == pytest.approx(3.0) and lin["a"] == pytest.approx(0.0, abs=1e-9)
    # a constant plus a linear term: the exponent climbs towards 1, the model is exact; W = 1 (the single-process
    # protocol) is left out of the fit once two larger W are there
    mixed = fit({1: 100, 2: 6, 4: 10, 8: 18, 16: 34})
    assert mixed["fitted_over"] == [2, 4, 8, 16]
    assert (mixed["model"], mixed["a"], mixed["b"]) == ("a + b*W", pytest.approx(2.0), pytest.approx(2.0))
    assert 0.5 < mixed["exponent"] < mixed["exponent_tail"] < 1.0
    mean = fit({2: 4, 4: 2, 8: 1})  # a constant total over W ranks
    assert (mean["model"], mean["a"], mean["b"]) == ("a/W + b", pytest.approx(8.0), pytest.approx(0.0, abs=1e-9))
    skipped = fit({1: 0, 2: 4, 4: 16})
    assert skipped["exponent"] == pytest.approx(2.0)
    assert fit({1: None, 2: 7})["exponent"] is None


def test_prefixes_are_the_step_folder_or_the_listing() -> None:
    assert counting.key_prefix("run/step-0000000003/r00001-p0000-0a1b2c3d.safetensors") == "run/step-0000000003/"
    assert counting.key_prefix("run/step-0000000003") == "run/step-0000000003/"  # the folder's own name
    assert counting.key_prefix("a/b/step-0000000012/manifest.json") == "a/b/step-0000000012/"
    assert counting.key_prefix("run/other.json") == "run/"
    assert counting.key_prefix("top.json") == ""
    assert counting.list_prefix("run/") == counting.list_prefix("run") == "run/"
    step = "run/step-0000000003/"
    assert counting.list_prefix(step) == counting.list_prefix(step.rstrip("/")) == step
    assert counting.list_prefix("") == ""
    assert counting.root_prefix("s3://bucket/w00008-abc") == "w00008-abc/"
    assert counting.in_step_folder("run/step-0000000003/") and not counting.in_step_folder("run/")


def test_the_server_counts_each_key_and_prefix(server: Any) -> None:
    """A known sequence of requests is counted exactly by object key (with its kind) and by prefix, reads and writes
    apart: a listing counts against its prefix, a multi-object delete against each key it names and each of their
    prefixes once."""
    boto3 = pytest.importorskip("boto3")
    opts = server.storage_options
    s3 = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=opts["key"],
                      aws_secret_access_key=opts["secret"], region_name="us-east-1")
    b, step = server.bucket, "keys/step-0000000004"
    manifest, data, loose = f"{step}/manifest.json", f"{step}/r00000-p0000-0a1b2c3d.safetensors", "keys/loose.json"
    server.app.counter.take()
    for key in (manifest, data, loose):
        s3.put_object(Bucket=b, Key=key, Body=b"x" * 10)
    s3.get_object(Bucket=b, Key=manifest)["Body"].read()
    s3.head_object(Bucket=b, Key=manifest)
    s3.list_objects_v2(Bucket=b, Prefix="keys/", Delimiter="/")
    s3.list_objects_v2(Bucket=b, Prefix=f"{step}/")
    s3.delete_objects(Bucket=b, Delete={"Objects": [{"Key": data}, {"Key": loose}]})
    got = server.app.counter.take()
    keys = {k: (t.kind, t.n, t.reads, t.writes) for k, t in got.keys.items()}
    assert keys == {manifest: ("step-manifest", 3, 2, 1), data: ("data", 2, 0, 2),
                    loose: ("other-object", 2, 0, 2)}, got.trace
    prefixes = {k: (t.n, t.reads, t.writes) for k, t in got.prefixes.items()}
    # step folder: 2 PUTs, GET, HEAD, its listing, the delete; keys/: 1 PUT, the root listing, the delete
    assert prefixes == {f"{step}/": (6, 3, 3), "keys/": (3, 1, 2)}, got.trace
    assert got.total() == 8


def test_local_calls_are_counted_exactly_on_a_known_sequence(tmp_path: Path) -> None:
    """The rank's counter of local-tier calls counts a known sequence of calls exactly, by function, failed calls
    and bytes read included, nothing outside its folder, and the audit events of the same calls agree; afterwards
    the os functions are the originals again."""
    root, out = tmp_path / "node00000", tmp_path / "elsewhere"
    out.mkdir()
    originals = (os.stat, os.open, os.fsync, open)
    ops = rank_script.LocalOps(root)
    with ops.counting():
        os.mkdir(root)
        os.mkdir(root / "d")
        fd = os.open(root / "d" / "a", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"hello")
        os.fsync(fd)
        os.fdatasync(fd)
        os.close(fd)
        with open(root / "d" / "b", "wb") as f:
            f.write(b"12345678")
        with open(root / "d" / "b", "rb") as f:
            assert f.read() == b"12345678"
            assert os.fstat(f.fileno()).st_size == 8
        fd = os.open(root / "d" / "a", os.O_RDONLY)
        assert os.pread(fd, 100, 0) == b"hello"
        os.fstat(fd)
        os.close(fd)
        os.rename(root / "d" / "a", root / "d" / "c")
        os.replace(root / "d" / "c", root / "e")
        os.stat(root / "e")
        os.lstat(root / "e")
        assert not os.path.exists(root / "missing")  # os.stat, failing
        assert os.path.isdir(root / "d")  # os.stat
        assert os.listdir(root / "d") == ["b"]
        with os.scandir(root) as it:
            assert sorted(e.name for e in it) == ["d", "e"]
        os.unlink(root / "e")
        os.remove(root / "d" / "b")
        os.rmdir(root / "d")
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        # the same kinds of call outside the folder: not counted
        os.mkdir(out / "x")
        with open(out / "f", "wb") as f:
            f.write(b"abc")
            os.fsync(f.fileno())
        with open(out / "f", "rb") as f:
            f.read()
        os.stat(out / "f")
        os.listdir(out)
        os.rename(out / "f", out / "g")
        os.unlink(out / "g")
        os.rmdir(out / "x")
    assert (os.stat, os.open, os.fsync, open) == originals
    got = ops.snapshot()
    assert got["calls"] == {"open": 2, "os.fdatasync": 1, "os.fstat": 2, "os.fsync": 2, "os.listdir": 1,
                            "os.lstat": 1, "os.mkdir": 2, "os.open": 3, "os.remove": 1, "os.rename": 1,
                            "os.replace": 1, "os.rmdir": 1, "os.scandir": 1, "os.stat": 3, "os.unlink": 1}, got
    assert got["failed"] == {"os.stat": 1}
    assert got["categories"] == {"open": 5, "fsync": 3, "rename": 2, "mkdir": 2, "unlink": 3, "listdir": 2,
                                 "stat": 6}
    assert got["creates"] == 2 and got["read_bytes"] == 8 + 5
    assert got["audit"] == got["audit_wrapped"] == {"open": 5, "rename": 2, "mkdir": 2, "unlink": 3, "listdir": 2}


def test_local_calls_of_shutil_rmtree_are_one_per_file_and_folder(tmp_path: Path) -> None:
    """``shutil.rmtree`` reaches the wrappers through descriptor-relative calls: removing a tree of F files in D
    folders counts F unlinks and D rmdirs, whatever route shutil takes."""
    root = tmp_path / "node00001"
    (root / "t" / "u" / "v").mkdir(parents=True)
    for i, folder in enumerate(("t", "t/u", "t/u", "t/u/v")):
        (root / folder / f"f{i}").write_bytes(b"x")
    files = sum(len(names) for _, _, names in os.walk(root / "t"))
    folders = 1 + sum(len(dirs) for _, dirs, _ in os.walk(root / "t"))
    ops = rank_script.LocalOps(root)
    with ops.counting():
        shutil.rmtree(root / "t")
    got = ops.snapshot()
    assert (files, folders) == (4, 3)
    assert got["calls"].get("os.unlink", 0) + got["calls"].get("os.remove", 0) == files, got
    assert got["calls"]["os.rmdir"] == folders, got
    assert not (root / "t").exists()


@pytest.mark.parametrize("world", [1, 2, 8])
def test_the_ranks_local_calls_are_all_seen(runs: dict[int, Any], world: int) -> None:
    """Every rank of every phase counted its local-tier calls, and for each category that CPython audits the
    wrapped calls equal the audit events: no call of tierckpt's on its local folder went around the wrappers. A
    save opens, fsyncs and renames there; a restart with the local folders intact creates, renames, removes and
    fsyncs nothing there."""
    for phase, s in runs[world].items():
        ops = s["local_ops"]
        assert {c: a["wrapped"] for c, a in ops["audit"].items()} == {c: a["audited"] for c, a in
                                                                       ops["audit"].items()}, (phase, ops["audit"])
    save, restart = runs[world]["save"]["local_ops"]["categories"], runs[world]["restart"]["local_ops"]
    for cat in ("open", "fsync", "rename", "mkdir"):
        assert save[cat]["per_rank"] > 0 and save[cat]["rank0"] > 0, (cat, save)
    for cat in ("fsync", "rename", "unlink"):
        assert restart["categories"][cat]["per_rank"] == 0, (cat, restart)
    assert restart["by_call"]["os.open"] + restart["by_call"]["open"] > 0
    # the only open that may create at a restart is the folder's lock file, on every rank
    assert restart["creates"] == 1, restart


def test_eight_ranks_make_the_local_calls_two_ranks_make(runs: dict[int, Any]) -> None:
    """O(1) local-tier calls per rank per save and per restart: at 8 ranks the mean, rank 0's and the busiest other
    rank's calls stay within a constant of those at 2 ranks, in all and in each category (an O(W) term per rank
    would add 6 or more)."""
    report = {w: {p: (s["local_ops_per_rank"], s["local_ops_rank0"], s["local_ops_max_other_rank"])
                  for p, s in runs[w].items()} for w in (2, 8)}
    print("local calls per rank, rank 0, busiest other rank:", report)
    for phase in ("save", "restart", "restart-wiped"):
        two, eight = runs[2][phase], runs[8][phase]
        for field in ("local_ops_per_rank", "local_ops_rank0", "local_ops_max_other_rank"):
            assert eight[field] <= two[field] + 3, (phase, field, report)
        for cat, spread in eight["local_ops"]["categories"].items():
            for field, v in spread.items():
                assert v <= two["local_ops"]["categories"][cat][field] + 1.5, (phase, cat, field, report)


def test_the_busiest_key_costs_the_same_per_save_whatever_w(runs: dict[int, Any]) -> None:
    """The busiest single object key is rank 0's step manifest.json, with the same requests per save at 8 ranks as
    at 2, and so is the root listing's prefix; the busiest prefix of a save is its step folder, which every rank
    writes to: a PUT of its data file and of its rank manifest per rank, and no request asking for a size back
    (rank 0's listing confirms them), plus rank 0's few requests for the commit."""
    for phase in ("save", "restart", "restart-wiped"):
        two, eight = runs[2][phase], runs[8][phase]
        assert eight["busiest_key_requests"] == two["busiest_key_requests"], (phase, two["busiest_key"],
                                                                              eight["busiest_key"])
        assert eight["root_prefix_requests"] == two["root_prefix_requests"], phase
    for world in (2, 8):
        save = runs[world]["save"]
        assert save["busiest_key"]["kind"] == "step-manifest", save["busiest_key"]
        assert counting.in_step_folder(save["busiest_prefix"]["name"]), save["busiest_prefix"]
        assert 2 * world <= save["busiest_prefix_requests"] <= 2 * world + 8, save["busiest_prefix"]
        assert save["busiest_prefix"]["writes"] >= 2 * world
        assert save["window_s"] > 0
        assert save["busiest_prefix_rate_per_s"] == pytest.approx(save["busiest_prefix_requests"] / save["window_s"])


@pytest.mark.parametrize("world", [1, 2, 8])
def test_each_rank_reads_its_state_once_at_a_restart(runs: dict[int, Any], world: int) -> None:
    """The bytes each rank reads at a restart: with the local folders intact, its data from the local tier and
    none from S3; with them wiped, its data from S3 (one data file of the state's bytes plus a header) and nothing
    from the local tier; at least the state's bytes and less than one more read chunk of them either way."""
    state = 4 * 64 * 1024
    restart, wiped = runs[world]["restart"], runs[world]["restart-wiped"]
    assert restart["read_bytes_by_what"]["data"] == 0
    assert wiped["local_read_bytes_per_rank"] == wiped["local_read_bytes_rank0"] == 0
    for spread in ((restart["local_read_bytes_per_rank"], restart["local_read_bytes_rank0"],
                    restart["local_read_bytes_max_other_rank"]),
                   (wiped["read_bytes_per_rank"], wiped["read_bytes_rank0"], wiped["read_bytes_max_other_rank"])):
        for v in spread:
            assert v is None or state <= v < state + 64 * 1024, (world, spread)
    # one data file a rank: the state's bytes after a header that tierckpt pads to 4 KiB
    assert wiped["read_bytes_by_what"]["data"] == state + 4096, wiped["read_bytes_by_what"]


def test_busiest_prefix_at_scale_spreads_the_fitted_requests_over_the_measured_window() -> None:
    """The extrapolated busiest prefix: its fitted requests per save at 1,024 and 8,192 ranks over the window of
    the largest W measured."""
    summary = {w: {"save": {"busiest_prefix_requests": 3 + 4 * w, "busiest_prefix_reads": 1 + w,
                            "busiest_prefix_writes": 2 + 3 * w, "window_s": 0.5 * w}} for w in (2, 4, 8)}
    rows = report.busiest_prefix_at_scale(summary)
    assert [(r["phase"], r["world"], r["at_w"], r["window_s"]) for r in rows] == [("save", 1024, 8, 4.0),
                                                                                   ("save", 8192, 8, 4.0)]
    assert rows[0]["requests"] == pytest.approx(3 + 4 * 1024)
    assert rows[1]["writes_per_s"] == pytest.approx((2 + 3 * 8192) / 4.0)
    assert rows[0]["reads_per_s"] == pytest.approx((1 + 1024) / 4.0)
    text = "\n".join(report.render_scale(rows))
    assert "3,500 writes" in text and "4099" in text
