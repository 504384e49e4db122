"""Deleting steps of a remote that other processes write: a running job's upload of an incremental step pins the
remote steps it references in a lease at the root, which a ``tierckpt prune`` in another process (or another job's
retention) honours; a lease written while a deletion checks makes the deletion commit the step again; an expired
lease pins nothing; ``prune --leftovers`` removes expired leases and finishes deletions a kill interrupted; and the
retention of a job that never saved incrementally reads no manifest and never holds the process-wide lock across a
request."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierckpt.manager as manager_mod
from tests._support.helpers import cli_output, run_cli
from tests._support.steps import build_step, write_step
from tests.tiers.test_incremental import cli_json, lora_state
from tierckpt import CheckpointManager, cli, faults
from tierckpt.format import layout
from tierckpt.replication.policy import remote_summary
from tierckpt.storage.base import Store, join
from tierckpt.storage.commit import read_step_manifest
from tierckpt.storage.local import LocalStore
from tierckpt.storage.open import open_store
from tierckpt.tiers import incremental, leases, steps
from tierckpt.tiers.listing import list_root
from tierckpt.tiers.uploader import replicate_step

pytestmark = pytest.mark.timeout(120)


def _s3_args(s3_server: Any) -> list[str]:
    return ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]


def _incremental_local(root: Path) -> LocalStore:
    """Steps 1 (whole), 2 (referencing 1) and 3 (whole) of a LoRA-style state in a local tier."""
    with CheckpointManager(root, incremental=True, full_every=2, keep_local=10, log_records=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, lora_state(step))
        mgr.wait()
    local = LocalStore(root)
    m2 = read_step_manifest(local, layout.step_dir(2), 2)
    assert m2 is not None and m2.refs == (1,)
    return local


def test_prune_in_another_process_keeps_the_step_an_upload_in_flight_references(
        tmp_path: Path, make_store: Any, s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote holds steps 1 and 3 (uploaded newest first after an outage, say); step 2, which references step
    1, is being uploaded when a ``tierckpt prune --keep 1`` runs in another process: step 1 is newer than nothing
    the prune keeps and no committed step references it, but the upload's lease pins it, so it stays and step 2
    lands intact. Once the upload is done, the lease is gone and a prune deletes steps 2 and 1."""
    local = _incremental_local(tmp_path / "local")
    remote = make_store("s3")
    for step in (1, 3):
        replicate_step(local, remote, step)
    outputs: list[str] = []
    real_point = faults.point

    def prune_meanwhile(name: str) -> None:
        if name == "before-remote-manifest" and not outputs:
            proc = run_cli("prune", remote.url, "--keep", "1", "--no-verify", *_s3_args(s3_server))
            outputs.append(f"rc={proc.returncode}\n{cli_output(proc)}")
        real_point(name)

    monkeypatch.setattr(faults, "point", prune_meanwhile)
    replicate_step(local, remote, 2)
    monkeypatch.undo()
    assert outputs and outputs[0].startswith("rc=0"), outputs
    assert "keeping step 1: a running job's upload references it (lease pins-" in outputs[0], outputs[0]
    assert sorted(list_root(remote).steps) == [1, 2, 3]
    assert not [n for n in remote.list("") if leases.is_lease(n)], "the upload's lease is removed at its end"
    assert cli.main(["verify", f"{remote.url}/{layout.step_dir(2)}", *_s3_args(s3_server)]) == 0  # and step 1's
    # nothing pins step 1 any more: newest first, step 2 goes, then step 1
    assert cli.main(["prune", remote.url, "--keep", "1", "--no-verify", *_s3_args(s3_server)]) == 0
    assert sorted(list_root(remote).steps) == [3]


class _LeaseMidway:
    """``store`` (a remote) on which another process writes a lease pinning ``step`` right after a deletion has
    decommitted it: after the deletion's first check and before its second."""

    def __init__(self, store: Store, step: int) -> None:
        self._store = store
        self._step = step
        self.written = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _then_lease(self) -> None:
        if not self.written:
            self.written = True
            self._store.put_atomic(f"{leases.PREFIX}other-job{leases.SUFFIX}",
                                   leases.encode((self._step,), time.time() + 600, "another-host-4242"))

    def remove(self, rel: str) -> None:
        self._store.remove(rel)
        if rel == join(layout.step_dir(self._step), layout.STEP_MANIFEST):
            self._then_lease()

    def replace_dir(self, src: str, dst: str) -> None:
        self._store.replace_dir(src, dst)
        if src == join(layout.step_dir(self._step), layout.STEP_MANIFEST):
            self._then_lease()


