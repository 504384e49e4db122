"""Corruption matrix: for the local tier, a POSIX remote tier and S3 (moto), each file kind (data file, the
safetensors header region of a data file, the rank manifest, manifest.json) damaged each way (bit flip, truncation,
deletion, zero-fill, the same file from another step swapped in), plus a junk file added to a step folder.

Every damaged step must be reported by ``tierckpt verify`` naming the damaged file, refused by ``restore(step=k)``
with CorruptCheckpointError, and skipped by ``restore()`` (which must fall back to the one intact step). A junk file
is only a warning naming it; the step still verifies and restores. Deleting manifest.json un-commits the step (by
definition: committed iff manifest.json is there): verify lists the folder as a leftover, restore(step=k) raises
CheckpointNotFoundError.

Each tier holds one intact step (1, with the junk file) and one damaged step per case, built and verified once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import secrets
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import assert_tree_equal
from tierckpt import CheckpointManager, CheckpointNotFoundError, CorruptCheckpointError, cli

pytestmark = pytest.mark.timeout(240)

KINDS = ["data", "header", "rank_manifest", "manifest"]
OPS = ["bitflip", "truncate", "delete", "zerofill", "swap"]
#: the header of another step of the same state is byte-identical (same plan), so swapping it is no damage at all;
#: deleting "the header" is deleting the data file (covered by data/delete).
CASES = [(k, o) for k in KINDS for o in OPS if not (k == "header" and o in ("delete", "swap"))]
TIERS = ["local", "posix_remote", "s3"]
LONG = os.environ.get("TIERCKPT_LONG") == "1"
#: S3 (moto) costs ~0.5 s per uploaded step: the normal suite runs one case per file kind there, TIERCKPT_LONG=1 all.
#: (The newest step is also the one kept locally: a fresh manager re-uploads it if its remote manifest.json is
#: missing, which is right, so manifest/delete must not come last.)
S3_CASES = CASES if LONG else [("data", "bitflip"), ("header", "zerofill"), ("manifest", "delete"),
                               ("rank_manifest", "swap"), ("manifest", "truncate")]
COUNTS: Counter[str] = Counter()


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "n": {"step": step, "t": (1, 2.5)}}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(4096), "b": torch.zeros(33, dtype=torch.bfloat16), "n": {"step": -1, "t": (0, 0.0)}}


class Files:
    """Byte-level access to one tier's root (a POSIX folder or an S3 prefix)."""

    def __init__(self, root: str, fs: Any = None) -> None:
        self.root, self.fs = root.rstrip("/"), fs

    def ls(self, folder: str) -> list[str]:
        if self.fs is None:
            return sorted(p.name for p in Path(self.root, folder).iterdir())
        return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.root}/{folder}", detail=False, refresh=True))

    def read(self, rel: str) -> bytes:
        return Path(self.root, rel).read_bytes() if self.fs is None else self.fs.cat_file(f"{self.root}/{rel}")

    def write(self, rel: str, data: bytes) -> None:
        if self.fs is None:
            Path(self.root, rel).write_bytes(data)
        else:
            self.fs.pipe_file(f"{self.root}/{rel}", data)

    def delete(self, rel: str) -> None:
        if self.fs is None:
            Path(self.root, rel).unlink()
        else:
            self.fs.rm_file(f"{self.root}/{rel}")


def _folder(step: int) -> str:
    return f"step-{step:010d}"


def _target(files: Files, step: int, kind: str) -> str:
    names = files.ls(_folder(step))
    if kind in ("data", "header"):
        pick = [n for n in names if n.endswith(".safetensors")]
    elif kind == "rank_manifest":
        pick = [n for n in names if n.startswith("r") and n.endswith(".manifest.json")]
    else:
        pick = ["manifest.json"]
    assert len(pick) == 1, f"{kind}: {names}"
    return pick[0]


