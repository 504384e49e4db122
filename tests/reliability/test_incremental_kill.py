"""Kill anywhere, incremental steps: a saver with ``incremental=True, full_every=3`` (a state whose tensor ``w``
never changes) SIGKILLed at every named fault point, with and without a POSIX remote tier, and at seeded random
times.

After each kill a fresh manager must: clean the local leftovers, restore the newest committed step exactly, find
every step that a committed step references committed in the same tier (a kill never deletes referenced bytes),
pass ``tierckpt verify`` (which reads every referenced file) on every tier, and save two more steps; after those,
each tier holds only what retention keeps and the steps those reference (a kill never leaves unreferenced steps
for good), and ``tierckpt prune --leftovers`` leaves the remote without leftovers. The children fork from the
kill harness's server (tests/reliability/_rel_kill_saver.py).

Two-rank jobs (real gloo ranks, tests/distributed/_incremental_worker.py ``inckill``): one rank is SIGKILLed at a
point of an incremental save, of its shard's upload, of rank 0's remote commit or of retention; the other rank is
then killed too (as a launcher does when a rank dies). A restarted job must find every referenced step committed on
every tier, restore the newest committed step bit-exactly, save two more steps, and leave each tier holding what
retention keeps, the steps those reference and the steps a fresh lease of the killed job still pins; ``tierckpt
verify`` passes on every tier and ``prune --leftovers`` leaves the remote without leftovers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests._support.helpers import assert_tree_equal
from tests._support.procs import forkserver, run_as_main
from tests._support.ranks import rank_env
from tests.reliability._rel_kill_saver import INCREMENTAL_KW, MANAGER_KW, inc_state, rel_empty
from tests.reliability.test_kill import LOCAL_POINTS, REMOTE_ONLY, Server, _leftovers, _progress
from tierckpt import CheckpointManager, cli
from tierckpt.format.layout import step_dir
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import leases, steps
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(240)
STEPS = 5
KW: dict[str, Any] = {**MANAGER_KW, **INCREMENTAL_KW}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("inckillsrv") / "server.log")
    yield s
    s.close()


def _refs(store: LocalStore) -> dict[int, tuple[int, ...]]:
    out = {}
    for step in list_root(store).steps:
        m = read_step_manifest(store, f"step-{step:010d}", step)
        assert m is not None
        out[step] = m.refs
    return out


def _quiet(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(list(args))
    return rc, out.getvalue()


def _check(root: Path, remote: Path | None, seed: int, progress: Path, what: str) -> None:
    started, done = _progress(progress)
    stores = [LocalStore(root)] + ([LocalStore(remote, tier="remote")] if remote else [])
    with CheckpointManager(root, remote=str(remote) if remote else None, keep_remote=2 if remote else None,
                           **KW) as mgr:
        assert [n for n in _leftovers(root) if not n.startswith(".trash-")] == [], what
        for store in stores:  # referenced bytes are never deleted
            refs = _refs(store)
            missing = {s: r for s, r in refs.items() if not set(r) <= set(refs)}
            assert not missing, f"{what}: {store.tier} steps reference steps it lacks: {missing} of {sorted(refs)}"
        committed = set(list_root(mgr.local).steps) | (set(list_root(mgr.remote).steps) if remote else set())
        newest = max(committed, default=0)
        assert done <= newest <= started, f"{what}: newest committed {newest}, done {done}, started {started}"
        state = rel_empty()
        assert mgr.restore(state) == (newest or None), what
        if newest:
            assert_tree_equal(state, inc_state(newest, seed), f"{what}: step {newest}")
        mgr.wait()
        for store in stores:
            if list_root(store).steps:
                rc, out = _quiet("verify", store.url)
                assert rc == 0, f"{what}: verify {store.url}: {rc}\n{out}"
        for nxt in (started + 1, started + 2):
            mgr.save(nxt, inc_state(nxt, seed))
            mgr.wait()
        state = rel_empty()
        assert mgr.restore(state) == started + 2, what
        assert_tree_equal(state, inc_state(started + 2, seed), f"{what}: step {started + 2}")
    for store, keep in zip(stores, (KW["keep_local"], 2)):  # nothing unreferenced is left for good
        refs = _refs(store)
        assert refs[max(refs)], f"{what}: {store.tier} step {max(refs)} references nothing: not incremental"
        kept = sorted(refs)[-keep:]
        expect = set(kept) | {r for s in kept for r in refs[s]}
        # and on the remote, what the killed saver's lease still pins (it expires)
        pins = set(leases.pinned_by(store, store.list(""))) if store.tier == "remote" else set()
        assert expect <= set(refs) <= expect | pins, \
            f"{what}: {store.tier} holds {sorted(refs)}, retention keeps {sorted(expect)}, leases pin {sorted(pins)}"
    if remote:
        _prune_leftovers(LocalStore(remote, tier="remote"), what)
        rc, out = _quiet("verify", str(remote))
        assert rc == 0, f"{what}: verify of the remote after prune: {rc}\n{out}"


def _trial(server: Server, base: Path, *, remote: bool, fault: str | None, kill_after: float | None, seed: int,
           expect_kill: bool = True) -> dict[str, Any]:
    root = base / "local"
    rem = base / "remote" if remote else None
    base.mkdir(parents=True)
    ans = server.run({"root": str(root), "remote": str(rem) if rem else None, "fault": fault,
                      "kill_after": kill_after, "seed": seed, "steps": STEPS, "progress": str(base / "progress"),
                      "incremental": True})
    what = f"incremental (fault={fault}, kill_after={kill_after}, remote={remote}, seed={seed}) -> {ans['status']}"
    assert ans["killed"] or ans["status"] == "exit 0", f"{what}: {server.log.read_text()[-2000:]}"
    if expect_kill:
        assert ans["killed"], f"{what}: not killed; {server.log.read_text()[-2000:]}"
    _check(root, rem, seed, base / "progress", what)
    return ans


def _cases() -> list[tuple[str, int, bool]]:
    out = []
    for remote in (False, True):
        for point in LOCAL_POINTS + (REMOTE_ONLY if remote else []):
            rng = random.Random(f"inc-{point}-{remote}")
            # a hit in the saves that reference (steps 2, 3, 5) or in retention, never only the first save
            hit = rng.randint(2, 3) if point != "retention" else 1
            out.append((point, hit, remote))
    return out


@pytest.mark.parametrize(("point", "hit", "remote"), _cases(),
                         ids=lambda v: str(v) if not isinstance(v, bool) else ("remote" if v else "local"))
def test_incremental_kill_at_named_point(server: Server, tmp_path: Path, point: str, hit: int, remote: bool) -> None:
    _trial(server, tmp_path / "t", remote=remote, fault=f"{point}:{hit}", kill_after=None, seed=hit)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_incremental_kill_at_random_times(server: Server, tmp_path: Path, remote: bool) -> None:
    rng = random.Random(4141 + remote)
    for i in range(3):
        _trial(server, tmp_path / f"r{i}", remote=remote, fault=None, kill_after=rng.uniform(0.05, 0.6),
               seed=200 + i, expect_kill=False)


def _prune_leftovers(remote: LocalStore, what: str) -> set[int]:
    """``tierckpt prune --leftovers`` of the remote where a kill left something (a ``.tmp-``/``.trash-`` folder, or a
    step folder a deletion decommitted), which must then leave none. Returns the steps that such interrupted
    deletions held until then (they referenced them: the job's retention kept them; the next one deletes them)."""
    interrupted = [s for s in list_root(remote).uncommitted if steps.DELETING_MANIFEST in remote.list(step_dir(s))]
    held = {r for s in interrupted for r in (steps.refs_of(remote, s) or ())}
    root = remote.local_path
    assert root is not None
    if _leftovers(Path(root)) or interrupted:
        rc, out = _quiet("prune", str(root), "--keep", "100", "--leftovers", "--min-age", "0")
        assert rc == 0, f"{what}: prune --leftovers: {rc}\n{out}"
    assert _leftovers(Path(root)) == [], what
    assert not [s for s in list_root(remote).uncommitted if steps.DELETING_MANIFEST in remote.list(step_dir(s))]
    return held


# ------------------------------------------------------------------------------------------------ two-rank jobs
WORKER = Path(__file__).resolve().parents[1] / "distributed" / "_incremental_worker.py"


def _job(root: Path, cfg: dict[str, Any], name: str, timeout: float = 120) -> list[int | None]:
    """Run the two ranks of ``cfg``'s phase; once a rank dies of a signal, SIGKILL the other. Returns the exit
    codes."""
    cfg_path = root / f"config-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    ctx = forkserver()
    for r in range(2):
        (root / f"log-{name}-r{r}.txt").write_text("")
    procs = [ctx.Process(target=run_as_main, args=([str(WORKER), "inckill", str(r), str(cfg_path)], rank_env(),
                                                   str(root), str(root / f"log-{name}-r{r}.txt")))
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode is not None and p.exitcode < 0 for p in procs):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
            p.join()
    return [p.exitcode for p in procs]


def _log(root: Path, name: str) -> str:
    return "\n".join(f"--- rank {r}:\n" + (root / f"log-{name}-r{r}.txt").read_text()[-3000:] for r in range(2))


def _rank_trial(base: Path, rank: int, fault: str) -> None:
    base.mkdir(parents=True)
    store = f"file://{base}/store-{secrets.token_hex(4)}"
    cfg: dict[str, Any] = {"world": 2, "root": str(base), "remote": str(base / "remote"), "timeout": 10,
                           "phase": "run", "fault": fault, "kill_rank": rank, "store": store}
    what = f"two ranks, rank {rank} killed at {fault}"
    codes = _job(base, cfg, "run")
    assert codes[rank] == -signal.SIGKILL, f"{what}: not killed ({codes})\n{_log(base, 'run')}"
    progress = [_progress(base / f"progress-r{r}") for r in range(2)]
    started, done = max(p[0] for p in progress), min(p[1] for p in progress)
    stores = [LocalStore(base / f"n{r}") for r in range(2)] + [LocalStore(base / "remote", tier="remote")]
    for st in stores:  # referenced bytes are never deleted
        refs = _refs(st)
        missing = {s: r for s, r in refs.items() if not set(r) <= set(refs)}
        assert not missing, f"{what}: {st.url} steps reference steps it lacks: {missing} of {sorted(refs)}"
    cfg.update(phase="check", fault=None, next=started + 1, store=f"file://{base}/store-{secrets.token_hex(4)}")
    codes = _job(base, cfg, "check")
    assert codes == [0, 0], f"{what}: the restarted job failed ({codes})\n{_log(base, 'check')}"
    for r in range(2):
        rec = json.loads((base / f"result-inckill-r{r}.json").read_text())["check"]
        assert "phase_error" not in rec, f"{what}: rank {r}: {rec}"
        assert done <= (rec["restored"] or 0) <= started and rec["exact"], f"{what}: rank {r}: {rec}"
        assert rec["again"] == started + 2 and rec["again_exact"], f"{what}: rank {r}: {rec}"
    remote = stores[-1]
    held_by_interrupted = _prune_leftovers(remote, what)
    pinned = set(leases.pinned_by(remote, remote.list("")))  # the killed job's lease, fresh for a while
    for st in stores:
        rc, out = _quiet("verify", str(st.local_path))
        assert rc == 0, f"{what}: verify {st.url}: {rc}\n{out}"
        refs = _refs(st)
        assert refs[max(refs)], f"{what}: {st.url}: step {max(refs)} references nothing: not incremental"
        kept = sorted(refs)[-2:]
        expect = set(kept) | {r for s in kept for r in refs[s]}
        pins = pinned | held_by_interrupted if st is remote else set()
        assert expect <= set(refs) <= expect | pins, f"{what}: {st.url} holds {sorted(refs)}, retention keeps " \
            f"{sorted(expect)} (and leases or interrupted deletions hold {sorted(pins)})"


#: rank 1 in its shard's upload of step 3 (which references step 1); rank 0 in its remote commit of step 2, after
#: every shard reported (its lease pinning step 1 is left behind); rank 0 in retention (a remote deletion between its
#: decommit and its check, or a local one)
#: (each trial costs about 5 s of CPU: the rank-1 upload trial runs with TIERCKPT_LONG=1 only)
TWO_RANK_KILLS = [pytest.param(1, "mid-upload:3", id="r1-mid-upload", marks=pytest.mark.skipif(
                      os.environ.get("TIERCKPT_LONG") != "1", reason="long run only (TIERCKPT_LONG=1)")),
                  pytest.param(0, "remote-commit:2", id="r0-remote-commit"),
                  pytest.param(0, "retention:2", id="r0-retention")]


@pytest.mark.parametrize(("rank", "fault"), TWO_RANK_KILLS)
def test_two_rank_incremental_kill(tmp_path: Path, rank: int, fault: str) -> None:
    _rank_trial(tmp_path / "t", rank, fault)
