"""Remote-tier CLI: ``tierckpt sync``, ``pull`` and ``prune``, and ``ls``/``verify`` on ``s3://`` URLs,
all run as real subprocesses (``python -m tierckpt``) against the moto S3 server on loopback."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import termios
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import REPO_ROOT, assert_tree_equal, cli_output, data_files, step_path, subprocess_env
from tests._support.procs import Child, start_python
from tierckpt import CheckpointManager
from tierckpt.cli import main as cli_main
from tierckpt.format import layout
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_steps
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.verify import verify_step

pytestmark = pytest.mark.timeout(180)

STEPS = (10, 20, 30, 40)
SECRET = "sEcReT-do-not-print-7f3a9c"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 257, generator=g),
        "z": torch.zeros(1 << 18),  # zeros: compresses well
        "ids": torch.randint(0, 1 << 30, (500,), generator=g),
        "meta": {"step": step},
    }


def _empty() -> dict[str, Any]:
    return {"w": torch.empty(64, 257), "z": torch.empty(1 << 18), "ids": torch.empty(500, dtype=torch.int64),
            "meta": {"step": -1}}


def _make_local(root: Path, steps: tuple[int, ...] = STEPS) -> None:
    with CheckpointManager(root, keep_local=len(steps)) as mgr:
        for s in steps:
            mgr.save(s, _state(s))


def _env(strip_aws: bool = False) -> dict[str, str]:
    env = subprocess_env()
    if strip_aws:
        for k in list(env):
            if k.startswith("AWS_"):
                del env[k]
    return env


def _popen(args: list[str], *, env: dict[str, str] | None = None, stderr: str | None = None) -> Child:
    """``python -m tierckpt ARGS`` in a child; ``stderr`` names a terminal device to write its errors to."""
    return start_python(["-m", "tierckpt", *args], env=env or _env(), cwd=REPO_ROOT, stderr=stderr)


def _run_all(calls: list[tuple[list[str], dict[str, str] | None]],
             workers: int = 3) -> list[subprocess.CompletedProcess]:
    """Run CLI calls ``workers`` at a time (each pays the interpreter and torch start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(call: tuple[list[str], dict[str, str] | None]) -> subprocess.CompletedProcess:
        args, env = call
        proc = _popen(args, env=env)
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, calls))


def _s3_store(url: str, s3_server: Any) -> FsspecStore:
    return FsspecStore(url, storage_options=s3_server.storage_options(), tier="remote")


