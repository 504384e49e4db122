"""Kill anywhere: a saver SIGKILLed at every named fault point (``TIERCKPT_FAULT``) and at seeded random
times, with and without a POSIX remote tier. After each kill a fresh manager must: clean the leftovers (no ``.tmp-``
or ``.trash-`` folders in either tier), restore the newest committed step with exact contents (nothing a finished
``wait()`` made durable is lost), pass ``tierckpt verify`` (exit 0) on every tier, and save the next step.

The children are forked from a server that imported torch once (tests/reliability/_rel_kill_saver.py), so a kill
costs ~0.3 s.
Normal suite: every wired point with and without a remote, plus seeded random kills (a few dozen in all).
``TIERCKPT_LONG=1``: every point at several hit counts, and hundreds of random kills.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests._support.helpers import TESTS_DIR, assert_tree_equal, cli_output, run_cli, subprocess_env
from tests._support.procs import start_python
from tests.reliability._rel_kill_saver import MANAGER_KW, rel_empty, rel_state
from tierckpt import CheckpointManager, cli, faults
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_root

LONG = os.environ.get("TIERCKPT_LONG") == "1"
pytestmark = pytest.mark.timeout(1800 if LONG else 240)

SCRIPT = Path(__file__).resolve().parent / "_rel_kill_saver.py"
STEPS = 4
SOURCE = Path(__file__).resolve().parents[2] / "tierckpt"

#: Points reached without a remote tier, and the extra ones only an upload reaches.
LOCAL_POINTS = ["staging", "mid-file", "before-fsync", "after-fsync", "before-manifest", "after-manifest",
                "before-rename", "after-rename", "retention"]
REMOTE_ONLY = ["mid-upload", "before-remote-manifest"]
#: rank 0 of a multi-rank job only: killed there by tests/distributed/test_multi_process.py
MULTI_RANK_ONLY = ["remote-commit"]
#: reached by rollback_to only: killed there by tests/reliability/test_rollback_uploads.py
ROLLBACK_ONLY = ["rollback"]
#: hit counts guaranteed to be reached within STEPS saves (retention first runs at step 3: keep_local=2)
MAX_HIT = {"staging": STEPS, "mid-file": STEPS, "before-fsync": 4 * STEPS, "after-fsync": 4 * STEPS,
           "before-manifest": STEPS, "after-manifest": STEPS, "before-rename": STEPS, "after-rename": STEPS,
           "retention": STEPS - 2, "mid-upload": STEPS, "before-remote-manifest": STEPS}

COUNTS: Counter[str] = Counter()


def _wired_points() -> set[str]:
    """Points that the library really calls (``faults.point("...")`` in its source)."""
    found: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        found.update(re.findall(r"faults\.point\(\"([a-z-]+)\"\)", path.read_text()))
    return found


WIRED = _wired_points()


class Server:
    """The saver server (forked from the suite's torch server): requests through a FIFO on its stdin, answers
    from its stdout, its errors in ``log``."""

    def __init__(self, log: Path) -> None:
        requests = log.with_name("requests")
        os.mkfifo(requests)
        answers = log.with_name("answers")
        answers.write_text("")
        self.proc = start_python([str(SCRIPT)], env=subprocess_env(), cwd=TESTS_DIR, stdin=requests, stdout=answers,
                                 stderr=log)
        # read and write: opening it does not wait for the server, and the server sees the end when it is closed
        self.stdin = open(os.open(requests, os.O_RDWR), "w")  # noqa: SIM115 - closed in close()
        line = self.proc.readline(timeout=120)
        assert line.strip() == "READY", f"kill server did not start: {line!r} {log.read_text()}"
        self.log = log

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        self.stdin.write(json.dumps(req) + "\n")
        self.stdin.flush()
        line = self.proc.readline(timeout=600)
        assert line.endswith("\n"), f"kill server died or hung: {self.log.read_text()[-3000:]}"
        return json.loads(line)

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("killsrv") / "server.log")
    yield s
    s.close()
    print(f"\nkill-anywhere counts: {dict(sorted(COUNTS.items()))}")


def _leftovers(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp-", ".trash-")))


def _orphan_step_folders(root: Path) -> list[str]:
    """Step folders without manifest.json (not checkpoints; e.g. retention killed after removing the manifest)."""
    if not root.is_dir():
        return []
    return sorted(n for n in os.listdir(root) if n.startswith("step-") and not (root / n / "manifest.json").exists())


def _progress(path: Path) -> tuple[int, int]:
    started = done = 0
    if path.exists():
        for line in path.read_text().split("\n"):
            if line.startswith("start "):
                started = max(started, int(line.split()[1]))
            elif line.startswith("done "):
                done = max(done, int(line.split()[1]))
    return started, done


def _verify_cli(root: Path) -> tuple[int, str]:
    """The real CLI entry point, in process (the subprocess form is exercised once in test_verify_subprocess)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["verify", str(root)])
    return rc, out.getvalue()


