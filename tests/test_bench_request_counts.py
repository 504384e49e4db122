"""benchmarks/request_counts.py: the counting S3 server counts what a client really sends, and a 1- and 2-rank job's
requests per save and per restart come out as the protocol says (exact where it is deterministic)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("moto")
pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

pytestmark = [pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2


def _load() -> ModuleType:
    """benchmarks/request_counts.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_request_counts", ROOT / "benchmarks" / "request_counts.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_request_counts"] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load()


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with bench.counting_s3_server("bench-requests-test", trace=True) as s3:
        yield s3


@pytest.fixture(scope="module")
def launches(server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every phase for 1, 2 and 8 ranks (each launch checks the restored bytes, or raises)."""
    scratch = tmp_path_factory.mktemp("requests")
    return {world: bench.run_world(server, world, scratch, steps=STEPS, numel=64 * 1024, timeout_s=180)
            for world in (1, 2, 8)}


@pytest.fixture(scope="module")
def runs(launches: dict[int, dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """The summary of every phase for each world size."""
    return {w: {p: bench.summarize_launch(launch, STEPS) for p, launch in by_phase.items()}
            for w, by_phase in launches.items()}


def n(summary: dict[str, Any], label: str) -> int:
    """How many requests of "METHOD kind" a phase's summary counted."""
    return summary["by_kind"].get(label, {"n": 0})["n"]


def test_classify_names_the_operations() -> None:
    c = bench.classify
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

    opts = server.storage_options()
    s3 = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=opts["key"],
                      aws_secret_access_key=opts["secret"], region_name="us-east-1",
                      config=Config(user_agent_extra="tierckpt-rank/5"))
    b, base = server.bucket, "known/step-0000000001"
    server.counter.take()
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
    got = server.counter.take()
    kinds = {k: t.n for k, t in got.by_kind().items()}
    assert kinds == {"PUT step-manifest": 1, "GET step-manifest": 1, "HEAD rank-manifest": 1,
                     "POST mpu-create data": 1, "PUT mpu-part data": 2, "POST mpu-complete data": 1,
                     "GET list": 1, "DELETE step-manifest": 1}, got.trace
    tallies = got.by_kind()
    assert tallies["PUT step-manifest"].bytes_in == 100
    assert tallies["GET step-manifest"].bytes_out == 100
    assert tallies["PUT mpu-part data"].bytes_in == (5 << 20) + 1000
    assert tallies["HEAD rank-manifest"].errors == 1 and tallies["GET list"].errors == 0
    assert got.by_rank() == {5: 9}
    assert got.total(rank=5, kinds=["PUT mpu-part data", "GET list"]) == 3
    assert server.counter.take().total() == 0  # taken: the next phase starts from zero


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
    bench.launch_phase(server, "save", 1, folder, remote, steps=1, numel=1024, timeout_s=120)
    with pytest.raises(RuntimeError, match="restored step 1, expected 2"):
        bench.launch_phase(server, "restart", 1, folder, remote, steps=2, numel=1024, timeout_s=120)


def test_growth_fit_recovers_known_laws() -> None:
    fit = bench.fit_growth
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
