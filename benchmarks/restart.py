"""A restart: a fresh process restores the newest step and takes its first checkpoint, the default restore against
``in_place=True``.

    python benchmarks/restart.py [--size-gib 2] [--rounds 6] [--out restart.json] [--markdown restart.md]

``bench.py`` times each restore on its own. At a restart the two ways of restoring move one cost between them: the
default restore (guarded: it keeps the tensors' old bytes in a state-sized staging buffer until every byte is
verified) faults that buffer in, and the first save then copies into it; ``in_place=True`` needs no such buffer,
so the first save faults its own in. This script times the pair as a restarted job meets it.

The state is saved once. Then each round, for each way in turn (the order alternates between rounds), a fresh
Python process (what a restarted job is):

1. builds the state's tensors zero-filled (the restarted job's new model and optimizer; untimed);
2. drops the page cache, waits for a quiet disk and opens a manager over the folder (untimed);
3. restores the newest step (``restore``: default or ``in_place=True``), checks the step and one tensor's sum;
4. on a quiet disk, saves the next step at once: ``stall`` (until ``save`` returns) and ``durable``.

Next to each process, before or after it in turn, the parent times the raw cold read of the newest step's files
(page cache dropped, quiet disk; ``O_DIRECT`` into page-aligned buffers on huge pages, faulted in beforehand,
the files split over two threads as over tierckpt's two readers): the restore's limit. Reported: medians of every
measure, the restore's pairwise median ratio to that read, and ``resume`` = restore + first stall (training blocked
from the restore's start to its first checkpoint taken).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    GiB,
    add_output_args,
    disk_idle,
    drop_caches,
    emit_table,
    fresh_dir,
    import_tierckpt,
    markdown_table,
    median,
    parallel,
    read_file_direct,
    remove,
    scratch_dir,
    settle,
)
from state import gpt_state, state_bytes, zero_state

WAYS = ("default", "in_place")
#: the tensor whose sum the child compares with the saved state's (a check that the bytes arrived, not a timing)
PROBE = ("optimizer", "master", "wte.weight")


def _probe_sum(state: dict[str, Any]) -> float:
    t = state[PROBE[0]][PROBE[1]][PROBE[2]]
    return float(t.double().sum())


def child(a: argparse.Namespace) -> int:
    """One restarted job: restore, then the first save; prints its timings as one JSON line."""
    tc, why = import_tierckpt()
    if tc is None:
        raise SystemExit(why)
    folder = Path(a.folder)
    state = zero_state(int(a.size_gib * GiB))
    drop_caches()
    disk_idle(folder)
    with tc.CheckpointManager(folder, keep_local=2) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(state, in_place=a.child == "in_place")
        restore = time.perf_counter() - t0
        if step != a.expect_step or _probe_sum(state) != a.expect_sum:
            raise SystemExit(f"{a.child}: restored step {step} (sum {_probe_sum(state)!r}), expected step "
                             f"{a.expect_step} (sum {a.expect_sum!r})")
        disk_idle(folder)
        t0 = time.perf_counter()
        handle = mgr.save(step + 1, state)
        stall = time.perf_counter() - t0
        durable = float(handle.persisted.result())
    print(json.dumps({"restore": restore, "stall": stall, "durable": durable}))
    return 0


def raw_read(folder: Path, buffers: dict[tuple[int, int], memoryview]) -> float:
    """Seconds to read the newest step's data files cold with ``O_DIRECT`` into page-aligned huge-page buffers
    (made and faulted in once per file, untimed), the files split over two threads."""
    from tierckpt.snapshot.staging import aligned_empty  # the memory tierckpt reads into

    newest = max(folder.glob("step-*"))  # zero-padded step numbers: the newest sorts last
    files = sorted(newest.glob("*.safetensors"))
    views = []
    for i, f in enumerate(files):
        size = f.stat().st_size
        if (i, size) not in buffers:
            buf = aligned_empty(size, pin=False, huge=True)
            buf.zero_()  # faulted in here: the read times the disk, not fresh memory
            buffers[(i, size)] = memoryview(buf.numpy())
        views.append(buffers[(i, size)])
    drop_caches()
    disk_idle(folder)
    t0 = time.perf_counter()
    parallel(lambda g: [read_file_direct(files[i], views[i]) for i in range(g, len(files), 2)], 2)
    return time.perf_counter() - t0


def run_child(way: str, folder: Path, size_gib: float, step: int, expect_sum: float) -> dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", way, "--folder", str(folder), "--size-gib",
           str(size_gib), "--expect-step", str(step), "--expect-sum", repr(expect_sum)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"restart child ({way}) failed with exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--expect-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--expect-sum", type=float, help=argparse.SUPPRESS)
    add_output_args(p)
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    tc, why = import_tierckpt()
    if tc is None:
        print(f"restart benchmark skipped: {why}")
        return 0
    scratch = scratch_dir(a.dir)
    folder = fresh_dir(scratch, "restart")
    keys = ("restore", "stall", "durable", "resume", "read")
    times: dict[str, dict[str, list[float]]] = {w: {k: [] for k in keys} for w in WAYS}
    try:
        state = gpt_state(int(a.size_gib * GiB))
        nbytes, expect_sum = state_bytes(state), _probe_sum(state)
        with tc.CheckpointManager(folder, keep_local=2) as mgr:
            mgr.save(1, state)
        del state
        settle()
        buffers: dict[tuple[int, int], memoryview] = {}
        step, turn = 1, 0
        for r in range(a.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                read_first = turn % 2 == 0
                turn += 1
                read = raw_read(folder, buffers) if read_first else None
                got = run_child(way, folder, a.size_gib, step, expect_sum)
                step += 1  # the child saved the next step: the same bytes again
                if read is None:
                    read = raw_read(folder, buffers)
                for k in ("restore", "stall", "durable"):
                    times[way][k].append(got[k])
                times[way]["resume"].append(got["restore"] + got["stall"])
                times[way]["read"].append(read)
                print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}/{a.rounds} {way}: restore {got['restore']:.3f} s "
                      f"(read {read:.3f} s), first save stall {got['stall']:.3f} s, durable {got['durable']:.3f} s",
                      file=sys.stderr, flush=True)
    finally:
        remove(folder)
    heads = ["restore", "restore s", "/ adjacent read (pairwise median)", "first save: stall s",
             "first save: durable s", "resume s (restore + stall)", "adjacent read s"]
    rows = []
    summary: dict[str, Any] = {}
    for way in WAYS:
        m = {k: median(v) for k, v in times[way].items()}
        pairwise = median([x / y for x, y in zip(times[way]["restore"], times[way]["read"], strict=True)])
        rows.append([way, f"{m['restore']:.3f}", f"{pairwise:.2f}x", f"{m['stall']:.3f}", f"{m['durable']:.3f}",
                     f"{m['resume']:.3f}", f"{m['read']:.3f}"])
        summary[way] = {"medians": m, "restore_vs_read": pairwise, "all": times[way]}
    title = (f"#### A restart, {nbytes / GiB:.2f} GiB: a fresh process restores, then saves at once "
             f"(medians of {a.rounds} interleaved rounds)")
    emit_table(a, "restart", f"{title}\n\n{markdown_table(heads, rows)}", scratch, tc, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
