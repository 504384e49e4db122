"""torch.distributed.checkpoint with its own storage against DCP with tierckpt's writer, stager and reader.

    python benchmarks/dcp_compare.py [--size-mib 256] [--tensors 64] [--saves 3] [--out dcp.json]

One process, no process group, the same state for both: ``--tensors`` float32 tensors totalling ``--size-mib``.
For each side, ``--saves`` back-to-back rounds of "change the state, ``dcp.async_save``, wait until durable":

- DCP: ``FileSystemWriter(folder)`` (a folder per step, ``sync_files=True``: files fsynced) with ``async_save``'s
  default stager (a fresh CPU copy per save), loaded back with ``FileSystemReader``;
- tierckpt: ``tierckpt.dcp.StorageWriter(mgr, step)`` with ``tierckpt.dcp.Stager(mgr)`` (reused buffers), durable =
  committed on the local tier (fsynced, manifest last); loaded with ``tierckpt.dcp.StorageReader(mgr)`` (verifies
  every file first, then reads the records, each checksummed) and with ``verify=False`` (checksums while reading).

Reported per side (median over the saves; the first save, which allocates, on its own): stall (until
``async_save`` returns: staging), durable (from the call until the save's future resolves), load (one ``dcp.load``
of the newest step into the live state), and tierckpt's times over DCP's (below 1: faster). DCP's files are read
back from the page cache (written buffered just before); tierckpt's local tier writes with ``O_DIRECT`` by default,
so its load reads the disk. ``--no-direct-io`` makes both buffered.
"""

from __future__ import annotations

import json
import time
from typing import Any

import harness as h
import torch
import torch.distributed.checkpoint as dcp


def make_state(size_mib: int, tensors: int) -> dict[str, Any]:
    per = max(1, (size_mib << 20) // 4 // tensors)
    torch.manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per) for i in range(tensors)}, "step": 0}


def rounds(state: dict[str, Any], saves: int, save: Any) -> dict[str, list[float]]:
    """``saves`` rounds of: change the state, ``save(step)`` (an ``async_save``), wait until durable."""
    stall, durable = [], []
    for step in range(1, saves + 1):
        for t in state["model"].values():
            t.add_(1.0)
        state["step"] = step
        t0 = time.perf_counter()
        resp = save(step)
        stall.append(time.perf_counter() - t0)
        getattr(resp, "upload_completion", resp).result()
        durable.append(time.perf_counter() - t0)
    return {"stall_s": stall, "durable_s": durable}


def timed_load(state: dict[str, Any], reader: Any) -> float:
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=reader)
    return time.perf_counter() - t0


def summary(r: dict[str, Any]) -> dict[str, Any]:
    """The first save apart, the medians of the others, and the loads."""
    rest = slice(1, None) if len(r["stall_s"]) > 1 else slice(None)
    return {"first_stall_s": r["stall_s"][0], "first_durable_s": r["durable_s"][0],
            "stall_s": h.median(r["stall_s"][rest]), "durable_s": h.median(r["durable_s"][rest]),
            **{k: v for k, v in r.items() if k.startswith("load")}}


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__, markdown=False)
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--no-direct-io", action="store_true")
    a = p.parse(argv)
    tc = h.need_tierckpt("dcp comparison")
    import tierckpt.dcp as tdcp

    root = h.fresh_dir(h.scratch_dir(a.dir), "dcp_compare")
    state = make_state(a.size_mib, a.tensors)
    try:
        ref = rounds(state, a.saves, lambda step: dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(str(root / "dcp" / f"step-{step}"))))
        ref["load_s"] = timed_load(state, dcp.FileSystemReader(str(root / "dcp" / f"step-{a.saves}")))
        with tc.CheckpointManager(root / "tierckpt", keep_local=2, direct_io=not a.no_direct_io) as mgr:
            stager = tdcp.Stager(mgr)
            ours = rounds(state, a.saves, lambda step: dcp.async_save(
                state, storage_writer=tdcp.StorageWriter(mgr, step), async_stager=stager))
            stager.close()
            ours["load_s"] = timed_load(state, tdcp.StorageReader(mgr))
            ours["load_noverify_s"] = timed_load(state, tdcp.StorageReader(mgr, verify=False))
    finally:
        h.remove(root)
    base, ours = summary(ref), summary(ours)
    ratios = {k: ours[k] / base[k] for k in ("first_stall_s", "stall_s", "durable_s", "load_s") if base[k] > 0}
    ratios["load_noverify_s"] = ours["load_noverify_s"] / base["load_s"]
    report = {"size_mib": a.size_mib, "tensors": a.tensors, "saves": a.saves, "direct_io": not a.no_direct_io,
              "torch": torch.__version__, "dcp": base, "tierckpt": ours, "ratio_tierckpt_to_dcp": ratios}
    print(json.dumps(report, indent=2))
    h.finish(a, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
