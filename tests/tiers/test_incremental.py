"""Incremental steps (``incremental=True``): unchanged tensors are referenced in an earlier step, not written again.

Covers both tiers (the local one and the moto S3 remote), retention holding referenced steps, ``full_every``,
``verify``/``ls``/``pull``/``prune`` following references, a referenced blob corrupted (the error names the step and
the file; restore falls back to an older intact step), ``sync`` carrying bytes the remote lacks, and the manifest
checks on references. Kill-anywhere trials are in tests/reliability/test_incremental_kill.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointManager, cli
from tierckpt.cli.remote import pull_step
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import layout
from tierckpt.format.manifest import FileRecord, RankManifest, StepManifest
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.listing import list_root
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.steps import delete_step
from tierckpt.tiers.uploader import replicate_step

BASE = 1 << 20  # bytes of each frozen base tensor (float32: 256 Ki elements)


def lora_state(step: int, *, frozen_seed: int = 0) -> dict[str, Any]:
    """A frozen base of 4 MiB and small adapters (with their optimizer state) that change at every step."""
    g = torch.Generator().manual_seed(frozen_seed)
    base = {f"layer{i}.weight": torch.randn(BASE // 4, generator=g) for i in range(4)}
    a = torch.Generator().manual_seed(1000 + step)
    adapters = {f"layer{i}.lora_a": torch.randn(64, 8, generator=a) for i in range(4)}
    return {"model": {**base, **adapters}, "optim": {"exp_avg": torch.randn(4, 64, 8, generator=a)}, "step": step}


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"exp_avg": torch.zeros_like(state["optim"]["exp_avg"])}, "step": -1}


def step_files(root: Path, step: int) -> dict[str, int]:
    folder = root / layout.step_dir(step)
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.name.endswith(".safetensors")}


def manifests(store: Any, step: int) -> tuple[StepManifest, RankManifest]:
    m, rms = read_manifests(store, step)
    return m, rms[0]


def cli_json(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    rc = cli.main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_unchanged_tensors_are_referenced_and_every_step_restores(tmp_path: Path) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, incremental=True, keep_local=10, log_records=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, lora_state(step))
        mgr.wait()
        store = mgr.local
        m1, rm1 = manifests(store, 1)
        assert m1.refs == () and m1.format_version == 2, "the first step holds all its bytes (version-2 form)"
        for step in (2, 3, 4):
            m, rm = manifests(store, step)
            assert m.refs == (1,), f"step {step} references {m.refs}: the base lives in step 1 only"
            own = sum(step_files(root, step).values())
            assert own < 64 << 10, f"step {step} wrote {own} bytes of its own; only the adapters changed"
            assert m.shared_bytes == sum(step_files(root, 1).values()) and m.total_bytes - m.shared_bytes == own
            assert {f.in_step for f in rm.files} == {None, 1}
        for step in range(1, 5):  # every step restores exactly, the newest and the older ones
            state = empty_like(lora_state(step))
            assert mgr.restore(state, step=step) == step
            assert_tree_equal(state, lora_state(step), f"step {step}")
            assert_tree_equal(mgr.load(step=step).state, lora_state(step), f"load of step {step}")


def test_a_frozen_tensor_changed_by_hand_is_written(tmp_path: Path) -> None:
    """Identity is by content: a tensor that is frozen (requires_grad=False) but changed in place is saved."""
    root = tmp_path / "local"
    state = lora_state(1)
    for v in state["model"].values():
        v.requires_grad_(False)
    with CheckpointManager(root, incremental=True, keep_local=10, log_records=False) as mgr:
        mgr.save(1, state)
        mgr.wait()
        state["model"]["layer2.weight"][7] += 1.0  # by hand
        mgr.save(2, state)
        mgr.wait()
        _m, rm = manifests(mgr.local, 2)
        written = {t.name for t in rm.tensors if rm.files[t.file].in_step is None}
        assert "model.layer2.weight" in written or any("layer2.weight" in n for n in written), written
        assert not any("layer1.weight" in n for n in written), written
        got = empty_like(state)
        assert mgr.restore(got) == 2
        assert_tree_equal(got, state, "step 2")


def test_retention_keeps_referenced_steps_until_a_full_step(tmp_path: Path) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, incremental=True, full_every=3, keep_local=1, log_records=False) as mgr:
        for step in range(1, 7):
            mgr.save(step, lora_state(step))
            mgr.wait()
            steps = sorted(list_root(mgr.local).steps)
            refs = {s for s in steps for s in manifests(mgr.local, s)[0].refs}
            assert refs <= set(steps), f"after step {step}: {steps} lack referenced steps {refs}"
        # full_every=3: steps 1 and 4 are written whole; 5 and 6 reference 4, so 1-3 went
        assert sorted(list_root(mgr.local).steps) == [4, 6]
        assert manifests(mgr.local, 4)[0].refs == () and manifests(mgr.local, 6)[0].refs == (4,)
        assert not delete_step(mgr.local, 4), "a referenced step is held"
        assert (root / layout.step_dir(4) / layout.STEP_MANIFEST).exists()
        state = empty_like(lora_state(6))
        assert mgr.restore(state) == 6
        assert_tree_equal(state, lora_state(6), "step 6")


def test_corrupt_referenced_blob_names_step_and_file_and_restore_falls_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, incremental=True, full_every=2, keep_local=10, log_records=False) as mgr:
        for step in range(1, 5):  # 1 whole, 2 -> 1, 3 whole, 4 -> 3
            mgr.save(step, lora_state(step))
        mgr.wait()
    assert manifests(LocalStore(root), 4)[0].refs == (3,)
    (name, size), = step_files(root, 3).items()
    path = root / layout.step_dir(3) / name
    with open(path, "r+b") as f:  # one byte of a base tensor (the base is most of the file)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError) as err:
        from tierckpt.tiers.stream import stream_file

        _m, rm4 = manifests(LocalStore(root), 4)
        stream_file(LocalStore(root), rm4, next(i for i, f in enumerate(rm4.files) if f.in_step == 3))
    assert err.value.step == 4 and name in err.value.bad_files and layout.step_dir(3) in (err.value.path or "")
    rc, doc = cli_json("verify", str(root), capsys=capsys)
    bad = {s["step"]: s for s in doc["steps"] if not s["ok"]}
    assert rc != 0 and set(bad) == {3, 4} and all(name in s["bad_files"] for s in bad.values()), doc
    caplog.set_level(logging.WARNING)
    with CheckpointManager(root, incremental=True, full_every=2, keep_local=10, log_records=False) as mgr:
        state = empty_like(lora_state(2))
        assert mgr.restore(state) == 2, "steps 4 and 3 share the damaged file: step 2 (-> 1) is intact"
        assert_tree_equal(state, lora_state(2), "step 2")
    assert name in caplog.text and "step 4" in caplog.text.lower().replace("step=4", "step 4")


def test_corrupt_referenced_blob_in_the_remote_tier_falls_back_to_an_older_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same on the remote tier (a path remote, zstd-compressed): the damaged shared file fails both steps that
    use it there, and a remote restore falls back to the step before them."""
    root, remote_root = tmp_path / "local", tmp_path / "remote"
    kw: dict[str, Any] = {"incremental": True, "full_every": 2, "keep_local": 10, "remote_compression": "zstd",
                          "log_records": False}
    with CheckpointManager(root, remote=str(remote_root), **kw) as mgr:
        for step in range(1, 5):  # 1 whole, 2 -> 1, 3 whole, 4 -> 3 (in both tiers)
            mgr.save(step, lora_state(step))
            mgr.wait()
    remote = LocalStore(remote_root, tier="remote")
    m4, rm4 = manifests(remote, 4)
    shared = next(f for f in rm4.files if f.in_step == 3)
    assert m4.refs == (3,) and shared.compression == "zstd"
    path = remote_root / layout.step_dir(3) / shared.name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING)
    with CheckpointManager(tmp_path / "empty", remote=str(remote_root), **kw) as mgr:
        state = empty_like(lora_state(2))
        assert mgr.restore(state, source="remote") == 2
        assert_tree_equal(state, lora_state(2), "remote step 2")
    assert shared.name in caplog.text
    assert cli.main(["verify", str(remote_root)]) != 0


