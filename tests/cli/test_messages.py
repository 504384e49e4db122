"""What the commands say, in the CLI's own words: no internal tier name in errors or logs, ``--overwrite`` rather
than ``overwrite=True``, ``"ok"`` in every ``--json`` document, a prune without ``--keep`` that says what it needs
(and with ``--leftovers`` alone removes the leftovers only), and one way of writing a multi-rank step's ranks
whichever tier copy ``ls`` reads."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from tests._support.helpers import data_files, flip_byte, step_path
from tierckpt import CheckpointManager, cli
from tierckpt.format import hashing, layout
from tierckpt.format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from tierckpt.format.safetensors import build_header
from tierckpt.storage.base import join
from tierckpt.storage.local import LocalStore

pytestmark = pytest.mark.timeout(120)

LEFTOVER = ".tmp-step-0000000009-deadbeef"


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1-3 of a small state, step 2's data damaged, and a crashed save's leftover."""
    path = tmp_path / "ckpt"
    with CheckpointManager(path, keep_local=5) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": {"w": torch.full((64,), float(step))}})
    flip_byte(data_files(step_path(path, 2))[0])
    (path / LEFTOVER).mkdir()
    (path / LEFTOVER / "r00000-p0000-deadbeef.safetensors").write_bytes(b"\0" * 64)
    return path


def test_no_message_names_the_internal_tier(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "verify", root)
    assert rc == 1 and "step 2: CORRUPT" in out and "checksum mismatch" in out, out + err
    assert "[step 2, path " in out and "tier cli" not in out + err, out + err
    rc, out, _ = _run(capsys, "verify", root, "--json")
    assert rc == 1 and "tier cli" not in out and "[step 2, path " in out, out
    rc, out, err = _run(capsys, "inspect", root, "--step", "7")
    assert rc == 2 and "not found" in err and "[step 7, path " in err and "tier cli" not in err, err
    (step_path(root, 1) / layout.STEP_MANIFEST).write_text("{}")
    rc, out, err = _run(capsys, "inspect", step_path(root, 1))
    assert rc == 1 and "not a tierckpt.step manifest [step 1, path " in err and "tier cli" not in err, err
    flip_byte(data_files(step_path(root, 3))[0])  # no intact step: prune reports each
    rc, out, err = _run(capsys, "prune", root, "--keep", "1", "--dry-run")
    assert rc == 1 and "step 3: CORRUPT" in out and "[step 3, path " in out and "tier cli" not in out + err, out
    rc, out, err = _run(capsys, "prune", root, "--keep", "1", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 1 and len(doc["verified"]) == 3 and "[step 3, path " in out and "tier cli" not in out, doc


def test_the_log_lines_do_not_name_the_internal_tier() -> None:
    from tierckpt.cli import _LogFormatter

    record = logging.LogRecord("tierckpt.storage.commit", logging.WARNING, __file__, 1, "tier %s: recovered step %d",
                               ("cli", 3), None)
    assert _LogFormatter().format(record) == "WARNING tierckpt.storage.commit: recovered step 3"
    assert record.getMessage() == "tier cli: recovered step 3"  # other handlers see the record as it was
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "tier %s: went wrong", ("remote",), None)
    assert _LogFormatter().format(record) == "WARNING x: tier remote: went wrong"