def check_after_kill(root: Path, remote: Path | None, seed: int, progress: Path, what: str) -> None:
    started, done = _progress(progress)
    before = _leftovers(root)
    if before:
        COUNTS["local leftovers cleaned"] += len(before)
    with CheckpointManager(root, remote=str(remote) if remote else None, keep_remote=2 if remote else None,
                           **MANAGER_KW) as mgr:
        # every leftover of the killed process is gone; the only one allowed is a `.trash-` folder of this
        # manager's own retention, running on its upload thread (a step it found replicated), removed by the end
        stale = [n for n in _leftovers(root) if n in before or not n.startswith(".trash-")]
        assert stale == [], f"{what}: local leftovers after start-up: {stale}"
        # the remote is shared and not cleaned at start-up (docs/format.md section 1): `tierckpt prune --leftovers`
        # does it, below
        local_steps = set(list_root(mgr.local).steps)
        remote_steps = set(list_root(mgr.remote).steps) if remote else set()
        committed = local_steps | remote_steps
        newest = max(committed, default=0)
        assert newest >= done, f"{what}: step {done} was durable (wait() returned) but newest committed is {newest}"
        assert newest <= started, f"{what}: step {newest} committed but only {started} was started"
        state = rel_empty()
        got = mgr.restore(state)
        if not committed:
            assert got is None, f"{what}: restore returned {got} with nothing committed"
        else:
            assert got == newest, f"{what}: restore gave step {got}, newest committed is {newest} ({committed})"
            assert_tree_equal(state, rel_state(got, seed), f"{what}: step {got}")
            COUNTS["restored exact"] += 1
        mgr.wait()  # re-queued uploads of steps committed only locally finish
        remote_steps = set(list_root(mgr.remote).steps) if remote else set()
        if remote and local_steps:  # the newest local step was re-uploaded (older ones may be retired remotely)
            assert max(local_steps) in remote_steps, f"{what}: {local_steps} not re-uploaded: {remote_steps}"
        if remote_steps:
            rstate = rel_empty()
            rgot = mgr.restore(rstate, source="remote")
            assert rgot == max(remote_steps), f"{what}: remote restore gave {rgot}, remote holds {remote_steps}"
            assert_tree_equal(rstate, rel_state(rgot, seed), f"{what}: remote step {rgot}")
        for tier_root, steps in ((root, local_steps), (remote, remote_steps)):
            if tier_root is not None and steps:
                rc, out = _verify_cli(tier_root)
                assert rc == 0, f"{what}: tierckpt verify {tier_root} exit {rc}:\n{out}"
                COUNTS["verify runs"] += 1
        nxt = started + 1
        mgr.save(nxt, rel_state(nxt, seed))
        mgr.wait()
        state = rel_empty()
        assert mgr.restore(state) == nxt, f"{what}: the next save ({nxt}) is not what restore picks"
        assert_tree_equal(state, rel_state(nxt, seed), f"{what}: next step {nxt}")
        if remote:
            assert nxt in list_root(mgr.remote).steps, f"{what}: next step {nxt} not uploaded"
    assert _leftovers(root) == [], f"{what}: leftovers after the next save: {_leftovers(root)}"
    if remote:
        if _leftovers(remote):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = cli.main(["prune", str(remote), "--keep", "100", "--leftovers", "--min-age", "0"])
            assert rc == 0, f"{what}: tierckpt prune --leftovers exit {rc}:\n{out.getvalue()}"
            COUNTS["remote leftovers pruned"] += 1
        assert _leftovers(remote) == [], f"{what}: remote leftovers after prune: {_leftovers(remote)}"
        rc, out = _verify_cli(remote)
        assert rc == 0, f"{what}: verify of the remote after prune: exit {rc}\n{out}"


