"""benchmarks/restart.py end to end on a tiny state: real child processes restore and save, the table says so."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._support.procs import run_python, start_python

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restart() -> Iterator[Any]:
    """benchmarks/restart.py, its children (a restore and a first save each) forked from the suite's torch server
    rather than started as fresh interpreters: the same processes, without the import the benchmark times."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import harness
        import restart
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def forked(argv: list[str], log: Path, cwd: Path | None, env: dict[str, str]) -> Any:
        log.write_text("")
        return start_python([str(a) for a in argv], env=env, cwd=cwd, stdout=log)

    harness.start_process = forked
    try:
        yield restart
    finally:
        harness.start_process = harness.popen


def test_restart_benchmark_runs_both_ways_in_child_processes(tmp_path: Path, restart: Any) -> None:
    out = tmp_path / "restart.json"
    assert restart.main(["--size-gib", "0.004", "--rounds", "1", "--dir", str(tmp_path / "scratch"),
                         "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "restart"
    for way in ("default", "in_place"):
        medians = report["summary"][way]["medians"]
        # each child checked its restored step and a tensor's sum before it reported (it exits non-zero otherwise)
        assert medians["restore"] > 0 and medians["stall"] > 0 and medians["read"] > 0
        assert medians["durable"] >= medians["stall"]
        assert medians["resume"] == medians["restore"] + medians["stall"]
        assert re.search(rf"^\| {way} +\|", report["markdown"], re.M), report["markdown"]


def test_a_child_that_restores_the_wrong_bytes_fails_the_run(tmp_path: Path, restart: Any) -> None:
    """The child's check is real: told to expect another sum, it exits non-zero and names what it found."""
    from harness import gpt_state

    import tierckpt

    folder = tmp_path / "ck"
    state = gpt_state(int(0.004 * (1 << 30)))
    with tierckpt.CheckpointManager(folder) as mgr:
        mgr.save(1, state)
    with pytest.raises(RuntimeError, match="expected step 1"):
        restart.run_child("default", folder, 0.004, 1, restart._probe_sum(state) + 1.0)


def test_restart_simulator_runs_every_scenario_and_leaves_no_key(tmp_path: Path) -> None:
    """benchmarks/restart_sim.py at 24 simulated ranks (rank 0 alone in a process, the others 12 to a process)
    against a real TCPStore: each scenario makes its agreements through the library's code, a rank's bytes are the
    same with 1 and 20 remote-only steps, and no agreement leaves a key."""
    out = tmp_path / "sim.json"
    proc = run_python([str(ROOT / "benchmarks" / "restart_sim.py"), "--worlds", "24", "--remote-only", "1", "20",
                       "--ranks-per-process", "12", "--timeout-s", "30", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["results"]
    assert [(r["world"], r["remote_only_steps"], r["processes"]) for r in runs] == [(24, 1, 3), (24, 20, 3)]
    agreements = {"save": 3, "restart_intact": 5, "restart_one_node_wiped": 6, "restart_all_wiped": 6}
    for scenario, n in agreements.items():
        got = [r["scenarios"][scenario] for r in runs]
        assert [len(s["agreements"]) for s in got] == [n, n] and [s["keys_left"] for s in got] == [0, 0], got
        per_rank = [sum(a["rank_bytes_median"] for a in s["agreements"]) for s in got]
        assert abs(per_rank[0] - per_rank[1]) <= 48, (scenario, per_rank)  # a digit more in a step's number
        # the busiest rank (a node's leader, one with an answer of its own): the same, but whichever rank reads an
        # answer last also removes its two keys (under 64 bytes), a role that timing decides
        busiest = [sum(a["rank_bytes_max"] for a in s["agreements"]) for s in got]
        assert abs(busiest[0] - busiest[1]) <= 48 + 64 * n, (scenario, busiest)
        assert all(s["cpu_s"]["store"] > 0 and s["cpu_s"]["ranks"] > 0 for s in got), got
