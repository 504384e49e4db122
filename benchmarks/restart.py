"""A restart: a fresh process restores the newest step and takes its first checkpoint, the default restore against
``in_place=True``.

    python benchmarks/restart.py [--size-gib 2] [--rounds 6] [--out restart.json] [--markdown restart.md]

``bench.py`` times each restore on its own. At a restart the two ways of restoring move one cost between them: the
default restore (guarded: it keeps the tensors' old bytes in a state-sized staging buffer until every byte is
verified) faults that buffer in, and the first save then copies into it; ``in_place=True`` needs no such buffer,
so the first save faults its own in. This script times the pair as a restarted job meets it.

The state is saved once. Then each round, for each way in turn (the order alternates between rounds), a fresh
Python process (what a restarted job is) builds the state zero-filled (its new model and optimizer; untimed), drops
the page cache, waits for a quiet disk and opens a manager (untimed), restores the newest step and checks the step
and one tensor's sum, then, on a quiet disk, saves the next step at once: ``stall`` (until ``save`` returns) and
``durable``. Next to each process, before or after it in turn, the parent times the raw cold read of the newest
step's files (page cache dropped, quiet disk; ``O_DIRECT`` into page-aligned buffers on huge pages, faulted in
beforehand, the files split over two threads as over tierckpt's two readers): the restore's limit. Reported:
medians of every measure, the restore's pairwise median ratio to that read, and ``resume`` = restore + first stall.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import harness as h

WAYS = ("default", "in_place")
#: the tensor whose sum the child compares with the saved state's (a check that the bytes arrived, not a timing)
PROBE = ("optimizer", "master", "wte.weight")


def _probe_sum(state: dict[str, Any]) -> float:
    return float(state[PROBE[0]][PROBE[1]][PROBE[2]].double().sum())


def child(a: argparse.Namespace) -> int:
    """One restarted job: restore, then the first save; prints its timings as one JSON line."""
    tc, why = h.import_tierckpt()
    if tc is None:
        raise SystemExit(why)
    folder = Path(a.folder)
    state = h.gpt_state(int(a.size_gib * h.GiB), zeros=True)
    h.drop_caches()
    h.disk_idle(folder)
    with tc.CheckpointManager(folder, keep_local=2) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(state, in_place=a.child == "in_place")
        restore = time.perf_counter() - t0
        if step != a.expect_step or _probe_sum(state) != a.expect_sum:
            raise SystemExit(f"{a.child}: restored step {step} (sum {_probe_sum(state)!r}), expected step "
                             f"{a.expect_step} (sum {a.expect_sum!r})")
        h.disk_idle(folder)
        t0 = time.perf_counter()
        handle = mgr.save(step + 1, state)
        stall = time.perf_counter() - t0
        durable = float(handle.persisted.result())
    print(json.dumps({"restore": restore, "stall": stall, "durable": durable}))
    return 0


def run_child(way: str, folder: Path, size_gib: float, step: int, expect_sum: float) -> dict[str, float]:
    """A fresh process's restore and first save (:func:`child`); ``RuntimeError`` with its output when it fails."""
    log = folder.parent / f"{folder.name}-{way}.log"
    done = h.launch([[__file__, "--child", way, "--folder", folder, "--size-gib", size_gib, "--expect-step", step,
                      "--expect-sum", repr(expect_sum)]], [log], timeout_s=1800)
    text = log.read_text()
    log.unlink()
    if done.returncodes[0]:
        raise RuntimeError(f"restart child ({way}) failed with exit code {done.returncodes[0]}:\n{text[-3000:]}")
    return json.loads(next(ln for ln in reversed(text.splitlines()) if ln.startswith("{")))


def raw_read(folder: Path, buffers: dict[tuple[int, int], memoryview]) -> float:
    """Seconds to read the newest step's data files cold with ``O_DIRECT`` into page-aligned huge-page buffers (made
    and faulted in once per file, untimed), the files split over two threads."""
    from tierckpt.snapshot.staging import aligned_empty

    files = sorted(max(folder.glob("step-*")).glob("*.safetensors"))  # zero-padded steps: the newest sorts last
    for i, f in enumerate(files):
        if (i, f.stat().st_size) not in buffers:
            buf = aligned_empty(f.stat().st_size, pin=False, huge=True)
            buf.zero_()  # faulted in here: the read times the disk, not fresh memory
            buffers[(i, f.stat().st_size)] = memoryview(buf.numpy())
    views = [buffers[(i, f.stat().st_size)] for i, f in enumerate(files)]
    h.drop_caches()
    h.disk_idle(folder)
    t0 = time.perf_counter()
    h.parallel(lambda g: [h.direct_io(files[i], views[i], write=False) for i in range(g, len(files), 2)], 2)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--expect-step", type=int, help=argparse.SUPPRESS)
    p.add_argument("--expect-sum", type=float, help=argparse.SUPPRESS)
    a = p.parse(argv)
    if a.child:
        return child(a)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    tc = h.need_tierckpt("restart benchmark")
    scratch = h.scratch_dir(a.dir)
    folder = h.fresh_dir(scratch, "restart")
    times: dict[str, dict[str, list[float]]] = {w: {k: [] for k in ("restore", "stall", "durable", "resume", "read")}
                                                for w in WAYS}
    try:
        state = h.gpt_state(int(a.size_gib * h.GiB))
        nbytes, expect_sum = h.state_bytes(state), _probe_sum(state)
        with tc.CheckpointManager(folder, keep_local=2) as mgr:
            mgr.save(1, state)
        del state
        h.settle()
        buffers: dict[tuple[int, int], memoryview] = {}
        step = turn = 0
        for r in range(a.rounds):
            for way in h.rotate(WAYS, r):
                step, turn = step + 1, turn + 1  # each child saves the next step: the same bytes again
                read = raw_read(folder, buffers) if turn % 2 else None
                got = run_child(way, folder, a.size_gib, step, expect_sum)
                read = read if read is not None else raw_read(folder, buffers)
                for k in ("restore", "stall", "durable"):
                    times[way][k].append(got[k])
                times[way]["resume"].append(got["restore"] + got["stall"])
                times[way]["read"].append(read)
                h.log(f"round {r + 1}/{a.rounds} {way}: restore {got['restore']:.3f} s (read {read:.3f} s), first "
                      f"save stall {got['stall']:.3f} s, durable {got['durable']:.3f} s")
    finally:
        h.remove(folder)
    heads = ["restore", "restore s", "/ adjacent read (pairwise median)", "first save: stall s",
             "first save: durable s", "resume s (restore + stall)", "adjacent read s"]
    rows, summary = [], {}
    for way in WAYS:
        m = {k: h.median(v) for k, v in times[way].items()}
        pairwise = h.median([x / y for x, y in zip(times[way]["restore"], times[way]["read"], strict=True)])
        rows.append([way, f"{m['restore']:.3f}", f"{pairwise:.2f}x", f"{m['stall']:.3f}", f"{m['durable']:.3f}",
                     f"{m['resume']:.3f}", f"{m['read']:.3f}"])
        summary[way] = {"medians": m, "restore_vs_read": pairwise, "all": times[way]}
    md = h.sections([(f"A restart, {nbytes / h.GiB:.2f} GiB: a fresh process restores, then saves at once (medians "
                      f"of {a.rounds} interleaved rounds)", heads, rows)])
    print(md)
    h.finish(a, {"kind": "restart", "summary": summary, "machine": h.machine(scratch),
                 "tierckpt_version": tc.__version__, "markdown": md}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