def test_export_refuses_an_existing_export_naming_the_option(root: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "hf"
    rc, _, err = _run(capsys, "export", root, out_dir, "--step", "3")
    assert rc == 0, err
    rc, out, err = _run(capsys, "export", root, out_dir, "--step", "3")
    assert rc == 2 and not out, out
    assert err.strip() == f"tierckpt export: {out_dir} already holds an export (model.safetensors); --overwrite " \
                          "replaces it", err
    rc, _, err = _run(capsys, "export", root, out_dir, "--step", "3", "--overwrite")
    assert rc == 0, err


def test_inspect_json_says_ok_like_every_command(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "inspect", root, "--step", "3", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True and doc["step"] == 3 and doc["root"] == str(root), doc
    for argv in (["ls", root], ["verify", root, "--step", "3"]):
        rc, out, _ = _run(capsys, *argv, "--json")
        assert rc == 0 and json.loads(out)["ok"] is True, (argv, out)


@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--dry-run", "--json"]])
def test_prune_without_keep_or_leftovers_says_what_it_needs(root: Path, capsys: pytest.CaptureFixture[str],
                                                            extra: list[str]) -> None:
    before = sorted(p.name for p in root.iterdir())
    rc, out, err = _run(capsys, "prune", root, *extra)
    assert rc == 2, out + err
    assert "nothing to do" in err and "--keep N" in err and "--leftovers" in err, err
    assert "required" not in err and "usage:" not in err, err
    assert sorted(p.name for p in root.iterdir()) == before


def test_prune_leftovers_alone_deletes_and_reads_no_step(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "prune", root, "--leftovers", "--dry-run")
    assert rc == 0, out + err
    assert f"would remove leftover {root / LEFTOVER}" in out and "would delete 0 step(s) (no --keep)" in out, out
    assert "CORRUPT" not in out and (root / LEFTOVER).exists()  # no step was read: step 2's damage is not seen
    rc, out, err = _run(capsys, "prune", root, "--leftovers", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["kept"] == [1, 2, 3] and doc["deleted"] == [] and doc["verified"] == [], doc
    assert not (root / LEFTOVER).exists() and all(step_path(root, s).is_dir() for s in (1, 2, 3))
    rc, _, err = _run(capsys, "prune", root, "--keep-every", "2", "--leftovers")
    assert rc == 2 and "--keep-every K needs --keep N" in err, err
    rc, _, err = _run(capsys, "prune", root, "--keep", "0")
    assert rc == 2 and "--keep must be at least 1, got 0" in err, err


# ------------------------------------------------------------------------------------------------ ranks in `ls`
def _two_rank_step(step: int, save_id: str) -> tuple[list[RankManifest], dict[str, bytes]]:
    """Both ranks' shards of a world-size-2 step: one safetensors file and one rank manifest each."""
    rng = random.Random(step)
    rms, files = [], {}
    for rank in (0, 1):
        header = build_header([("t", "U8", (16,), 16)], {"format": "pt"})
        payload = rng.randbytes(16)
        d = hashing.digest(payload)
        fname = layout.data_file_name(rank, 0, save_id)
        files[fname] = header + payload
        rms.append(RankManifest(step=step, rank=rank, world_size=2, save_id=save_id,
                                files=(FileRecord(fname, len(header) + 16,
                                                  hashing.file_checksum([hashing.digest(header), d]), len(header)),),
                                tensors=(TensorRecord(0, "t", "state['t']", "U8", (16,), 0, len(header), 16, d.hex()),),
                                tree={"kind": "test"}, metadata=None))
    return rms, files


def _place(store: LocalStore, step: int, holds: tuple[int, ...] | None) -> None:
    """Commit a world-size-2 step holding both ranks' shards; ``holds``: the step manifest's ``holds_ranks`` (a
    node's copy lists its ranks, a remote tier's copy none)."""
    save_id = "c" * 16
    rms, files = _two_rank_step(step, save_id)
    folder = layout.step_dir(step)
    store.makedirs(folder)
    for name, data in files.items():
        store.write_bytes(join(folder, name), data)
    refs = []
    for rm in rms:
        raw = rm.to_bytes()
        ref = RankRef(rm.rank, layout.rank_manifest_name(rm.rank, save_id), len(raw), hashing.digest(raw).hex())
        store.write_bytes(join(folder, ref.name), raw)
        refs.append(ref)
    sm = StepManifest(step=step, world_size=2, save_id=save_id, ranks=tuple(refs),
                      total_bytes=sum(rm.total_bytes for rm in rms), holds_ranks=holds)
    store.write_bytes(join(folder, layout.STEP_MANIFEST), sm.to_bytes())


def test_ls_writes_a_steps_ranks_alike_for_every_copy_holding_them_all(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = tmp_path / "node0", tmp_path / "remote"
    _place(LocalStore(local, tier="local"), 4, (0, 1))  # two ranks on one node: its copy lists both
    _place(LocalStore(remote, tier="remote"), 4, None)  # the remote's copy of the same step
    lines = {}
    for where in (local, remote):
        rc, out, err = _run(capsys, "ls", where)
        assert rc == 0, out + err
        (lines[where],) = [ln for ln in out.splitlines() if ln.split()[:1] == ["4"]]
        rc, out, _ = _run(capsys, "ls", where, "--json")
        assert rc == 0 and json.loads(out)["steps"][0]["ranks_here"] is None, out
        rc, out, _ = _run(capsys, "verify", where)
        assert rc == 0 and "2 ranks, shards here: all" in out, out
    assert lines[local].endswith("2 (here: all)") and lines[remote].endswith("2 (here: all)"), lines
    # a node's copy with some ranks only still names them
    node1 = LocalStore(tmp_path / "node1", tier="local")
    _place(node1, 4, (1,))
    rc, out, _ = _run(capsys, "ls", tmp_path / "node1")
    assert rc == 0 and out.rstrip().endswith("2 (here: [1])"), out
    rc, out, _ = _run(capsys, "ls", tmp_path / "node1", "--json")
    assert json.loads(out)["steps"][0]["ranks_here"] == [1], out
