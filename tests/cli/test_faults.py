"""The operators' CLI when storage fails or a live job shares the root (production bug reports):

- a storage failure (unreachable, silent, access denied) ends every command with exit 3 and one line naming
  the command, the URL and the cause, never a traceback and never a credential given with
  ``--storage-option``;
- ``--timeout`` bounds the wait on a silent endpoint;
- ``ls --remote`` with the remote down still prints the local listing, with a warning;
- ``verify`` next to a live job's retention reports a step deleted mid-check as removed, not corrupt;
- ``prune`` refuses a local root that a live manager holds, and ``--leftovers`` on a remote root keeps
  whatever is younger than ``--min-age`` (an upload in progress elsewhere looks exactly like a leftover).

Endpoints that fail come from :mod:`tierckpt.testing.netfaults`; the S3 server is moto on loopback (conftest).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import REPO_ROOT, subprocess_env
from tests._support.procs import run_python
from tests._support.steps import build_step, write_step
from tierckpt import CheckpointManager, cli
from tierckpt.errors import StorageError
from tierckpt.format import layout
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.testing.netfaults import DenyingServer, FaultProxy, refused_url
from tierckpt.tiers import verify as verify_mod
from tierckpt.tiers.listing import list_root
from tierckpt.tiers.steps import delete_step
from tierckpt.tiers.verify import verify_step

pytestmark = pytest.mark.timeout(300)

SECRET = "sEcReT-cli-faults-4b1e9d"
KEY_ID = "AKIA-cli-faults-key"
URL = "s3://tierckpt-faults/run"


# --- helpers ------------------------------------------------------------------------------------------------
def _creds(endpoint: str) -> list[str]:
    """Storage options naming ``endpoint``, with credentials passed only on the command line."""
    return ["--storage-option", f"client_kwargs.endpoint_url={endpoint}", "--storage-option", f"key={KEY_ID}",
            "--storage-option", f"secret={SECRET}"]


def _endpoint(s3_server: Any) -> list[str]:
    return ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m tierckpt ARGS`` with no AWS credentials in the environment; (result, seconds it took)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("AWS_")}
    t0 = time.monotonic()
    proc = run_python(["-m", "tierckpt", *args], timeout=120, env=env, cwd=REPO_ROOT)
    return proc, time.monotonic() - t0


def _run_all(calls: list[list[str]],
             workers: int = 4) -> list[tuple[subprocess.CompletedProcess[str], float]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(_run, calls))


def _main(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    """The CLI in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _local_root(path: Path, steps: tuple[int, ...] = (1,), **kw: Any) -> LocalStore:
    """A local tier root holding hand-built committed ``steps``."""
    store = LocalStore(path, tier="local")
    for s in steps:
        write_step(store, build_step(s, **kw))
    return store


def _command(cmd: str, tmp_path: Path) -> list[str]:
    """Each command's arguments with :data:`URL` as its remote (``sync`` from a local root holding step 1)."""
    if cmd == "sync":
        local = tmp_path / "local"
        if not local.exists():
            _local_root(local)
        return ["sync", str(local), URL]
    if cmd == "pull":  # a folder of its own: two pulls into one folder exclude each other (its lock)
        return ["pull", URL, str(tmp_path / f"pulled-{next(_pulls)}"), "--step", "1"]
    return {"ls": ["ls", URL], "verify": ["verify", URL], "inspect": ["inspect", URL, "--step", "1"],
            "prune": ["prune", URL, "--keep", "1"]}[cmd]


COMMANDS = ("ls", "verify", "inspect", "sync", "pull", "prune")
_pulls = itertools.count()