def test_incremental_steps_on_s3_upload_only_what_changed(tmp_path: Path, s3_bucket: str, s3_server: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    url, opts = f"{s3_bucket}/run", s3_server.storage_options()
    root = tmp_path / "local"
    with CheckpointManager(root, remote=url, storage_options=opts, incremental=True, keep_local=2, keep_remote=2,
                           log_records=False) as mgr:
        for step in range(1, 5):
            mgr.save(step, lora_state(step))
            mgr.wait()
        remote = mgr.remote
        assert remote is not None
        assert sorted(list_root(remote).steps) == [1, 3, 4], "remote step 1 is held: 3 and 4 reference it"
        for step in (3, 4):
            m, rm = manifests(remote, step)
            assert m.refs == (1,)
            own = [f for f in rm.files if f.in_step is None]
            stored = sum(remote.size(f"{layout.step_dir(step)}/{f.name}") for f in own)
            assert stored < 64 << 10, f"remote step {step} stores {stored} bytes of its own"
        state = empty_like(lora_state(4))
        assert mgr.restore(state, source="remote") == 4
        assert_tree_equal(state, lora_state(4), "remote step 4")
        # pull carries the referenced bytes: the pulled step holds all of them itself
        pulled = tmp_path / "pulled"
        pull_step(remote, LocalStore(pulled), 4)
    rc, doc = cli_json("ls", str(root), capsys=capsys)
    by = {s["step"]: s for s in doc["steps"]}
    assert rc == 0 and by[4]["refs"] == [1], by
    assert by[4]["shared_bytes"] > 4 * BASE and by[4]["own_bytes"] < 64 << 10, by[4]
    m, rm = manifests(LocalStore(pulled), 4)
    assert m.refs == () and all(f.in_step is None for f in rm.files)
    with CheckpointManager(pulled, log_records=False) as mgr:
        state = empty_like(lora_state(4))
        assert mgr.restore(state) == 4
        assert_tree_equal(state, lora_state(4), "pulled step 4")


def test_sync_carries_bytes_the_remote_lacks(tmp_path: Path) -> None:
    root, remote_root = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(root, incremental=True, keep_local=10, log_records=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, lora_state(step))
        mgr.wait()
    local, remote = LocalStore(root), LocalStore(remote_root)
    replicate_step(local, remote, 2)  # step 1 is not on the remote: its file is carried into step 2's folder
    m2, rm2 = manifests(remote, 2)
    assert m2.refs == () and all(f.in_step is None for f in rm2.files)
    assert sum(step_files(remote_root, 2).values()) > 4 * BASE
    replicate_step(local, remote, 3)  # step 3 references step 1 too, which the remote still lacks
    replicate_step(local, remote, 1)
    res = replicate_step(local, LocalStore(tmp_path / "remote2"), 1)
    assert res.bytes_written > 4 * BASE
    # with step 1 there, step 3 of another remote references it and sends only its own bytes
    res3 = replicate_step(local, LocalStore(tmp_path / "remote2"), 3)
    assert res3.bytes_written < 64 << 10 and manifests(LocalStore(tmp_path / "remote2"), 3)[0].refs == (1,)
    assert cli.main(["verify", str(remote_root)]) == 0 and cli.main(["verify", str(tmp_path / "remote2")]) == 0
    for where in (remote_root, tmp_path / "remote2"):
        with CheckpointManager(tmp_path / "x", remote=str(where), log_records=False) as mgr:
            state = empty_like(lora_state(3))
            assert mgr.restore(state, source="remote") == 3
            assert_tree_equal(state, lora_state(3), f"step 3 from {where}")
        os.rename(tmp_path / "x", tmp_path / f"x{where.name}")


def test_prune_deletes_a_referencing_step_before_the_step_it_references(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, incremental=True, full_every=2, keep_local=10, log_records=False) as mgr:
        for step in range(1, 5):  # 1 whole, 2 -> 1, 3 whole, 4 -> 3
            mgr.save(step, lora_state(step))
        mgr.wait()
    rc, doc = cli_json("prune", str(root), "--keep", "2", "--dry-run", capsys=capsys)
    assert rc == 0 and doc["would_delete"] == [1, 2], doc  # steps 3, 4 kept; 3 holds nothing of 1 or 2
    rc, doc = cli_json("prune", str(root), "--keep", "1", "--dry-run", capsys=capsys)
    assert rc == 0 and doc["would_delete"] == [1, 2], f"step 4 (kept) references step 3: {doc}"
    rc, doc = cli_json("prune", str(root), "--keep", "1", capsys=capsys)
    assert rc == 0 and doc["deleted"] == [1, 2] and doc["kept"] == [3, 4], doc
    assert sorted(list_root(LocalStore(root)).steps) == [3, 4]


def test_manifest_reference_checks() -> None:
    rec = FileRecord("r00000-p0000-abcd1234.safetensors", 100, "00", 8, in_step=3, cuts=(50, 100))
    rm = RankManifest(step=5, rank=0, world_size=1, save_id="abcd1234", files=(rec,), tensors=(), tree=None)
    raw = rm.to_bytes()
    assert RankManifest.from_bytes(raw).files[0] == rec and json.loads(raw)["format_version"] == 3

    def reseal(**change: Any) -> bytes:
        return dataclasses.replace(rm, files=(dataclasses.replace(rec, **change),)).to_bytes()

    for bad in (reseal(in_step=5), reseal(in_step=9), reseal(cuts=(50, 99)), reseal(cuts=(60, 50, 100)),
                reseal(cuts=(4, 100))):
        with pytest.raises(CorruptCheckpointError):
            RankManifest.from_bytes(bad)
    sm = StepManifest(step=5, world_size=1, save_id="abcd1234", ranks=(), total_bytes=100, refs=(3,),
                      shared_bytes=100)
    d = json.loads(sm.to_bytes())
    assert d["refs"] == [3] and d["format_version"] == 3
    for refs, shared in (((5,), 10), ((3, 3), 10), ((3,), 101), ((), 10)):
        bad = dataclasses.replace(sm, refs=refs, shared_bytes=shared)
        raw = bad.to_bytes() if refs else _with_shared(sm, shared)
        with pytest.raises(CorruptCheckpointError):
            StepManifest.from_bytes(raw)


def _with_shared(sm: StepManifest, shared: int) -> bytes:
    """A version-3 step manifest claiming shared bytes without references (only a hand-made one does)."""
    from tierckpt.format import manifest as mf

    d = mf._shallow(sm)
    d.update(ranks=[], format=mf.FORMAT + ".step", format_version=3, refs=[], shared_bytes=shared)
    return mf._seal(d)


def test_full_every_needs_incremental(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full_every"):
        CheckpointManager(tmp_path / "a", full_every=2)
    with pytest.raises(ValueError, match="full_every"):
        CheckpointManager(tmp_path / "b", incremental=True, full_every=0)
    with pytest.raises(ValueError, match="incremental"):
        CheckpointManager(tmp_path / "c", incremental=1)


def test_a_step_a_save_is_about_to_reference_is_not_deleted(tmp_path: Path) -> None:
    """The pin a save takes on its baseline's steps holds them against retention until its manifest names them."""
    from tierckpt.tiers.incremental import pins

    with CheckpointManager(tmp_path / "local", keep_local=10, log_records=False) as mgr:
        mgr.save(1, lora_state(1))
        mgr.save(2, lora_state(2))
        mgr.wait()
        with pins(mgr.local, (1,)):
            assert not delete_step(mgr.local, 1)
        assert sorted(list_root(mgr.local).steps) == [1, 2]
        assert delete_step(mgr.local, 1), "unpinned and unreferenced: deleted"
        assert sorted(list_root(mgr.local).steps) == [2]


def test_files_where_nothing_is_skipped_are_written_while_hashed(tmp_path: Path) -> None:
    """Everything changes (pretraining): after one save that hashes first, the files are written as in a full save;
    a file whose tensors stop changing is skipped again from the save after the one that notices it."""
    state = lora_state(1)
    with CheckpointManager(tmp_path / "local", incremental=True, keep_local=10, log_records=False) as mgr:
        inc = mgr.components.engine.incremental
        assert inc is not None
        for step in (1, 2, 3):
            for v in [*state["model"].values(), *state["optim"].values()]:
                v.add_(1.0)
            mgr.save(step, state)
            mgr.wait()
        assert inc.hash_first and not any(inc.hash_first.values()), inc.hash_first
        assert manifests(mgr.local, 3)[0].refs == ()
        mgr.save(4, state)  # nothing changed: written whole once more, noticed
        mgr.wait()
        assert manifests(mgr.local, 4)[0].refs == () and all(inc.hash_first.values())
        mgr.save(5, state)
        mgr.wait()
        assert manifests(mgr.local, 5)[0].refs == (4,)
        got = empty_like(state)
        assert mgr.restore(got) == 5
        assert_tree_equal(got, state, "step 5")


def test_a_restarted_job_references_the_steps_it_finds(tmp_path: Path) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, incremental=True, log_records=False) as mgr:
        mgr.save(1, lora_state(1))
    with CheckpointManager(root, incremental=True, log_records=False) as mgr:
        state = empty_like(lora_state(1))
        assert mgr.restore(state) == 1
        mgr.save(2, lora_state(2))
        mgr.wait()
        assert manifests(mgr.local, 2)[0].refs == (1,)
