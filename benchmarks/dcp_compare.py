"""torch.distributed.checkpoint with its own storage against DCP with tierckpt's writer, stager and reader.

    python benchmarks/dcp_compare.py [--size-mib 256] [--tensors 64] [--saves 3] [--dir /tmp/dcp_compare]

One process, no process group, the same state for both: ``--tensors`` float32 tensors totalling ``--size-mib``.
For each side, ``--saves`` back-to-back rounds of "change the state, ``dcp.async_save``, wait until durable":

- DCP: ``FileSystemWriter(folder)`` (one folder per step, ``sync_files=True``: files fsync'd) with async_save's
  default stager (``DefaultStager``: a fresh CPU copy per save), loaded back with ``FileSystemReader``;
- tierckpt: ``tierckpt.dcp.StorageWriter(mgr, step)`` with ``tierckpt.dcp.Stager(mgr)`` (reused buffers), durable =
  committed on the local tier (fsync'd, manifest last); loaded with ``tierckpt.dcp.StorageReader(mgr)`` (verifies
  every file first, then reads the records, each checksummed) and with ``verify=False`` (checksums while reading).

Reported per side (median over the saves; the first save, which allocates, is reported on its own): stall (the time
``async_save`` takes to return: staging), durable (from the call until the save future resolves), load (one
``dcp.load`` of the newest step into the live state), and tierckpt's times as ratios to DCP's (below 1: faster).
Caveat: DCP's files are read back from the page cache (written buffered just before); tierckpt's local tier writes
with O_DIRECT by default, so its load reads the disk. ``--no-direct-io`` makes both buffered.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402

import tierckpt  # noqa: E402
import tierckpt.dcp  # noqa: E402


def make_state(size_mib: int, tensors: int) -> dict:
    per = max(1, (size_mib << 20) // 4 // tensors)
    torch.manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}, "step": 0}


def touch(state: dict, step: int) -> None:
    for t in state["model"].values():
        t.add_(1.0)
    state["step"] = step


def future_of(resp):
    return getattr(resp, "upload_completion", resp)


def run_dcp(state: dict, root: Path, saves: int) -> dict:
    stall, durable = [], []
    for i in range(saves):
        step = i + 1
        touch(state, step)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=FileSystemWriter(str(root / f"step-{step}")))
        stall.append(time.perf_counter() - t0)
        future_of(resp).result()
        durable.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=FileSystemReader(str(root / f"step-{saves}")))
    load = time.perf_counter() - t0
    return {"stall_s": stall, "durable_s": durable, "load_s": load}


def run_tierckpt(state: dict, root: Path, saves: int, direct_io: bool) -> dict:
    stall, durable = [], []
    with tierckpt.CheckpointManager(root, keep_local=2, direct_io=direct_io) as mgr:
        stager = tierckpt.dcp.Stager(mgr)
        for i in range(saves):
            step = i + 1
            touch(state, step)
            t0 = time.perf_counter()
            resp = dcp.async_save(state, storage_writer=tierckpt.dcp.StorageWriter(mgr, step), async_stager=stager)
            stall.append(time.perf_counter() - t0)
            future_of(resp).result()
            durable.append(time.perf_counter() - t0)
        stager.close()
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=tierckpt.dcp.StorageReader(mgr))
        load = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=tierckpt.dcp.StorageReader(mgr, verify=False))
        load_noverify = time.perf_counter() - t0
    return {"stall_s": stall, "durable_s": durable, "load_s": load, "load_noverify_s": load_noverify}


def summary(r: dict) -> dict:
    out = {"first_stall_s": r["stall_s"][0], "first_durable_s": r["durable_s"][0]}
    rest = slice(1, None) if len(r["stall_s"]) > 1 else slice(None)
    out["stall_s"] = statistics.median(r["stall_s"][rest])
    out["durable_s"] = statistics.median(r["durable_s"][rest])
    out["load_s"] = r["load_s"]
    if "load_noverify_s" in r:
        out["load_noverify_s"] = r["load_noverify_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/dcp_compare")
    ap.add_argument("--no-direct-io", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    state = make_state(args.size_mib, args.tensors)
    base = summary(run_dcp(state, root / "dcp", args.saves))
    ours = summary(run_tierckpt(state, root / "tierckpt", args.saves, direct_io=not args.no_direct_io))
    ratios = {k: ours[k] / base[k] for k in ("first_stall_s", "stall_s", "durable_s", "load_s") if base[k] > 0}
    ratios["load_noverify_s"] = ours["load_noverify_s"] / base["load_s"]
    report = {"size_mib": args.size_mib, "tensors": args.tensors, "saves": args.saves,
              "direct_io": not args.no_direct_io, "torch": torch.__version__, "dcp": base, "tierckpt": ours,
              "ratio_tierckpt_to_dcp": ratios}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