def _run_on_pty(args: list[str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (so it draws progress bars); returns (rc, stdout, terminal)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    proc = _popen(args, stderr=os.ttyname(slave))  # it opens the terminal itself; ours stays open until it exits
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO once every end of the terminal is closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=120)
    os.close(slave)  # the reader now sees the end (EIO)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_sync_verify_ls_pull_prune_on_s3(tmp_path, s3_server, s3_bucket, s3_admin, capsys):
    local = tmp_path / "local"
    _make_local(local)
    url = f"{s3_bucket}/run"
    ep = ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]

    # sync, compressed and verified, with a progress bar on the terminal
    rc, out, tty = _run_on_pty(["sync", str(local), url, *ep, "--compression", "zstd", "--verify", "--threads", "2"])
    assert rc == 0, out + tty
    for s in STEPS:
        assert f"step {s}: uploaded to {url}/{layout.step_dir(s)}" in out
    assert "sync" in tty and "%" in tty, f"no progress bar on the terminal: {tty!r}"
    remote = _s3_store(url, s3_server)
    assert list_steps(remote) == {s: "committed" for s in STEPS}
    _, rms = read_manifests(remote, 40)
    assert all(f.compression == "zstd" and f.stored_size < f.size for f in rms[0].files)

    pulled = tmp_path / "pulled"
    creds_env = _env(strip_aws=True)  # credentials only through --storage-option
    creds = ["--storage-option", "key=testing-key", "--storage-option", f"secret={SECRET}"]
    verify, ls, pull = _run_all([
        (["verify", url, *ep, "--json"], None),
        (["-v", "ls", url, *ep, *creds, "--json"], creds_env),
        (["pull", url, str(pulled), "--step", "30", *ep, *creds], creds_env),
    ])
    assert verify.returncode == 0, cli_output(verify)
    doc = json.loads(verify.stdout)
    assert doc["ok"] and [s["step"] for s in doc["steps"]] == list(STEPS) and all(s["ok"] for s in doc["steps"])
    assert ls.returncode == 0, cli_output(ls)
    assert [(s["step"], s["state"]) for s in json.loads(ls.stdout)["steps"]] == [(s, "committed") for s in STEPS]
    for proc in (verify, ls, pull):
        assert SECRET not in cli_output(proc) and "testing-secret" not in cli_output(proc)

    # pull: a plain (decompressed) local copy that verifies and restores bit-exact
    assert pull.returncode == 0, cli_output(pull)
    pulled_store = LocalStore(pulled, tier="local")
    assert verify_step(pulled_store, 30).ok
    _, local_rms = read_manifests(pulled_store, 30)
    assert all(f.compression is None for f in local_rms[0].files)
    assert [f.checksum for f in local_rms[0].files] == [f.checksum for f in read_manifests(remote, 30)[1][0].files]
    assert not [n for n in os.listdir(pulled) if layout.is_leftover(n)]
    with CheckpointManager(pulled) as mgr:
        state = _empty()
        assert mgr.restore(state) == 30
    assert_tree_equal(state, _state(30))

    # in-process: a step the remote lacks (exit 2), a second sync (a no-op), prune's dry run (deletes nothing)
    assert cli_main(["pull", url, str(tmp_path / "nowhere"), "--step", "35", *ep]) == 2
    assert "35" in capsys.readouterr().err
    assert not (tmp_path / "nowhere" / layout.step_dir(35)).exists()
    assert cli_main(["sync", str(local), url, *ep, "--json"]) == 0
    assert [s["status"] for s in json.loads(capsys.readouterr().out)["steps"]] == ["skipped"] * len(STEPS)
    assert cli_main(["prune", url, "--keep", "1", "--keep-every", "20", "--dry-run", *ep, "--json"]) == 0
    dry_doc = json.loads(capsys.readouterr().out)
    assert dry_doc["would_delete"] == [10, 30] and dry_doc["deleted"] == [] and dry_doc["kept"] == [20, 40]
    assert list_steps(remote) == {s: "committed" for s in STEPS}
    real = _run_all([(["prune", url, "--keep", "1", "--keep-every", "20", *ep], None)])[0]
    assert real.returncode == 0, cli_output(real)
    assert "deleted step 10" in real.stdout and "deleted step 30" in real.stdout
    assert list_steps(remote) == {20: "committed", 40: "committed"}
    assert not s3_admin.exists(f"{url}/{layout.step_dir(30)}".removeprefix("s3://") + "/manifest.json")
    assert verify_step(remote, 40).ok and verify_step(remote, 20).ok
    remote.close()