# --- 1. storage failures: exit 3, one line, the URL, never a secret -----------------------------------------
@pytest.mark.parametrize("kind", ["denied", "refused"])
def test_storage_failures_exit_3_in_one_line_naming_the_url_never_a_secret(tmp_path: Path, kind: str) -> None:
    """Every command against an endpoint that denies access (403) or refuses connections: exit 3 (not 1, not
    a traceback), exactly one line on stderr that names the command, the URL and the cause, nothing on stdout,
    and the secret given with ``--storage-option`` nowhere; with ``--json`` the error document instead."""
    server = DenyingServer().start() if kind == "denied" else None
    endpoint = server.url if server else refused_url()
    try:
        calls = [_command(cmd, tmp_path) + _creds(endpoint) + ["--timeout", "3"] for cmd in COMMANDS]
        calls += [_command(cmd, tmp_path) + _creds(endpoint) + ["--timeout", "3", "--json"]
                  for cmd in ("verify", "pull")]
        results = _run_all(calls)
    finally:
        if server:
            server.stop()
    cause = "access denied" if kind == "denied" else ""
    for args, (proc, seconds) in zip(calls, results):
        cmd, everything = args[0], proc.stdout + proc.stderr
        assert SECRET not in everything and KEY_ID not in everything, f"{args}: shown:\n{everything}"
        assert "Traceback" not in everything, f"{args}:\n{everything}"
        assert proc.returncode == 3, f"{args}: exit {proc.returncode}:\n{everything}"
        assert seconds < 30, f"{args}: took {seconds:.1f} s with --timeout 3"
        if "--json" in args:
            doc = json.loads(proc.stdout)
            assert doc["ok"] is False and URL in doc["error"] and cause in doc["error"], doc
            assert doc["error"].startswith(f"tierckpt {cmd}: ") and doc["url"].startswith(URL), doc
            assert not proc.stderr.strip(), f"{args}: --json printed on stderr:\n{proc.stderr}"
            continue
        lines = _lines(proc.stderr)
        assert len(lines) == 1, f"{args}: {len(lines)} lines on stderr:\n{proc.stderr}"
        assert lines[0].startswith(f"tierckpt {cmd}: ") and URL in lines[0] and cause in lines[0], lines[0]
        assert not proc.stdout.strip(), f"{args}: printed on stdout:\n{proc.stdout}"