def _corrupt(files: Files, step: int, kind: str, op: str, donor: int) -> str:
    """Damage one file of ``step``; returns its name."""
    name = _target(files, step, kind)
    rel = f"{_folder(step)}/{name}"
    raw = bytearray(files.read(rel))
    if kind == "header":
        (n,) = struct.unpack("<Q", raw[:8])
        lo, hi = 8, 8 + n
    else:
        lo, hi = 0, len(raw)
    if op == "bitflip":
        i = hi - 3 if kind == "data" else lo + (hi - lo) // 3
        raw[i] ^= 0x10
        files.write(rel, bytes(raw))
    elif op == "truncate":
        files.write(rel, bytes(raw[: 20 if kind == "header" else len(raw) // 2]))
    elif op == "delete":
        files.delete(rel)
    elif op == "zerofill":
        raw[lo:hi] = bytes(hi - lo)
        files.write(rel, bytes(raw))
    elif op == "swap":
        files.write(rel, files.read(f"{_folder(donor)}/{_target(files, donor, kind)}"))
    else:  # pragma: no cover
        raise ValueError(op)
    return name


@dataclass
class Built:
    tier: str
    local: Path
    remote: str | None
    storage_options: dict | None
    damaged: dict[tuple[str, str], tuple[int, str]]  # case -> (step, damaged file name)
    junk: str
    verify_rc: int
    verify: dict[str, Any]
    mgr: Any = None


def _cli_verify(root: str, storage_options: dict | None) -> tuple[int, dict[str, Any]]:
    args = ["verify", root, "--json"]
    if storage_options:
        args += ["--storage-option", f"key={storage_options['key']}", "--storage-option",
                 f"secret={storage_options['secret']}", "--storage-option",
                 f"client_kwargs.endpoint_url={storage_options['client_kwargs']['endpoint_url']}"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(args)
    return rc, json.loads(out.getvalue())


def _build(tier: str, base: Path, request: pytest.FixtureRequest) -> Built:
    local = base / "local"
    remote: str | None = None
    storage_options = None
    fs = None
    if tier == "posix_remote":
        remote = str(base / "remote")
    elif tier == "s3":
        server = request.getfixturevalue("s3_server")
        fs = request.getfixturevalue("s3_admin")
        bucket = f"tierckpt-rel-{secrets.token_hex(4)}"
        fs.mkdir(bucket)
        remote, storage_options = f"s3://{bucket}/ckpt", server.storage_options()
    cases = S3_CASES if tier == "s3" else CASES
    n_steps = 1 + len(cases)
    with CheckpointManager(local, remote=remote, storage_options=storage_options,
                           keep_local=n_steps if remote is None else 1, keep_remote=None,
                           max_upload_backlog=n_steps) as mgr:  # every step reaches the remote, however fast saved
        for step in range(1, n_steps + 1):
            mgr.save(step, _state(step))
        mgr.wait()
    files = Files(str(local) if remote is None else remote.removeprefix("s3://"), fs)
    damaged = {}
    for i, (kind, op) in enumerate(cases):
        step = i + 2
        damaged[(kind, op)] = (step, _corrupt(files, step, kind, op, donor=step + 1 if step < n_steps else 2))
    junk = "notes.txt"
    files.write(f"{_folder(1)}/{junk}", b"someone left this here\n")
    rc, report = _cli_verify(str(local) if remote is None else remote, storage_options)
    return Built(tier, local, remote, storage_options, damaged, junk, rc, report)


@pytest.fixture(scope="module", params=TIERS)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    b = _build(request.param, tmp_path_factory.mktemp(request.param), request)
    # one manager per tier for all the restores (a fresh one per test would pay S3 start-up each time)
    b.mgr = CheckpointManager(b.local, remote=b.remote, storage_options=b.storage_options,
                              keep_local=100 if b.remote is None else 1)
    yield b
    b.mgr.close()


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    print(f"\ncorruption matrix counts: {dict(sorted(COUNTS.items()))}")


@contextlib.contextmanager
def _manager(b: Built):
    yield b.mgr


def _source(b: Built) -> str:
    return "local" if b.remote is None else "remote"


def test_verify_names_every_damaged_file(built: Built) -> None:
    assert built.verify_rc == 1, built.verify
    reports = {r["step"]: r for r in built.verify["steps"]}
    for (kind, op), (step, name) in built.damaged.items():
        if (kind, op) == ("manifest", "delete"):
            assert step not in reports, f"{built.tier}: a step without manifest.json is reported as committed"
            assert any(_folder(step) in x for x in built.verify["incomplete"]), built.verify["incomplete"]
        else:
            r = reports[step]
            assert not r["ok"], f"{built.tier} {kind}/{op}: verify passed a damaged step: {r}"
            assert name in r["bad_files"], f"{built.tier} {kind}/{op}: bad_files {r['bad_files']} lack {name}"
        COUNTS[f"verify detected ({built.tier})"] += 1
    one = reports[1]
    assert one["ok"] and one["extra_files"] == [built.junk], f"{built.tier}: junk file not warned about: {one}"
    COUNTS[f"verify warned junk ({built.tier})"] += 1


def test_restore_falls_back_past_every_damaged_step(built: Built, caplog: pytest.LogCaptureFixture) -> None:
    with _manager(built) as mgr:
        state = _empty()
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            got = mgr.restore(state, source=_source(built))
    assert got == 1, f"{built.tier}: restore picked {got}"
    assert_tree_equal(state, _state(1), f"{built.tier}: step 1")
    warned = "\n".join(r.getMessage() for r in caplog.records)
    for (kind, op), (_step, name) in built.damaged.items():
        if (kind, op) != ("manifest", "delete"):
            assert name in warned, f"{built.tier} {kind}/{op}: no fallback warning names {name}"
            COUNTS[f"restore fell back ({built.tier})"] += 1


@pytest.mark.parametrize(("kind", "op"), CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_restore_explicit_damaged_step_raises(built: Built, kind: str, op: str) -> None:
    if (kind, op) not in built.damaged:
        pytest.skip("S3 runs one case per file kind (TIERCKPT_LONG=1 runs them all)")
    step, name = built.damaged[(kind, op)]
    with _manager(built) as mgr:
        state = _empty()
        want = CheckpointNotFoundError if (kind, op) == ("manifest", "delete") else CorruptCheckpointError
        with pytest.raises(want) as ei:
            mgr.restore(state, step=step, source=_source(built))
        if want is CorruptCheckpointError:
            assert name in ei.value.bad_files or name in str(ei.value), f"{ei.value!r} does not name {name}"
        assert_tree_equal(state, _empty(), "state untouched")
    COUNTS[f"explicit restore refused ({built.tier})"] += 1


def test_junk_file_step_restores(built: Built) -> None:
    with _manager(built) as mgr:
        state = _empty()
        assert mgr.restore(state, step=1, source=_source(built)) == 1
    assert_tree_equal(state, _state(1), "step 1 with a junk file")

