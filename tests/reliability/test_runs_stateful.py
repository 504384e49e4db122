"""Two jobs, one remote, as a Hypothesis state machine: saves, waits, outages, restarts, rollbacks and a replaced
node, in any order, for two jobs whose local folders differ and whose ``remote=`` is the same folder.

Each save's state and metadata carry a unique tag. After every rule the real folders are read back and checked:

1. no committed remote step is ever replaced by another save, unless a rollback set the earlier one aside;
2. every tag committed in the remote was saved by a job whose folder belonged to the run the remote records
   (``run.json``): a job of another run never uploads into it;
3. no save a rollback set aside is committed again where it was set aside (the rolling-back job's local tier and the
   remote, where the other job's saves above the rollback point go too), and no restore ever returns one of the
   rolling-back job's;
4. each job's newest save (not set aside) is committed in its local tier: a failing remote or another job never
   costs a local checkpoint;
5. a restart restores the newest step of the job's own run: its local tier's newest, or the remote's where the
   remote belongs to the same run.

The remote is a local folder whose store each manager gets wrapped in a :class:`FaultyStore` ("down": every write
is refused), as in ``test_retention_stateful.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests._support.remote import RemoteSwitch, wrap_remote_stores
from tierckpt import CheckpointManager, RollbackError, UploadError
from tierckpt.format import layout
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import identity
from tierckpt.tiers.listing import list_root

pytestmark = pytest.mark.timeout(300)

N = 64
JOBS = ("a", "b")


def _state(step: int, tag: int) -> dict:
    return {"w": torch.full((N,), float(tag)), "step": step}


def _empty() -> dict:
    return {"w": torch.zeros(N), "step": -1}


_CURRENT: list[RemoteSwitch] = []


def _committed(path: Path, tier: str) -> dict[int, int]:
    """step -> tag of each committed step of a tier's folder."""
    if not path.exists():
        return {}
    store = LocalStore(path, tier=tier, create=False)
    out = {}
    for step in list_root(store).steps:
        m = read_step_manifest(store, layout.step_dir(step), step)
        if m is not None:
            out[step] = m.metadata["tag"]
    return out


def _run(path: Path) -> str | None:
    if not path.exists():
        return None
    found = identity.read(LocalStore(path, tier="x", create=False))
    return None if found is None else found.run_id


