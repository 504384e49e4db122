"""benchmarks/bench.py and the scripts that run a part of it (limits.py, peers.py, save_restore.py, scaling.py):
bench.py's suite is every part's cases in one order, and a part runs alone with bench.py's options and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

bench = pytest.importorskip("bench")


def test_the_suite_is_the_limits_then_the_peers_then_tierckpt_in_table_order() -> None:
    import harness

    stager = ["dcp.async_save+DefaultStager"] if harness.default_stager_available() else []
    cases = bench.build_cases(tierckpt=True, remote=True, s3=True, overlap=True)
    assert list(cases) == ["memcpy", "hash", "raw", "torch.save", "safetensors", "dcp.save(t1)", "dcp.save(t2)",
                           "dcp.async_save", *stager, "tierckpt", "tierckpt copy-first", "tierckpt+posix",
                           "tierckpt+s3"]  # fmt: skip
    some = bench.build_cases(tierckpt=False, remote=False, s3=False, peers=["dcp.async_save", "torch.save", "x"],
                             limits=False)
    assert list(some) == ["dcp.async_save", "torch.save"]  # as asked, unknown names left out


def test_a_part_runs_alone_with_its_own_command_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "limits.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: benchmarks/limits.py") and "--size-gib" in proc.stdout
    assert "--scaling" not in proc.stdout and "hardware's limits" in proc.stdout


def test_the_limits_alone_report_the_limits_and_how_to_reproduce_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import harness
    import limits

    monkeypatch.setattr(harness, "disk_idle", lambda *a, **k: 0.0)  # a busy shared disk need not settle here
    monkeypatch.setattr(harness, "drop_caches", lambda: False)
    out = tmp_path / "limits.json"
    argv = ["--size-gib", "0.004", "--repeats", "1", "--quiet-wait", "0", "--dir", str(tmp_path / "scratch"),
            "--out", str(out)]
    assert bench.main(argv, doc=limits.__doc__, script=limits.__file__, parts=("limits",)) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "bench" and set(report["medians"]) == {"memcpy", "hash", "raw"}
    assert report["derived"]["limits"]["write"] > 0 and report["derived"]["limits"]["read_cold"] > 0
    assert report["derived"]["systems"] == {} and "#### Systems" not in report["markdown"]
    assert report["medians"]["raw"]["read_ok"] is True  # the raw read brought the state back
    printed = capsys.readouterr().out
    assert "#### Limits" in printed
    assert printed.rstrip().splitlines()[-1].startswith("reproduce: ")
    assert "benchmarks/limits.py --size-gib 0.004" in report["command"] and report["args"]["scaling"] is False
    assert not list((tmp_path / "scratch").iterdir())  # the limits' files are gone


def test_scaling_py_is_bench_py_scaling() -> None:
    scaling = bench.parse_args(["--sizes", "0.5"], script=str(ROOT / "benchmarks" / "scaling.py"), scaling=True)
    flag = bench.parse_args(["--scaling", "--sizes", "0.5"])
    assert vars(scaling).keys() == vars(flag).keys()
    assert {k: v for k, v in vars(scaling).items() if k not in ("out", "_command")} == {
        k: v for k, v in vars(flag).items() if k not in ("out", "_command")}
    with pytest.raises(SystemExit):  # a part has no sweeps
        bench.parse_args(["--scaling"], sweeps=False)
