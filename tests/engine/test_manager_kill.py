"""A process SIGKILLed during a save leaves the previous checkpoint restorable, `verify` clean, and the next
run working; a committed step being replaced is never lost when the replacing process is killed."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests._support.helpers import (
    TESTS_DIR,
    assert_tree_equal,
    cli_output,
    empty_like_kill_state,
    kill_state,
    leftovers,
    run_cli_parallel,
    step_path,
    subprocess_env,
)
from tests._support.procs import Child, start_python
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).resolve().parent / "_core_kill_saver.py"


def _spawn(mode: str, root: Path, seed: int) -> Child:
    return start_python([str(SCRIPT), mode, str(root), str(seed)], env=subprocess_env(), cwd=TESTS_DIR)


def _kill_after_ready(proc: Child, delay: float, result: dict) -> None:
    line = proc.readline(timeout=120)
    if line.strip() != "READY":
        proc.kill()
        result["error"] = f"child did not get ready: {line!r} {proc.errors()}"
        return
    time.sleep(delay)
    done_already = False
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # pragma: no cover - the child never exits on its own
        done_already = True
    proc.wait(timeout=60)
    result["killed"] = not done_already and proc.returncode == -signal.SIGKILL
    result["stderr"] = proc.communicate()[1]


def _run_trials(mode: str, roots: list[Path], seeds: list[int], delays: list[float]) -> list[dict]:
    """Run the children concurrently (each kill at its own seeded delay after READY)."""
    results: list[dict] = [{} for _ in roots]
    procs = [_spawn(mode, root, seed) for root, seed in zip(roots, seeds, strict=True)]
    threads = [
        threading.Thread(target=_kill_after_ready, args=(p, d, r))
        for p, d, r in zip(procs, delays, results, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for p in procs:
        if p.poll() is None:  # pragma: no cover - safety net
            p.kill()
            p.wait()
    for r in results:
        assert "error" not in r, r["error"]
        assert r["killed"], f"child was not SIGKILLed: {r}"
    return results


def test_sigkill_during_save_leaves_a_restorable_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20240601)
    n = 3
    delays = [rng.uniform(0.0, 0.25) for _ in range(n)]
    seeds = list(range(1, n + 1))
    roots = [tmp_path / f"trial{i}" for i in range(n)]
    _run_trials("fresh", roots, seeds, delays)

    outcomes = []
    for root, seed, delay in zip(roots, seeds, delays, strict=True):
        with CheckpointManager(root, keep_local=3) as mgr:
            latest = mgr.latest_step()
            assert latest in (1, 2), f"delay {delay:.3f}: latest_step() = {latest}"
            outcomes.append((delay, latest, leftovers(root)))
            state = empty_like_kill_state(big=latest == 2)
            assert mgr.restore(state) == latest
            assert_tree_equal(
                state, kill_state(latest, seed, big=latest == 2), f"trial seed={seed} step {latest}"
            )
            if latest == 2:  # step 1 is still there and intact too (keep_local=3)
                s1 = empty_like_kill_state(big=False)
                assert mgr.restore(s1, step=1) == 1
                assert_tree_equal(s1, kill_state(1, seed, big=False), "step 1")

    procs = run_cli_parallel([("verify", root) for root in roots])
    for proc, outcome in zip(procs, outcomes, strict=True):
        assert proc.returncode == 0, (
            f"verify after SIGKILL {outcome}: exit {proc.returncode}\n{cli_output(proc)}"
        )

    # the next run works: saves the next step, restores it, and cleans the crash leftovers
    for root, seed in zip(roots, seeds, strict=True):
        with CheckpointManager(root, keep_local=3) as mgr:
            nxt = mgr.latest_step() + 1
            mgr.save(nxt, kill_state(nxt, seed, big=False))
            mgr.wait()
            got = empty_like_kill_state(big=False)
            assert mgr.restore(got) == nxt
            assert_tree_equal(got, kill_state(nxt, seed, big=False), f"step {nxt} after the crash")
        assert leftovers(root) == [], f"crash leftovers not cleaned up by the manager: {leftovers(root)}"
    print("SIGKILL outcomes (delay, committed step, leftovers):", outcomes)


def test_sigkill_while_replacing_a_committed_step_never_loses_it(tmp_path: Path) -> None:
    rng = random.Random(77)
    n = 2
    delays = [rng.uniform(0.0, 0.2) for _ in range(n)]
    seeds = [11, 12]
    roots = [tmp_path / f"trial{i}" for i in range(n)]
    for root, seed in zip(roots, seeds, strict=True):
        with CheckpointManager(root) as mgr:  # an earlier run committed step 5
            mgr.save(5, kill_state(5, seed, big=True))
            mgr.wait()
        assert (step_path(root, 5) / "manifest.json").is_file()

    _run_trials("replace", roots, seeds, delays)

    for root, seed, delay in zip(roots, seeds, delays, strict=True):
        with CheckpointManager(root) as mgr:
            assert mgr.latest_step() == 5, f"delay {delay:.3f}: step 5 lost: {sorted(os.listdir(root))}"
            state = empty_like_kill_state(big=True)
            assert mgr.restore(state, step=5) == 5
            old, new = kill_state(5, seed, big=True), kill_state(5, seed + 1, big=True)
            which = "new" if state["meta"]["seed"] == seed + 1 else "old"
            assert_tree_equal(state, new if which == "new" else old, f"step 5 ({which} copy) after SIGKILL")


def test_new_manager_replaces_committed_step(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(5, kill_state(5, 1, big=False))
        mgr.wait()
    with CheckpointManager(root) as mgr:
        # the old data is there and intact before the new save
        state = empty_like_kill_state(big=False)
        assert mgr.restore(state) == 5
        assert_tree_equal(state, kill_state(5, 1, big=False), "old step 5")
        h = mgr.save(5, kill_state(5, 2, big=False))
        h.persisted.result(timeout=60)
        mgr.wait()
        got = empty_like_kill_state(big=False)
        assert mgr.restore(got, step=5) == 5
        assert_tree_equal(got, kill_state(5, 2, big=False), "new step 5")
    assert [p.name for p in root.iterdir() if p.name.startswith("step-")] == [step_path(root, 5).name]
    with CheckpointManager(root) as mgr:
        got = empty_like_kill_state(big=False)
        assert mgr.restore(got) == 5
        assert_tree_equal(got, kill_state(5, 2, big=False), "new step 5, fresh manager")