class TwoRunsOneRemote(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierckpt-runs-sm-"))
        self.remote_dir = self.dir / "remote"
        self.local = {j: self.dir / j for j in JOBS}
        self.switch = RemoteSwitch()
        _CURRENT[:] = [self.switch]
        self.mgr: dict[str, CheckpointManager | None] = {j: None for j in JOBS}
        self.tag = 0
        self.job_of: dict[int, str] = {}  # tag -> job that saved it
        self.run_of: dict[int, str | None] = {}  # tag -> the run its job's folder belonged to when it saved
        self.last: dict[str, int] = {j: 0 for j in JOBS}  # each job's step counter
        self.newest: dict[str, int | None] = {j: None for j in JOBS}  # each job's newest tag not set aside
        self.aside: set[int] = set()  # set aside by a rollback in the rolling-back job's local tier
        self.remote_aside: set[int] = set()  # set aside by a rollback in the remote (another job's save included)
        self.seen_remote: dict[int, int] = {}  # remote step -> tag once committed

    def _open(self, job: str) -> CheckpointManager:
        return CheckpointManager(self.local[job], remote=str(self.remote_dir), keep_local=self.keep,
                                 keep_remote=self.keep + 1, remote_timeout_s=2.0, writer_threads=1,
                                 upload_threads=1, pin_memory=False)

    def _close(self, job: str) -> None:
        mgr, self.mgr[job] = self.mgr[job], None
        if mgr is not None:
            with contextlib.suppress(UploadError):  # RunConflictError included
                mgr.close(timeout=60, raise_upload_errors=False)

    def _restore(self, job: str, **kw) -> int | None:
        mgr = self.mgr[job]
        assert mgr is not None
        state = _empty()
        got = mgr.restore(state, **kw)
        if got is not None:
            tag = int(state["w"][0])
            assert tag not in self.aside, f"job {job} restored set-aside save {tag} (step {got})"
            self.last[job] = max(self.last[job], got)
        return got

    @initialize(keep=st.integers(1, 3))
    def start(self, keep: int) -> None:
        self.keep = keep
        for j in JOBS:
            self.mgr[j] = self._open(j)

    @precondition(lambda self: any(m is not None for m in self.mgr.values()))
    @rule(job=st.sampled_from(JOBS), gaps=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def save(self, job: str, gaps: list[int]) -> None:
        mgr = self.mgr[job]
        if mgr is None:
            return
        for gap in gaps:
            step = self.last[job] + gap
            self.tag += 1
            try:
                h = mgr.save(step, _state(step, self.tag), metadata={"tag": self.tag})
            except RollbackError:  # the remote of this job's run holds a newer step (saved by the other job)
                self.last[job] = max(self.last[job], *_committed(self.remote_dir, "remote"))
                return
            h.persisted.result(timeout=60)
            h.uploaded.exception(timeout=60)  # settled: the model does not race the upload thread
            self.job_of[self.tag] = job
            self.run_of[self.tag] = _run(self.local[job])
            self.last[job], self.newest[job] = step, self.tag

    @rule(job=st.sampled_from(JOBS))
    def wait(self, job: str) -> None:
        mgr = self.mgr[job]
        if mgr is not None:
            with contextlib.suppress(UploadError):
                mgr.wait(timeout=60)

    @rule(down=st.booleans())
    def outage(self, down: bool) -> None:
        self.switch.set(down)

    @rule(job=st.sampled_from(JOBS))
    def restart(self, job: str) -> None:
        self._close(job)
        local = _committed(self.local[job], "local")
        remote = _committed(self.remote_dir, "remote")
        same_run = _run(self.local[job]) is not None and _run(self.local[job]) == _run(self.remote_dir)
        self.mgr[job] = self._open(job)
        got = self._restore(job)
        if local:  # 5: the job's own run only
            expected = max(set(local) | (set(remote) if same_run and not self.switch.down else set()))
            if self.switch.down and same_run:
                assert got in (max(local), max(set(local) | set(remote))), (got, local, remote)
            else:
                assert got == expected, f"job {job} restarted at {got}, expected {expected} ({local}, {remote})"

    @rule(job=st.sampled_from(JOBS))
    def replaced_node(self, job: str) -> None:
        """The job's node is replaced: an empty local folder; the restart restores whatever the remote holds
        and continues that run."""
        self._close(job)
        shutil.rmtree(self.local[job])
        self.newest[job] = None
        self.mgr[job] = self._open(job)
        if not self.switch.down:
            self._restore(job)

    @precondition(lambda self: not self.switch.down)
    @rule(job=st.sampled_from(JOBS), back=st.integers(1, 2))
    def rollback(self, job: str, back: int) -> None:
        mgr = self.mgr[job]
        if mgr is None:
            return
        mine = _committed(self.local[job], "local")
        older = sorted(mine)[:-back] if len(mine) > back else []
        if not older:
            return
        target = older[-1]
        assert self._restore(job, step=target, source="local") == target
        same_run = _run(self.local[job]) == _run(self.remote_dir)
        remote = _committed(self.remote_dir, "remote")  # before the rollback: it sets aside the other job's too
        mgr.rollback_to(target)
        self.aside |= {t for s, t in mine.items() if s > target}
        if same_run:  # the other job's local copies are its own: the rollback reaches only this job and the remote
            self.remote_aside |= {t for s, t in remote.items() if s > target}
        self.last[job] = target
        self.newest[job] = mine[target]

    def teardown(self) -> None:
        try:
            for j in JOBS:
                self._close(j)
        finally:
            _CURRENT.clear()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ invariants
    @invariant()
    def remote_steps_are_never_replaced(self) -> None:  # 1
        for step, tag in _committed(self.remote_dir, "remote").items():
            before = self.seen_remote.get(step)
            assert before is None or before == tag or before in self.aside | self.remote_aside, \
                f"remote step {step} replaced: save {before} by {tag}"
            self.seen_remote[step] = tag

    @invariant()
    def the_remote_holds_one_run(self) -> None:  # 2
        run = _run(self.remote_dir)
        for step, tag in _committed(self.remote_dir, "remote").items():
            assert run is not None and self.run_of[tag] == run, \
                f"remote step {step} is job {self.job_of[tag]}'s save {tag} of run {self.run_of[tag]}, not {run}"

    @invariant()
    def nothing_set_aside_is_committed(self) -> None:  # 3
        for path, tier, aside in ((self.remote_dir, "remote", self.aside | self.remote_aside),
                                  *((self.local[j], "local", self.aside) for j in JOBS)):
            back = set(_committed(path, tier).values()) & aside
            assert not back, f"set-aside saves {back} committed in {path}"

    @invariant()
    def each_jobs_newest_save_is_local(self) -> None:  # 4
        for j in JOBS:
            if self.newest[j] is not None:
                assert self.newest[j] in _committed(self.local[j], "local").values(), \
                    f"job {j}'s newest save {self.newest[j]} is not in its local tier"


@pytest.fixture
def patched_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    wrap_remote_stores(monkeypatch, _CURRENT)


def test_two_runs_on_one_remote_state_machine(patched_manager: None) -> None:
    run_state_machine_as_test(TwoRunsOneRemote,
                              settings=settings(max_examples=40, stateful_step_count=20, deadline=None))


def test_a_rollback_sets_aside_the_other_jobs_newer_remote_step(patched_manager: None) -> None:
    """Job a saves steps 1 and 3; job b (a replaced node) continues the run from the remote and saves step 4; a
    rolls back to step 1: the remote's steps 3 and 4 are set aside, b's included (it belongs to the run), so a's
    new step 4 replaces nothing committed. (The machine once took b's step 4 for a committed step a replaced:
    it read the remote after the rollback.)"""
    machine = TwoRunsOneRemote()
    try:
        machine.start(keep=2)
        machine.save(job="a", gaps=[1, 2])
        machine.replaced_node(job="b")
        machine.save(job="b", gaps=[1])
        assert _committed(machine.remote_dir, "remote") == {1: 1, 3: 2, 4: 3}
        machine.remote_steps_are_never_replaced()  # notes what each remote step holds
        machine.rollback(job="a", back=1)
        assert _committed(machine.remote_dir, "remote") == {1: 1}
        assert machine.remote_aside == {2, 3} and machine.aside == {2}
        assert _committed(machine.local["b"], "local")[4] == 3  # b's own folder is b's: the rollback stops at it
        machine.save(job="a", gaps=[1, 2])
        assert _committed(machine.remote_dir, "remote") == {1: 1, 2: 4, 4: 5}
        machine.remote_steps_are_never_replaced()
        machine.nothing_set_aside_is_committed()
    finally:
        machine.teardown()