def _trial(server: Server, base: Path, name: str, *, remote: bool, fault: str | None, kill_after: float | None,
           seed: int, expect_kill: bool = True, steps: int = STEPS) -> dict[str, Any]:
    root = base / name / "local"
    rem = base / name / "remote" if remote else None
    progress = base / name / "progress"
    root.parent.mkdir(parents=True)
    t0 = time.monotonic()
    ans = server.run({"root": str(root), "remote": str(rem) if rem else None, "fault": fault,
                      "kill_after": kill_after, "seed": seed, "steps": steps, "progress": str(progress)})
    ans["seconds"] = time.monotonic() - t0
    what = f"{name} (fault={fault}, kill_after={kill_after}, remote={remote}, seed={seed}) -> {ans['status']}"
    assert ans["killed"] or ans["status"] == "exit 0", f"{what}: the saver failed on its own:\n" \
        f"{server.log.read_text()[-2000:]}"
    if expect_kill:
        assert ans["killed"], f"{what}: the child was not SIGKILLed; server log:\n{server.log.read_text()[-2000:]}"
    if ans["killed"]:
        COUNTS["kills" + (" (remote)" if remote else " (local only)")] += 1
    check_after_kill(root, rem, seed, progress, what)
    return ans


def _named_cases() -> list[tuple[str, int, bool]]:
    cases = []
    for remote in (False, True):
        points = LOCAL_POINTS + (REMOTE_ONLY if remote else [])
        for point in points:
            if LONG:
                hits = range(1, MAX_HIT[point] + 1)
            else:  # one hit count per point, seeded, never the first save only
                rng = random.Random(f"{point}-{remote}")
                hits = [rng.randint(min(2, MAX_HIT[point]), MAX_HIT[point])]
            cases += [(point, n, remote) for n in hits]
    return cases


def test_fault_points_are_known() -> None:
    assert set(LOCAL_POINTS + REMOTE_ONLY + MULTI_RANK_ONLY + ROLLBACK_ONLY) == set(faults.POINTS)
    missing = set(faults.POINTS) - WIRED
    assert not missing, f"fault points not wired into the library: {missing}"


@pytest.mark.parametrize(("point", "hit", "remote"), _named_cases(),
                         ids=lambda v: str(v) if not isinstance(v, bool) else ("remote" if v else "local"))
def test_kill_at_named_point(server: Server, tmp_path: Path, point: str, hit: int, remote: bool) -> None:
    if point not in WIRED:
        pytest.skip(f"fault point {point} is not wired yet")
    _trial(server, tmp_path, "t", remote=remote, fault=f"{point}:{hit}", kill_after=None, seed=hit)
    COUNTS[f"point {point}"] += 1


