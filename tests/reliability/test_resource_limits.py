"""Sizes are checked before they are trusted: memory stays bounded by what the files really hold.

- A manifest's parse memory is bounded per byte of it: JSON that would take more than
  :data:`tierckpt.format.checks.JSON_MEMORY_PER_BYTE` bytes of objects per byte (a 48 MiB list of tiny objects
  took 1.2 GiB, 26x) is refused as corrupt before it is parsed, and a parse that still runs out of memory is
  corruption too. Under an address-space limit (``RLIMIT_AS``) restore and load fall back to the older step and
  ``tierckpt verify`` exits 1 reporting the step corrupt, never a ``MemoryError`` traceback. Saves refuse to write
  a manifest that readers would refuse.
- A data file whose claimed size is not backed by data on the disk (a sparse file claiming a 512 MiB tensor, with a
  manifest re-sealed to match) is verified by streaming it before anything of its size is allocated: load,
  export (API and CLI) and restore fall back to the older step with their peak RSS far below the claim.
- Tensor records that overlap in their file (400 records over the same 1 MiB) cannot multiply what a load
  allocates.

Every hostile manifest is re-sealed exactly as the library seals, its step manifest's reference updated, so the
parsers are what is tested, not the checksums. The memory checks run in child processes (their peak RSS, or an
``RLIMIT_AS`` set once the child has started), each in a few seconds.
"""

from __future__ import annotations

import json
import textwrap
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._support.helpers import data_files, rank_manifests, step_path, subprocess_env
from tests._support.procs import run_python
from tierckpt import CheckpointManager, CorruptCheckpointError
from tierckpt.format import hashing
from tierckpt.format.checks import JSON_MEMORY_PER_BYTE
from tierckpt.format.manifest import RankManifest, StepManifest, _seal
from tierckpt.format.tensors import TensorRecord, encode_table

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
#: what a sparse data file claims in the tests below
CLAIM = 512 * MiB


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(1 << 18, generator=g), "b": torch.randn(10, generator=g)},
            "extra": [torch.randn(4, generator=g)], "k": [seed, 2.5]}


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    """Steps 1 and 2 of a small state; the tests make step 2 hostile, step 1 is what they fall back to."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root, keep_local=5) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    return root


def _rank_dict(root: Path, step: int) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(rank_manifests(step_path(root, step))[0].read_bytes())
    return d


def _install_rank_manifest(root: Path, step: int, raw: bytes) -> None:
    """Replace the rank manifest of ``step`` with ``raw`` and re-seal manifest.json to point at these exact bytes."""
    folder = step_path(root, step)
    rank_manifests(folder)[0].write_bytes(raw)
    sm = json.loads((folder / "manifest.json").read_bytes())
    sm["ranks"][0]["size"] = len(raw)
    sm["ranks"][0]["checksum"] = hashing.digest(raw).hex()
    (folder / "manifest.json").write_bytes(_seal(sm))


def _sealed_with(d: dict[str, Any], key: str, value_json: bytes) -> bytes:
    """``d`` sealed as the library seals it, with ``d[key]`` replaced by the raw canonical JSON ``value_json``
    (spliced into the bytes, so that tens of MiB of it need not be built as Python objects first)."""
    d = dict(d)
    d.pop("checksum", None)
    d[key] = "@@SPLICE@@"
    canon = hashing.canonical_json(d).replace(b'"@@SPLICE@@"', value_json, 1)
    return b'{"checksum":"' + hashing.digest(canon).hex().encode() + b'",' + canon[1:]


def _dense(item: bytes, total: int) -> bytes:
    """A JSON list of copies of ``item`` about ``total`` bytes long."""
    return b"[" + b",".join([item] * (total // (len(item) + 1))) + b"]"


# --------------------------------------------------------------------------------------------- child processes
_CHILD = """
import ctypes, json, resource, sys, warnings
import torch
import tierckpt
from tierckpt import cli

root, op, limit_as = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX: each malloc arena reserves 64 MiB of address space

def status(field):  # of this process's own memory: ru_maxrss would start at its parent's peak (vfork + exec)
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024

def state(seed):
    return {"model": {"w": torch.zeros(1 << 18), "b": torch.zeros(10)}, "extra": [torch.zeros(4)], "k": [0, 0.0]}

mgr = None if op.startswith("cli") or op == "export" else tierckpt.CheckpointManager(root, keep_local=5)
if op == "export":
    from tierckpt.export import export_weights
if limit_as:
    resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + limit_as, resource.RLIM_INFINITY))