@pytest.mark.parametrize("kind", ["s3", "posix_remote"])
def test_a_lease_written_while_a_deletion_checks_commits_the_step_again(make_store: Any, kind: str) -> None:
    store = make_store(kind)
    for step in (1, 2):
        write_step(store, build_step(step))
    racing = _LeaseMidway(store, 1)
    done = steps.delete_steps(racing, [1], listed=[1, 2])  # type: ignore[arg-type]
    assert racing.written
    assert done.deleted == [] and "another-host-4242" in done.held[1], done
    assert read_step_manifest(store, layout.step_dir(1), 1) is not None, "committed again"
    assert steps.DELETING_MANIFEST not in store.list(layout.step_dir(1))
    assert sorted(list_root(store).steps) == [1, 2]


def test_leases_expire_prune_force_overrides_them_and_leftovers_removes_expired_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "remote"
    store = LocalStore(root, tier="remote")
    for step in (1, 2, 3):
        write_step(store, build_step(step))
    store.put_atomic("pins-dead-job.json", leases.encode((1,), time.time() - 5, "dead-host-1"))
    store.put_atomic("pins-live-job.json", leases.encode((2,), time.time() + 600, "live-host-2"))
    rc, doc = cli_json("prune", str(root), "--keep", "1", "--no-verify", capsys=capsys)
    assert rc == 0 and doc["deleted"] == [1] and doc["kept"] == [2, 3], doc  # the expired lease pins nothing
    assert cli.main(["prune", str(root), "--keep", "1", "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "keeping step 2: a running job's upload references it (lease pins-live-job.json (held by live-host-2" \
        in out and "--force deletes them" in out, out
    assert cli.main(["prune", str(root), "--keep", "1", "--no-verify", "--force"]) == 0
    out = capsys.readouterr().out
    assert "--force: deleting steps that a running job's upload references (step 2: lease pins-live-job" in out, out
    assert sorted(list_root(store).steps) == [3]
    rc, doc = cli_json("prune", str(root), "--leftovers", "--min-age", "0", capsys=capsys)
    assert rc == 0 and any("removed expired lease" in a and "pins-dead-job.json" in a for a in doc["leftovers"]), doc
    names = store.list("")
    assert "pins-dead-job.json" not in names and "pins-live-job.json" in names, names


def test_prune_leftovers_finishes_a_deletion_a_kill_interrupted(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A deletion killed between its decommit and its check leaves ``manifest.deleting.json``: the step is
    committed again where a step references it, removed where nothing does."""
    _incremental_local(tmp_path / "local")
    store = LocalStore(tmp_path / "local", tier="remote")
    for step in (1, 2):  # step 2 references step 1; nothing references step 2
        steps._decommit(store, step)  # what a kill right after the decommit leaves
    assert sorted(list_root(store).steps) == [3]
    rc, doc = cli_json("prune", str(tmp_path / "local"), "--leftovers", "--min-age", "0", "--dry-run",
                       capsys=capsys)
    assert rc == 0 and sorted(list_root(store).steps) == [3], doc
    assert any("would remove" in a and "step-0000000002" in a for a in doc["leftovers"]), doc
    rc, doc = cli_json("prune", str(tmp_path / "local"), "--leftovers", "--min-age", "0", capsys=capsys)
    assert rc == 0, doc
    # step 2 goes first (newest first), so nothing references step 1 by the time it is looked at: it goes too
    assert sorted(list_root(store).steps) == [3] and not store.exists(layout.step_dir(2)), doc
    # a referenced one is committed again
    _incremental_local(tmp_path / "again")
    again = LocalStore(tmp_path / "again", tier="remote")
    steps._decommit(again, 1)
    rc, doc = cli_json("prune", str(tmp_path / "again"), "--leftovers", "--min-age", "0", capsys=capsys)
    assert rc == 0 and any("committed step 1 again" in a and "step 2 references its bytes" in a
                           for a in doc["leftovers"]), doc
    assert sorted(list_root(again).steps) == [1, 2, 3]
    assert cli.main(["verify", str(tmp_path / "again")]) == 0


class _Counting:
    """A remote store that counts its requests by kind and fails a request made under the process-wide lock."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.counts: dict[str, int] = {}
        self.under_lock: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name.startswith("_") or name in ("close", "diagnose"):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            what = name + (":manifest" if args and str(args[0]).endswith(layout.STEP_MANIFEST) else "")
            self.counts[what] = self.counts.get(what, 0) + 1
            if incremental.LOCK._is_owned():  # type: ignore[attr-defined]
                self.under_lock.append(f"{name}{args[:1]}")
            return attr(*args, **kwargs)

        return counted


def _retention_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_bucket: str, s3_server: Any,
                        **kw: Any) -> _Counting:
    wrapped: list[_Counting] = []
    real_open_store = manager_mod.open_store

    def open_store(*args: Any, **kwargs: Any) -> Any:
        store = real_open_store(*args, **kwargs)
        if kwargs.get("tier") == "remote":
            wrapped.append(_Counting(store))
            return wrapped[-1]
        return store

    with monkeypatch.context() as patch:
        patch.setattr(manager_mod, "open_store", open_store)
        _save_six(tmp_path, s3_bucket, s3_server, **kw)
    return wrapped[0]


def _save_six(tmp_path: Path, s3_bucket: str, s3_server: Any, **kw: Any) -> None:
    with CheckpointManager(tmp_path / "local", remote=f"{s3_bucket}/run", storage_options=s3_server.storage_options(),
                           keep_local=1, keep_remote=2, log_records=False, **kw) as mgr:
        for step in range(1, 7):
            mgr.save(step, lora_state(step))
            mgr.wait()
        assert sorted(list_root(mgr.remote).steps) == [5, 6]


def test_remote_retention_reads_no_manifest_and_holds_no_lock_across_a_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_bucket: str, s3_server: Any) -> None:
    """Six saves, ``keep_remote=2``: four deletions on the remote. The references of the steps this job uploaded
    are known: the reference checks read no remote manifest (they read two per deletion here before), incremental
    or not;
    no request is made under :data:`~tierckpt.tiers.incremental.LOCK` (28 were before)."""
    checks: list[int] = []
    real = steps.read_step_manifest

    def counted(store: Any, folder: str, step: Any) -> Any:
        checks.append((store.tier, step))
        return real(store, folder, step)

    monkeypatch.setattr(steps, "read_step_manifest", counted)
    full = _retention_requests(tmp_path / "full", monkeypatch, s3_bucket, s3_server)
    remote_checks = [c for c in checks if c[0] != "local"]  # the local tier's are file reads
    assert full.under_lock == [] and remote_checks == [], (full.under_lock, checks)
    assert full.counts["list"] <= 19, full.counts  # one listing per deletion pass, as the check read before
    assert full.counts.get("put_atomic", 0) == 0, full.counts  # no step referenced: no lease
    # 1 whole, 2-4 reference 1, 5 whole, 6 references 5: steps 2-4 go, then step 1
    inc = _retention_requests(tmp_path / "inc", monkeypatch, f"{s3_bucket}/inc", s3_server, incremental=True,
                              full_every=4)
    remote_checks = [c for c in checks if c[0] != "local"]
    assert inc.under_lock == [] and remote_checks == [], (inc.under_lock, checks)
    # a lease written (pinning the step referenced) and removed for each upload of a referencing step: 2, 3, 4, 6
    assert inc.counts["put_atomic"] == 4 and inc.counts["remove"] >= 4, inc.counts
    remote = open_store(f"{s3_bucket}/inc/run", storage_options=s3_server.storage_options(), tier="remote")
    assert not [n for n in remote.list("") if leases.is_lease(n)]
    remote.close()


def test_the_start_up_decision_names_a_bounded_number_of_remote_steps() -> None:
    remote = set(range(1, 100_001))
    got = remote_summary(remote, {99_990, 99_995, 100_000})
    assert got == list(range(99_990, 100_001)), got
    assert len(remote_summary(remote, set())) == 8 and remote_summary(remote, set())[-1] == 100_000
    assert len(remote_summary(remote, {5})) == 256 + 0 and max(remote_summary(remote, {5})) == 100_000
    assert len(json.dumps(remote_summary(remote, {5}))) < 4096


def test_a_save_waits_for_a_deletion_of_its_baseline_in_this_process(tmp_path: Path) -> None:
    """A save that would pin a step this process is deleting waits until the deletion ends (then finds it gone)."""
    store = LocalStore(tmp_path / "root")
    write_step(store, build_step(1))
    claimed, pinned = incremental.claim(store, [1])
    assert claimed == [1] and pinned == []
    entered = threading.Event()

    def pin() -> None:
        with incremental.pins(store, (1,)):
            entered.set()

    t = threading.Thread(target=pin)
    t.start()
    assert not entered.wait(0.3), "the pin waits while the step is claimed"
    incremental.unclaim(store, [1])
    assert entered.wait(5)
    t.join(5)


def test_a_jobs_retention_keeps_a_remote_step_another_jobs_lease_pins(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Another job's upload (its lease, written here by hand) references step 1 of a remote this job's retention
    trims to its newest step: step 1 stays, without being decommitted, until the lease is gone."""
    remote = LocalStore(tmp_path / "remote", tier="remote")
    with CheckpointManager(tmp_path / "local", remote=str(tmp_path / "remote"), keep_local=1, keep_remote=1,
                           log_records=False) as mgr:
        mgr.save(1, lora_state(1))
        mgr.wait()
        remote.put_atomic("pins-other-job.json", leases.encode((1,), time.time() + 600, "other-host-7"))
        mgr.save(2, lora_state(2))
        mgr.wait()
        assert sorted(list_root(remote).steps) == [1, 2]
        assert "committed again" not in caplog.text
        remote.remove("pins-other-job.json")
        mgr.save(3, lora_state(3))
        mgr.wait()
        assert sorted(list_root(remote).steps) == [3]


def test_a_held_lease_is_refreshed_and_removed_when_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leases, "REFRESH_S", 0.05)
    store = LocalStore(tmp_path / "remote", tier="remote")
    with incremental.pins(store, (4, 7)):
        names = [n for n in store.list("") if leases.is_lease(n)]
        assert len(names) == 1
        first = leases.read(store, names[0])
        assert first is not None and first.steps == (4, 7) and first.fresh()
        deadline = time.monotonic() + 10
        while leases.read(store, names[0]).expires == first.expires:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "not refreshed"
            time.sleep(0.02)
        with incremental.pins(store, (7, 9)):
            assert leases.read(store, names[0]).steps == (4, 7, 9)  # type: ignore[union-attr]
        assert leases.read(store, names[0]).steps == (4, 7)  # type: ignore[union-attr]
    assert not [n for n in store.list("") if leases.is_lease(n)]


class _ListFails:
    """A remote whose root listing fails (after a deletion's decommit: its check cannot run)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def list(self, rel: str = "") -> list[str]:
        raise ConnectionError("injected: the listing fails")


@pytest.mark.parametrize("kind", ["s3", "posix_remote"])
def test_a_deletion_that_cannot_check_commits_the_step_again(make_store: Any, kind: str) -> None:
    store = make_store(kind)
    for step in (1, 2):
        write_step(store, build_step(step))
    with pytest.raises(ConnectionError):
        steps.delete_steps(_ListFails(store), [1], listed=[1, 2])  # type: ignore[arg-type]
    assert sorted(list_root(store).steps) == [1, 2]
    assert steps.DELETING_MANIFEST not in store.list(layout.step_dir(1))


@pytest.mark.parametrize("tier", ["local", "remote"])
def test_a_pinned_step_kept_by_a_deletion_keeps_what_it_references(tmp_path: Path, tier: str) -> None:
    _incremental_local(tmp_path / "root")  # step 2 references step 1
    store = LocalStore(tmp_path / "root", tier=tier)
    with incremental.pins(store, (2,)):
        done = steps.delete_steps(store, [1, 2])
    assert done.deleted == [] and sorted(done.held) == [1, 2], done
    assert "step 2 references its bytes" in done.held[1], done
    assert sorted(list_root(store).steps) == [1, 2, 3]