def test_a_backend_failure_in_process_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend's own exception that reaches the CLI untranslated (here: a local listing failing with EACCES)
    is translated: exit 3 and one line naming the folder, not exit 1 or a traceback."""
    root = tmp_path / "root"
    _local_root(root)

    def denied(self: LocalStore, rel: str = "") -> list[str]:
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setattr(LocalStore, "list", denied)
    for args in (["ls", root], ["verify", root], ["prune", root, "--keep", "1"]):
        rc, out, err = _main(capsys, args)
        assert rc == 3, f"{args}: exit {rc}\n{out}{err}"
        assert _lines(err) == [err.strip()] and str(root) in err and "access denied" in err, err


# --- 2. bounded waits ---------------------------------------------------------------------------------------
def test_a_silent_endpoint_ends_within_the_timeout(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    """Through a proxy that forwards, the commands work; once it accepts and never answers, each ends with
    exit 3 within about ``--timeout 3`` (the backend's own retries and timeouts would take minutes)."""
    url = f"{s3_bucket}/run"
    store = FsspecStore(url, storage_options=s3_server.storage_options(), tier="remote")
    write_step(store, build_step(1, sizes=(1000,)))
    store.close()
    opts = s3_server.storage_options()
    creds = ["--storage-option", f"key={opts['key']}", "--storage-option", f"secret={opts['secret']}"]
    with FaultProxy(s3_server.endpoint_url) as proxy:
        ep = ["--storage-option", f"client_kwargs.endpoint_url={proxy.url}", *creds, "--timeout", "3"]
        (ok, _), = _run_all([["verify", url, *ep]])
        assert ok.returncode == 0, ok.stdout + ok.stderr
        proxy.set_mode("silent")
        calls = [["ls", url, *ep], ["verify", url, *ep], ["inspect", url, "--step", "1", *ep],
                 ["pull", url, str(tmp_path / "pulled"), "--step", "1", *ep]]
        results = _run_all(calls)
    for args, (proc, seconds) in zip(calls, results):
        assert proc.returncode == 3, f"{args}: exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"
        assert seconds < 15, f"{args}: took {seconds:.1f} s with --timeout 3"
        lines = _lines(proc.stderr)
        assert len(lines) == 1 and url in lines[0] and opts["secret"] not in proc.stderr, proc.stderr


def test_timeout_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for value in ("0", "-1", "soon"):
        rc, _, err = _main(capsys, ["ls", tmp_path, "--timeout", value])
        assert rc == 2 and "--timeout" in err, err


# --- 3. ls with the remote down -----------------------------------------------------------------------------
def test_ls_with_the_remote_down_prints_the_local_listing_and_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The local listing is printed anyway, with one warning line that names the remote and the cause; exit 3
    (the remote could not be checked). With ``--json``: the steps, ``ok`` false and the remote's error."""
    root = tmp_path / "local"
    _local_root(root, (3, 7))
    remote = ["--remote", URL, *_creds(refused_url()), "--timeout", "2"]
    t0 = time.monotonic()
    rc, out, err = _main(capsys, ["ls", root, *remote])
    assert time.monotonic() - t0 < 15
    assert rc == 3, out + err
    assert "3" in out and "7" in out and len(_lines(out)) == 3, out  # the header and both steps
    lines = _lines(err)
    assert len(lines) == 1 and "warning" in lines[0] and URL in lines[0], err
    assert SECRET not in out + err and KEY_ID not in out + err
    rc, out, err = _main(capsys, ["ls", root, *remote, "--json"])
    assert rc == 3 and not err.strip(), err
    doc = json.loads(out)
    assert doc["ok"] is False and URL in doc["remote_error"] and SECRET not in out, doc
    assert [(s["step"], s["local"], s["remote"]) for s in doc["steps"]] == [(3, True, None), (7, True, None)]


# --- 4. verify next to a live job's retention ---------------------------------------------------------------
@pytest.fixture(params=["local", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, list[str]]:
    """A store to verify (a local folder, or an S3 prefix through moto) and the CLI arguments that name it."""
    if request.param == "local":
        return LocalStore(tmp_path / "root", tier="local"), [str(tmp_path / "root")]
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    store = FsspecStore(f"{bucket}/run", storage_options=server.storage_options(), tier="remote")
    return store, [f"{bucket}/run", *_endpoint(server)]


def _hook_verify_file(monkeypatch: pytest.MonkeyPatch, before: Callable[[Any, Any, int], None]) -> None:
    """Call ``before(store, rank_manifest, index)`` ahead of each file ``verify_step`` reads (after the
    manifests)."""
    real = verify_mod.verify_file

    def hooked(store: Any, rm: Any, index: int, progress: Any = None) -> None:
        before(store, rm, index)
        real(store, rm, index, progress)

    monkeypatch.setattr(verify_mod, "verify_file", hooked)


def test_verify_reports_a_step_deleted_mid_check_as_removed(tier: tuple[Any, list[str]],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Retention deletes step 2 after verify read its manifests and before it read its files: step 2 is
    reported removed (``"removed": true``, ``ok`` not false), the exit code 0, since every step that still
    exists is intact. Step 3's data file vanishing while its manifest stays is corruption all the same
    (exit 1)."""
    store, target = tier
    for s in (1, 2, 3):
        write_step(store, build_step(s, sizes=(3000, 20)))
    _, rms3 = verify_mod.read_manifests(store, 3)
    victim = rms3[0].files[1].name

    def retention(st: Any, rm: Any, index: int) -> None:
        if rm.step == 2 and index == 0:
            delete_step(st, 2)

    _hook_verify_file(monkeypatch, retention)
    rc, out, err = _main(capsys, ["verify", *target, "--json", "--threads", "1"])
    assert rc == 0, out + err
    doc = json.loads(out)
    reports = {r["step"]: r for r in doc["steps"]}
    assert doc["ok"] is True and reports[2]["removed"] is True and reports[2]["ok"] is True, doc
    assert reports[2]["bad_files"] == [] and reports[2]["errors"] == [], reports[2]
    assert all(reports[s]["ok"] and not reports[s]["removed"] for s in (1, 3)), doc

    # again, in text, with a real loss next to it: step 3 loses a data file but keeps its manifest
    write_step(store, build_step(2, sizes=(3000, 20)))

    def retention_and_loss(st: Any, rm: Any, index: int) -> None:
        retention(st, rm, index)
        if rm.step == 3 and index == 0:
            st.remove(f"{layout.step_dir(3)}/{victim}")

    _hook_verify_file(monkeypatch, retention_and_loss)
    rc, out, err = _main(capsys, ["verify", *target, "--threads", "1"])
    assert rc == 1, out + err
    assert "step 2: removed during the check" in out and "step 3: CORRUPT" in out and victim in out, out
    assert "1 of 2 steps intact; corrupt: [3]; removed during the check: [2]" in out, out


def test_verify_reports_a_step_deleted_after_the_listing_as_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Retention deletes step 1 between verify's listing and its manifest read: removed, exit 0. A step
    folder given by hand that never had a manifest is still an error (``seen_committed`` tells them apart)."""
    root = tmp_path / "root"
    store = _local_root(root, (1, 2))
    real = verify_mod.read_manifests

    def racing(st: Any, step: int, **kw: Any) -> Any:
        if step == 1:
            delete_step(st, 1)
        return real(st, step, **kw)

    monkeypatch.setattr(verify_mod, "read_manifests", racing)
    rc, out, err = _main(capsys, ["verify", root])
    assert rc == 0, out + err
    assert "step 1: removed during the check" in out and "step 2: OK" in out, out
    monkeypatch.setattr(verify_mod, "read_manifests", real)
    staging = write_step(store, build_step(5), commit=False)  # a save that never committed...
    os.rename(root / staging, root / layout.step_dir(5))  # ...as step-5/ without manifest.json
    rc, out, err = _main(capsys, ["verify", root, "--step", "5"])
    assert rc == 1 and "removed" not in out, out + err
    assert not verify_step(store, 5).removed and not verify_step(store, 5).ok


def test_verify_storage_failure_mid_check_exits_3_not_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A data file that cannot be read because the storage fails (not because it is damaged) is no finding
    about the step: exit 3 with one line naming the URL, not "CORRUPT" and exit 1."""
    root = tmp_path / "root"
    _local_root(root, (1,))

    def failing(st: Any, rm: Any, index: int) -> None:
        raise StorageError("read: storage unreachable or failing (ConnectionResetError: reset by peer)",
                           tier=st.tier, path=f"{st.url}/{layout.step_dir(rm.step)}", transient=True)

    _hook_verify_file(monkeypatch, failing)
    rc, out, err = _main(capsys, ["verify", root])
    assert rc == 3, out + err
    assert "CORRUPT" not in out and _lines(err) == [err.strip()] and str(root) in err, out + err


def test_verify_next_to_live_retention_never_reports_corruption(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A real race: a thread deletes steps (as a live job's retention does) while ``verify`` runs,
    repeatedly. The exit code is never 1 and no step is ever reported corrupt; the race is hit (steps
    reported removed)."""
    rng = random.Random(7)
    removed_total = 0
    for round_ in range(6):
        root = tmp_path / f"r{round_}"
        store = _local_root(root, tuple(range(1, 41)), sizes=(48 << 10, 100), seed=round_)
        doomed = list(range(1, 31))
        rng.shuffle(doomed)
        go = threading.Event()

        def retention(victims: list[int] = doomed, st: LocalStore = store,
                      start: threading.Event = go) -> None:
            start.wait()
            for s in victims:
                delete_step(st, s)
                time.sleep(rng.uniform(0, 0.004))

        deleter = threading.Thread(target=retention, daemon=True)
        deleter.start()
        capsys.readouterr()
        go.set()
        rc = cli.main(["verify", str(root), "--json", "--threads", "2"])
        deleter.join(30)
        out = capsys.readouterr()
        assert rc == 0, f"round {round_}: exit {rc}\n{out.out}{out.err}"
        doc = json.loads(out.out)
        bad = [r for r in doc["steps"] if not r["ok"]]
        assert not bad, f"round {round_}: reported corrupt: {bad}"
        removed_total += sum(r["removed"] for r in doc["steps"])
        assert sorted(list_root(store).steps) == list(range(31, 41))
    assert removed_total > 0, "the deletions never overlapped a check: the race was not exercised"


# --- 5. prune next to a live job ----------------------------------------------------------------------------
def test_prune_refuses_a_root_a_live_manager_holds(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """While a CheckpointManager has the folder open, ``prune`` (with or without ``--leftovers``,
    ``--dry-run`` too) exits 3 with one line and touches nothing, not even a ``.tmp-`` leftover; once it is
    closed, the same prune removes the leftover (a local tier's lock tells that no writer is live: no
    ``--min-age`` needed)."""
    root = tmp_path / "local"
    mgr = CheckpointManager(root, keep_local=5)
    try:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((100,), float(s))})
        mgr.wait()
        leftover = root / ".tmp-step-0000000009-deadbeef"
        leftover.mkdir()
        (leftover / "r00000-p0000-deadbeef.safetensors").write_bytes(b"x" * 10)
        before = sorted(os.listdir(root))
        for extra in (["--leftovers"], ["--leftovers", "--dry-run"], [], ["--dry-run"],
                      ["--leftovers", "--json"]):
            rc, out, err = _main(capsys, ["prune", root, "--keep", "1", *extra])
            assert rc == 3, f"{extra}: exit {rc}\n{out}{err}"
            msg = json.loads(out)["error"] if "--json" in extra else err.strip()
            assert "--json" in extra or (not out.strip() and len(_lines(err)) == 1), out + err
            assert f"{root} is in use by a live CheckpointManager (ranks [0]); stop it first" in msg, msg
            assert sorted(os.listdir(root)) == before
    finally:
        mgr.close()
    rc, out, err = _main(capsys, ["prune", root, "--keep", "1", "--leftovers"])
    assert rc == 0, out + err
    assert not leftover.exists() and sorted(list_root(LocalStore(root, create=False)).steps) == [3]


def _young_uploads(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto reports every multipart upload as started on 2010-11-10 (a constant in its answer): make them a
    minute old, as a live writer's would be."""
    from tierckpt.storage import fsspec_store

    real = fsspec_store.unfinished_uploads

    def recent(fs: Any, root: str, **kw: Any) -> Any:
        return [(b, k, u, time.time() - 60) for b, k, u, _ in real(fs, root, **kw)]

    monkeypatch.setattr(fsspec_store, "unfinished_uploads", recent)


def test_prune_leftovers_on_s3_keeps_what_may_be_in_progress(s3_server: Any, s3_bucket: str, s3_admin: Any,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """On a remote root, an upload in progress elsewhere looks exactly like a leftover: a step folder without
    ``manifest.json``, a new save's files next to a committed step, an unfinished multipart upload. Younger
    than ``--min-age`` they are kept and listed as such (dry run and real run); older, they are removed."""
    url = f"{s3_bucket}/run"
    bucket = s3_bucket.removeprefix("s3://")
    ep = _endpoint(s3_server)
    store = FsspecStore(url, storage_options=s3_server.storage_options(), tier="remote")
    for s in (1, 2):
        write_step(store, build_step(s, sizes=(2000,)))
    write_step(store, build_step(3, sizes=(2000,)), commit=False)  # being uploaded: no manifest.json yet
    new_file = f"{layout.step_dir(2)}/r00000-p0000-0badcafe.safetensors"  # a new save of step 2, in progress
    store.write_bytes(new_file, b"x" * 100)
    part_key = f"run/{layout.step_dir(4)}/r00000-p0000-feedf00d.safetensors"
    s3_admin.call_s3("create_multipart_upload", Bucket=bucket, Key=part_key)
    _young_uploads(monkeypatch)

    def pending() -> list[str]:
        found = s3_admin.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        return [u["Key"] for u in found]

    def intact() -> bool:
        return store.exists(new_file) and store.list(layout.step_dir(3)) != [] and pending() == [part_key]

    for extra in (["--dry-run"], []):
        rc, out, err = _main(capsys, ["prune", url, "--keep", "5", "--leftovers", *ep, *extra])
        assert rc == 0, out + err
        assert f"kept {url}/{layout.step_dir(3)} (may be in progress; younger than --min-age)" in out, out
        upload = f"{url}/{part_key.removeprefix('run/')}"
        assert f"kept the unfinished upload of {upload} (may be in progress; younger than" in out, out
        assert "would remove" not in out and "would abort" not in out and "leftover: " not in out, out
        assert intact(), f"{extra}: something young was removed"
    rc, out, _ = _main(capsys, ["prune", url, "--keep", "5", "--leftovers", *ep, "--json"])
    doc = json.loads(out)
    assert rc == 0 and doc["leftovers"] == [] and len(doc["kept_leftovers"]) == 2 and intact(), doc

    time.sleep(2.2)  # now all of it is older than --min-age 2 (S3 stamps objects to the second)
    monkeypatch.undo()  # the uploads' real (old) start times again
    rc, out, err = _main(capsys, ["prune", url, "--keep", "5", "--leftovers", "--min-age", "2", *ep])
    assert rc == 0, out + err
    assert not store.exists(new_file) and store.list(layout.step_dir(3)) == [] and pending() == [], out
    assert sorted(list_root(store).steps) == [1, 2] and verify_step(store, 2).ok and verify_step(store, 1).ok
    store.close()


def test_prune_leftovers_on_a_posix_remote_go_by_age(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A folder without lock files is a remote tier (another host's manager uploads there with ``.tmp-``
    folders): a young ``.tmp-`` folder is kept, one untouched for two hours removed; ``--min-age 0`` takes
    all."""
    nfs = tmp_path / "nfs"
    _local_root(nfs, (1, 2))
    young, old = nfs / ".tmp-step-0000000003-0000cafe", nfs / ".tmp-step-0000000004-0000beef"
    for folder in (young, old):
        folder.mkdir()
        (folder / "r00000-p0000-0000cafe.safetensors").write_bytes(b"x" * 10)
    then = time.time() - 7200
    for p in (old / "r00000-p0000-0000cafe.safetensors", old):
        os.utime(p, (then, then))
    rc, out, err = _main(capsys, ["prune", nfs, "--keep", "5", "--leftovers", "--json"])
    assert rc == 0, out + err
    doc = json.loads(out)
    assert doc["leftovers"] == [f"removed {old.name}"], doc
    assert doc["kept_leftovers"] == [f"kept {young} (may be in progress; younger than --min-age)"], doc
    assert young.exists() and not old.exists()
    rc, out, err = _main(capsys, ["prune", nfs, "--keep", "5", "--leftovers", "--min-age", "0"])
    assert rc == 0 and not young.exists() and "kept" not in out, out + err


# --- 6. failure lines name the URL --------------------------------------------------------------------------
def test_prune_and_sync_failure_lines_name_the_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A deletion that the storage refuses is reported with the step's URL (exit 3: could not act); a step
    that cannot be replicated because the local copy is damaged is reported with the remote URL (exit 1:
    failed)."""
    from tierckpt.tiers import steps

    root = tmp_path / "nfs"
    _local_root(root, (1, 2))

    def refused(store: Any, step: int) -> None:
        raise PermissionError(13, "Permission denied", str(root / layout.step_dir(step)))

    monkeypatch.setattr(steps, "delete_step", refused)
    rc, out, err = _main(capsys, ["prune", root, "--keep", "1"])
    assert rc == 3, out + err
    assert f"step 1: FAILED to delete {root / layout.step_dir(1)}: " in err and len(_lines(err)) == 1, err
    monkeypatch.undo()

    local = tmp_path / "local"
    store = _local_root(local, (5,))
    _, rms = verify_mod.read_manifests(store, 5)
    (local / layout.step_dir(5) / rms[0].files[0].name).write_bytes(b"damaged")
    rc, out, err = _main(capsys, ["sync", local, tmp_path / "remote"])
    assert rc == 1, out + err
    assert f"step 5: FAILED to replicate to {tmp_path / 'remote' / layout.step_dir(5)}: " in err, err