before = status("VmHWM")
out = {}
try:
    if op == "restore":
        out["step"] = mgr.restore(state(0))
    elif op == "restore-lax":
        out["step"] = mgr.restore({"k": [0, 0.0]}, strict=False)
    elif op == "load":
        out["step"] = mgr.load().step
    elif op == "load-extra":
        out["step"] = mgr.load(keys=["extra"]).step
    elif op == "export":
        out["step"] = export_weights(root, root + "-out").step
    elif op.startswith("cli-"):
        out["rc"] = cli.main([op[4:], root] + ([root + "-cli-out"] if op == "cli-export" else []))
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:300]
out["peak_delta"] = status("VmHWM") - before
if mgr is not None:
    mgr.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def _child(tmp_path: Path, root: Path, op: str, *, limit_as: int = 0) -> tuple[dict[str, Any], str]:
    """Run ``op`` on ``root`` in a child process (an address-space limit of ``limit_as`` bytes above what it maps
    once started, where given); returns its result and its whole output."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    proc = run_python([str(script), str(root), op, str(limit_as)], env=subprocess_env(), timeout=150)
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the child crashed ({proc.returncode}):\n{output[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result, output


# ----------------------------------------------------------------------------------------------- dense manifests
#: hostile rank manifests of 48 MiB (under the size cap), properly sealed: (JSON item repeated, address space the
#: child may add, what the fallback's message says)
DENSE = {
    # tiny objects: 26 bytes per byte, 1.2 GiB; refused before the parse
    "refused": (b'{"a":0}', 1 << 30, "to parse"),
    # short strings: within the estimate's bound, but 0.4 GiB is more than the limit: the parse runs out of memory
    "out-of-memory": (b'"abcdefgh"', 256 * MiB, "memory available"),
}


@pytest.mark.parametrize("op", ["restore", "load", "cli-verify"])
@pytest.mark.parametrize("case", list(DENSE))
def test_dense_manifest_under_an_address_space_limit_is_corruption(two_steps: Path, tmp_path: Path, op: str,
                                                                   case: str) -> None:
    """Under an address-space limit, restore and load take step 1 and verify exits 1 naming step 2: no
    MemoryError traceback (a bare MemoryError came out before)."""
    item, limit, says = DENSE[case]
    d = _rank_dict(two_steps, 2)
    _install_rank_manifest(two_steps, 2, _sealed_with(d, "metadata", _dense(item, 48 * MiB)))
    result, output = _child(tmp_path, two_steps, op, limit_as=limit)
    assert "MemoryError" not in output and "Traceback" not in output, output[-3000:]
    assert says in output, output[-3000:]
    if op == "cli-verify":
        assert result["rc"] == 1 and "step 2: CORRUPT" in output, output[-3000:]
    else:
        assert result.get("step") == 1 and "step 2" in output, output[-3000:]


@pytest.mark.parametrize("item", [b'{"a":0}', b"[]", b"{}", b'""', b'"ab"', b"[1,2]", b'{"$tensor":1}'])
def test_parse_memory_is_bounded_per_manifest_byte(two_steps: Path, item: bytes) -> None:
    """Whatever a sealed manifest holds, parsing it (or refusing it) takes at most JSON_MEMORY_PER_BYTE bytes of
    Python objects per byte of it; what would take more is refused before it is parsed."""
    raw = _sealed_with(_rank_dict(two_steps, 1), "metadata", _dense(item, 4 * MiB))
    tracemalloc.start()
    try:
        try:
            RankManifest.from_bytes(raw, step=1, digest_verified=True)
            refused = False
        except CorruptCheckpointError as exc:
            assert "memory" in str(exc) or "parse" in str(exc)
            refused = True
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= JSON_MEMORY_PER_BYTE * len(raw), f"{item!r}: {peak / len(raw):.1f} bytes per manifest byte"
    if refused:
        assert peak < len(raw), f"{item!r} was refused only after {peak} bytes were allocated"


def test_real_manifests_are_well_within_the_bound() -> None:
    """A manifest as saves write them (40,000 tensor records, a tree of key paths) parses in a third of the bound,
    so the refusal above never hits a real checkpoint; and the writer refuses what a reader would."""
    n = 40_000
    files = [{"name": "r00000-p0000-abcd1234.safetensors", "size": 4096 + 64 * n, "checksum": "0" * 32,
              "data_start": 4096, "compression": None, "stored_size": None}]
    recs = [TensorRecord(i, f"layers.{i}.weight", f"state['model']['layers.{i}.weight']", "F32", (4, 4), 0,
                         4096 + 64 * i, 64, f"{i:032x}", "torch") for i in range(n)]
    tree = {"$dict": [["model", {"$dict": [[r.name, {"$tensor": r.index}] for r in recs]}]]}
    d = {"step": 1, "rank": 0, "world_size": 1, "save_id": "abcd1234", "files": files, "tensors": encode_table(recs),
         "tree": tree, "metadata": {"loss": 1.5}, "created": 1.0, "library_version": "0", "format_version": 2,
         "hash_algorithm": hashing.ALGORITHM, "format": "tierckpt.rank"}
    raw = _seal(d)
    tracemalloc.start()
    try:
        rm = RankManifest.from_bytes(raw, step=1, digest_verified=True)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rm.tensors) == n
    assert peak <= JSON_MEMORY_PER_BYTE * len(raw) / 3, f"{peak / len(raw):.1f} bytes per manifest byte"


def test_manifest_past_the_size_cap_is_corruption(two_steps: Path) -> None:
    from tierckpt.format.manifest import MAX_MANIFEST_BYTES

    d = _rank_dict(two_steps, 2)
    _install_rank_manifest(two_steps, 2, _sealed_with(d, "metadata", b'"' + b"x" * (MAX_MANIFEST_BYTES + 1) + b'"'))
    with CheckpointManager(two_steps) as mgr:
        assert mgr.restore(_state(0)) == 1
    with pytest.raises(CorruptCheckpointError):
        StepManifest.from_bytes(b" " * (MAX_MANIFEST_BYTES + 1))


# ----------------------------------------------------------------------------------------------- sparse data files
def _claim_huge_sparse_tensor(root: Path, step: int) -> None:
    """Make ``step``'s data file claim ``model.w`` is CLAIM bytes (every other tensor of the file empty), with a
    consistent, re-sealed manifest and a sparse data file of exactly the claimed size: only the checksum (and the
    fact that the file's bytes are holes) can tell."""
    d = _rank_dict(root, step)
    f = d["files"][0]
    t = d["tensors"]
    w = t["path"].index(next(p for p in t["path"] if "'w'" in p))
    for i in range(len(t["name"])):
        if t["file"][i] == 0:
            t["shape"][i], t["nbytes"][i], t["offset"][i] = [0], 0, f["data_start"]
    t["dtype"][w], t["shape"][w], t["nbytes"][w] = "F32", [CLAIM // 4], CLAIM
    f["size"] = f["data_start"] + CLAIM
    _install_rank_manifest(root, step, _seal(d))
    with open(data_files(step_path(root, step))[0], "r+b") as fh:
        fh.truncate(f["size"])


@pytest.mark.parametrize("op", ["load", "export", "cli-export", "restore-lax"])
def test_sparse_file_claiming_a_huge_tensor_is_not_allocated(two_steps: Path, tmp_path: Path, op: str) -> None:
    _claim_huge_sparse_tensor(two_steps, 2)
    result, output = _child(tmp_path, two_steps, op)
    assert "Traceback" not in output, output[-3000:]
    if op == "cli-export":
        assert result["rc"] == 0, output[-3000:]
        assert "step 1" in output
    else:
        assert result.get("step") == 1, output[-3000:]
    assert "step 2" in output and "checksum" in output  # the fallback says which step and why
    assert result["peak_delta"] < CLAIM // 4, f"{op}: peak RSS grew by {result['peak_delta'] >> 20} MiB"


def test_overlapping_records_cannot_multiply_a_load(two_steps: Path, tmp_path: Path) -> None:
    """400 records of the same 1 MiB range of a real file, each with that range's own (correct) checksum, under a
    key loaded alone (only those ranges are read, each checked against its record): the load allocated 400 MiB from
    a 1 MiB file. Records that overlap are corruption, found before any of them is allocated."""
    d = _rank_dict(two_steps, 2)
    t = d["tensors"]
    w = next(i for i, p in enumerate(t["path"]) if "'w'" in p)
    first = len(t["name"])
    for col in t:
        t[col] = t[col] + [t[col][w]] * 400
    for pair in d["tree"]["$dict"]:
        if pair[0] == "extra":
            pair[1] = [{"$tensor": first + i} for i in range(400)]
    _install_rank_manifest(two_steps, 2, _seal(d))
    result, output = _child(tmp_path, two_steps, "load-extra")
    assert result.get("step") == 1, output[-3000:]
    assert "overlap" in output and "step 2" in output
    assert result["peak_delta"] < 100 * MiB, f"peak RSS grew by {result['peak_delta'] >> 20} MiB"


def test_save_refuses_a_manifest_no_reader_would_read(tmp_path: Path) -> None:
    """400,000 empty lists in the state: a rank manifest of 1.2 MB that would take 41 bytes per byte to parse.
    The save fails (its future and the manager's next call raise, naming why) and commits nothing."""
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root)
    try:
        handle = mgr.save(1, {"w": torch.zeros(4), "x": [[]] * 400_000})
        with pytest.raises(ValueError, match="store large lists as tensors") as ei:
            handle.persisted.result(timeout=60)
        assert "bytes per byte" in str(ei.value)
        assert mgr.latest_step() is None
    finally:
        with pytest.raises(ValueError):
            mgr.close()
    assert not [p for p in root.iterdir() if p.name.startswith(("step-", ".tmp-"))]