def test_damaged_remote_and_failed_sync_exit_codes(tmp_path, s3_server, s3_bucket, s3_admin, capsys):
    local = tmp_path / "local"
    _make_local(local, (1, 2))
    url = f"{s3_bucket}/run"
    ep = ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]
    remote = _s3_store(url, s3_server)
    from tierckpt.tiers.uploader import replicate_step

    for s in (1, 2):
        replicate_step(LocalStore(local, tier="local"), remote, s, compression="zstd" if s == 2 else None)
    # flip bytes inside step 2's (compressed) data object and step 1's plain one
    for s in (1, 2):
        _, rms = read_manifests(remote, s)
        key = f"{url}/{layout.step_dir(s)}/{rms[0].files[0].name}".removeprefix("s3://")
        raw = bytearray(s3_admin.cat_file(key))
        raw[len(raw) // 2] ^= 0xFF
        s3_admin.pipe_file(key, bytes(raw))

    # a second local root whose step 6 is truncated: sync reports it and still uploads step 5 and 7
    bad_local = tmp_path / "bad"
    _make_local(bad_local, (5, 6, 7))
    victim = data_files(step_path(bad_local, 6))[0]
    os.truncate(victim, victim.stat().st_size // 2)
    url2 = f"{s3_bucket}/other"

    verify, sync = _run_all([(["verify", url, *ep], None), (["sync", str(bad_local), url2, *ep], None)])
    assert verify.returncode == 1, cli_output(verify)
    assert "step 1: CORRUPT" in verify.stdout and "step 2: CORRUPT" in verify.stdout
    for step, d in ((1, tmp_path / "into1"), (2, tmp_path / "into2")):
        assert cli_main(["pull", url, str(d), "--step", str(step), *ep, "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["ok"] is False and "corrupt" in doc["error"], doc
        assert not [n for n in os.listdir(d) if n.startswith("step-") or layout.is_leftover(n)]

    assert sync.returncode == 1, cli_output(sync)
    assert "step 6: FAILED" in sync.stderr and f"{url2}/{layout.step_dir(6)}" in sync.stderr, sync.stderr
    assert victim.name in sync.stderr  # the damaged local file is named
    remote2 = _s3_store(url2, s3_server)
    assert list_steps(remote2).get(5) == "committed" and list_steps(remote2).get(7) == "committed"
    assert list_steps(remote2).get(6) != "committed"
    remote.close()
    remote2.close()


@pytest.mark.parametrize("flag", [[], ["--no-direct-io"]], ids=["direct", "buffered"])
def test_sync_writes_a_posix_remote_around_the_page_cache(tmp_path, flag):
    """``tierckpt sync`` to a path writes the data files ``O_DIRECT`` from its reused buffer, as the manager does,
    unless ``--no-direct-io``; either way the remote step verifies and restores exactly."""
    from tests._support.helpers import cached_fraction, direct_io_supported
    from tierckpt.storage.local import DIRECT_ALIGN

    if not direct_io_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    local, nfs = tmp_path / "local", tmp_path / "nfs"
    state = {"w": torch.randn(1 << 21, generator=torch.Generator().manual_seed(3))}  # 8 MiB: one data file
    with CheckpointManager(local) as mgr:
        mgr.save(1, state)
    assert cli_main(["sync", str(local), str(nfs), *flag]) == 0
    big = max(data_files(step_path(nfs, 1)), key=lambda f: f.stat().st_size)
    size = big.stat().st_size
    cached = cached_fraction(big, size - size % DIRECT_ALIGN)
    assert cached < 0.5 if not flag else cached > 0.5, cached
    assert verify_step(LocalStore(nfs, create=False), 1).ok
    out = {"w": torch.zeros_like(state["w"])}
    with CheckpointManager(tmp_path / "fresh", remote=nfs) as mgr:
        assert mgr.restore(out, source="remote") == 1
    assert torch.equal(out["w"], state["w"])


def test_posix_remote_sync_pull_prune_in_process(tmp_path, capsys):
    """The same commands on a POSIX remote folder, through ``cli.main`` in-process (usage errors and protections)."""
    local, nfs, back = tmp_path / "local", tmp_path / "nfs", tmp_path / "back"
    _make_local(local, (1, 2, 3))
    assert cli_main(["sync", str(local), str(nfs)]) == 0
    assert list_steps(LocalStore(nfs, tier="remote", create=False)) == {1: "committed", 2: "committed", 3: "committed"}
    # a step folder as LOCAL syncs only that step
    assert cli_main(["sync", str(step_path(local, 2)), str(tmp_path / "one")]) == 0
    assert list_steps(LocalStore(tmp_path / "one", create=False)) == {2: "committed"}
    assert cli_main(["pull", str(nfs), str(back), "--step", "2"]) == 0
    assert verify_step(LocalStore(back, create=False), 2).ok
    # a live manager holds the local root: pull refuses rather than racing it (3: in use by a live job)
    with CheckpointManager(back):
        assert cli_main(["pull", str(nfs), str(back), "--step", "3"]) == 3
    assert not (back / layout.step_dir(3)).exists()
    # a local copy from another save of step 2 is never silently replaced; --force replaces it
    other = tmp_path / "other"
    with CheckpointManager(other) as mgr:
        mgr.save(2, _state(99))
    capsys.readouterr()
    assert cli_main(["pull", str(nfs), str(other), "--step", "2"]) == 2
    assert "--force" in capsys.readouterr().err
    with CheckpointManager(other) as mgr:
        state = _empty()
        assert mgr.restore(state) == 2
    assert_tree_equal(state, _state(99))
    assert cli_main(["pull", str(nfs), str(other), "--step", "2", "--force"]) == 0
    with CheckpointManager(other) as mgr:
        state = _empty()
        assert mgr.restore(state) == 2
    assert_tree_equal(state, _state(2))
    # pulling over a damaged local copy of the same save repairs it
    victim = data_files(step_path(other, 2))[0]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    assert not verify_step(LocalStore(other, create=False), 2).ok
    assert cli_main(["pull", str(nfs), str(other), "--step", "2"]) == 0
    assert verify_step(LocalStore(other, create=False), 2).ok
    capsys.readouterr()
    # usage errors
    assert cli_main(["prune", str(nfs), "--keep", "0"]) == 2
    assert cli_main(["pull", str(nfs), "s3://bucket/x", "--step", "1"]) == 2
    assert cli_main(["pull", str(nfs), str(back)]) == 2
    assert cli_main(["sync", str(tmp_path / "missing"), str(nfs)]) == 2
    assert cli_main(["prune", str(step_path(nfs, 1)), "--keep", "1"]) == 2
    # prune never deletes the newest intact step: damage step 3's manifest, keep 1 -> 2 survives (exit 1: the
    # corrupt step 3 was found)
    good_manifest = (nfs / layout.step_dir(3) / "manifest.json").read_bytes()
    (nfs / layout.step_dir(3) / "manifest.json").write_bytes(b"{}")
    capsys.readouterr()
    assert cli_main(["prune", str(nfs), "--keep", "1", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["deleted"] == [1] and doc["kept"] == [2, 3] and doc["newest_intact"] == 2
    (nfs / layout.step_dir(3) / "manifest.json").write_bytes(good_manifest)  # repaired: later prunes exit 0
    assert sorted(os.listdir(nfs)) == [layout.step_dir(2), layout.step_dir(3)]
    # leftovers of an unfinished upload go only with --leftovers (listed by the dry run, kept otherwise); this
    # one is seconds old, so only --min-age 0 takes it (a writer on another host may still be uploading it)
    (nfs / ".tmp-step-0000000009-deadbeef").mkdir()
    (nfs / ".tmp-step-0000000009-deadbeef" / "r00000-p0000-deadbeef.safetensors").write_bytes(b"x" * 10)
    capsys.readouterr()
    assert cli_main(["prune", str(nfs), "--keep", "5", "--leftovers", "--dry-run", "--min-age", "0"]) == 0
    assert "would remove leftover" in capsys.readouterr().out
    assert cli_main(["prune", str(nfs), "--keep", "5"]) == 0
    assert (nfs / ".tmp-step-0000000009-deadbeef").exists()
    capsys.readouterr()
    assert cli_main(["prune", str(nfs), "--keep", "5", "--leftovers", "--min-age", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["leftovers"]
    assert sorted(os.listdir(nfs)) == [layout.step_dir(2), layout.step_dir(3)]
