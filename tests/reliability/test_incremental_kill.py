"""Kill anywhere, incremental steps: a saver with ``incremental=True, full_every=3`` (a state whose tensor ``w``
never changes) SIGKILLed at every named fault point, with and without a POSIX remote tier, and at seeded random
times.

After each kill a fresh manager must: clean the local leftovers, restore the newest committed step exactly, find
every step that a committed step references committed in the same tier (a kill never deletes referenced bytes),
pass ``tierckpt verify`` (which reads every referenced file) on every tier, and save two more steps; after those,
each tier holds only what retention keeps and the steps those reference (a kill never leaves unreferenced steps
for good), and ``tierckpt prune --leftovers`` leaves the remote without leftovers. The children fork from the
kill harness's server (tests/reliability/_rel_kill_saver.py).
"""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path
from typing import Any

import pytest

from tests._support.helpers import assert_tree_equal
from tests.reliability._rel_kill_saver import INCREMENTAL_KW, MANAGER_KW, inc_state, rel_empty
from tests.reliability.test_kill import LOCAL_POINTS, REMOTE_ONLY, Server, _leftovers, _progress
from tierckpt import CheckpointManager, cli
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.local import LocalStore
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
        assert set(refs) == expect, f"{what}: {store.tier} holds {sorted(refs)}, retention keeps {sorted(expect)}"
    if remote:
        if _leftovers(remote):
            rc, out = _quiet("prune", str(remote), "--keep", "100", "--leftovers", "--min-age", "0")
            assert rc == 0, f"{what}: prune --leftovers: {rc}\n{out}"
        assert _leftovers(remote) == [], what
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