RANDOM_KILLS = 200 if LONG else 8
#: saves per random-time trial: STEPS local saves take about 40 ms here, a window the 2 ms kill timer and the fork
#: blur; three times as many keep most delays inside the saves
RANDOM_STEPS = 3 * STEPS


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_kill_at_random_times(server: Server, tmp_path: Path, remote: bool) -> None:
    rng = random.Random(6006 + remote)
    n = RANDOM_KILLS // 2
    outcomes: Counter[str] = Counter()
    # calibrate: how long the saver takes to finish all its saves unkilled on this machine (the faster of two runs:
    # one slow run, on a busy machine, would put most delays past the end and kill nothing). A trial that finishes
    # before its kill was faster still: the span follows it down, so the delays keep landing inside the saves when
    # the machine speeds up after the calibration (a long run once got 47 kills in 100 with a fixed span)
    span = min(_trial(server, tmp_path, f"calibrate{k}", remote=remote, fault=None, kill_after=None, seed=99,
                      expect_kill=False, steps=RANDOM_STEPS)["seconds"] for k in range(2))
    first_span = span
    for i in range(n):
        delay = rng.uniform(0.02, 0.9 * span)
        ans = _trial(server, tmp_path, f"r{i}", remote=remote, fault=None, kill_after=delay, seed=100 + i,
                     expect_kill=False, steps=RANDOM_STEPS)
        outcomes["killed" if ans["killed"] else "finished first"] += 1
        if not ans["killed"]:
            span = min(span, ans["seconds"])
    COUNTS["random-time trials"] += n
    print(f"random kills (remote={remote}, saver runs {first_span:.2f} s unkilled, {span:.2f} s at the fastest): "
          f"{dict(outcomes)}")
    assert outcomes["killed"] >= n // 2, f"most random delays should land before the saver finishes: {outcomes}"


def test_verify_subprocess_after_kill(server: Server, tmp_path: Path) -> None:
    """Once through the real console entry point (a separate interpreter): exit 0 after a mid-file kill."""
    root = tmp_path / "t" / "local"
    root.parent.mkdir(parents=True)
    ans = server.run({"root": str(root), "remote": None, "fault": "mid-file:3", "kill_after": None, "seed": 7,
                      "steps": STEPS, "progress": str(tmp_path / "t" / "progress")})
    assert ans["killed"]
    assert _leftovers(root), "a mid-file kill should leave a .tmp- folder behind"
    proc = run_cli("verify", root)
    assert proc.returncode == 0, cli_output(proc)
    assert "leftover" in cli_output(proc), cli_output(proc)


def test_retention_kill_leaves_no_orphan_step_folder(server: Server, tmp_path: Path) -> None:
    """A kill inside retention (after the step folder is renamed away, before it is removed) leaves only a
    ``.trash-`` leftover, never a step folder that is no checkpoint; the next manager start-up removes it."""
    root = tmp_path / "t" / "local"
    root.parent.mkdir(parents=True)
    ans = server.run({"root": str(root), "remote": None, "fault": "retention:1", "kill_after": None, "seed": 8,
                      "steps": STEPS, "progress": str(tmp_path / "t" / "progress")})
    assert ans["killed"]
    # the step being deleted was renamed away atomically: no manifest-less step folder, only a .trash- leftover
    assert _orphan_step_folders(root) == [], (
        f"retention left step folders that are no checkpoint: {_orphan_step_folders(root)}")
    assert any(p.name.startswith(".trash-") for p in root.iterdir()), sorted(p.name for p in root.iterdir())
    with CheckpointManager(root, **MANAGER_KW) as mgr:
        for step in (10, 11, 12):
            mgr.save(step, rel_state(step, 8))
        mgr.wait()
    assert _orphan_step_folders(root) == [], f"orphan step folders never cleaned: {_orphan_step_folders(root)}"


def test_lone_store_listing_matches(tmp_path: Path) -> None:
    """Sanity for the harness itself: an empty root lists nothing and has no leftovers."""
    store = LocalStore(tmp_path / "x")
    assert list_root(store).steps == {} and _leftovers(tmp_path / "x") == []
