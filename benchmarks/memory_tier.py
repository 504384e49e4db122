"""Restore time after a process crash: the memory tier (``memory_tier=True``) against the local disk (warm and cold
page cache) and against the limits of the same bytes: a memcpy of them into the state's tensors (from private
memory, and from the memory tier's own shared-memory file) and a raw read of the step's data files.

One training process saves the benchmark state once with ``memory_tier=True`` and is SIGKILLed. Then, per round
and in rotated order, each case runs in a fresh process (as a restarted job would): it builds a zero-filled state of
the same layout (pages touched before any timing) and times only its restore or copy. ``memory``: a manager with
the memory tier restores the step from shared memory, every byte verified; ``disk warm`` / ``disk cold``: a manager
without it restores from the local folder with its files in the page cache or dropped from it (``posix_fadvise``);
``memcpy`` / ``memcpy shm``: tierckpt's native copy of every tensor's bytes into the state from a private buffer
faulted in before / from the slot file mapped afresh (``MAP_POPULATE``; the timer stops before it is unmapped, as
the memory restore returns before its mapping is unmapped, on a thread of its own); ``read warm`` / ``read cold``:
the data files read into one buffer (buffered, and ``O_DIRECT`` after dropping them). The first round also checks
that the state restored from memory equals the saved one.

Each case reports its wall time and the CPU time of its process (every thread, user and system): on a busy
machine the wall times of sub-second cases spread widely, their CPU times much less. ``x memcpy shm (per round)``
is the median of each round's ratio to the same round's copy out of the fresh mapping.

    .venv/bin/python benchmarks/memory_tier.py --gib 1 --rounds 5
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h
import numpy as np

CASES = ("memory", "disk warm", "disk cold", "memcpy", "memcpy shm", "read warm", "read cold")


class _Clock:
    """Wall seconds and the process's CPU seconds (every thread's, user and system) from :meth:`start`."""

    def start(self) -> None:
        self.cpu, self.t = _cpu(), time.perf_counter()

    def stop(self, res: dict[str, Any]) -> None:
        res["s"] = time.perf_counter() - self.t
        res["cpu"] = _cpu() - self.cpu


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _child(mode: str, ckpt: Path, nbytes: int, out: Path, check: bool) -> None:
    """One case in this fresh process; writes ``{"s": seconds, ...}`` to ``out``."""
    from tierckpt import CheckpointManager
    from tierckpt.snapshot import hostcopy
    from tierckpt.snapshot.staging import aligned_empty
    from tierckpt.tiers import memory

    state = h.gpt_state(nbytes, zeros=True)
    ts = h.tensors(state)
    res: dict[str, Any] = {}
    clock = _Clock()
    step_dir = ckpt / "step-0000000001"
    files = sorted(p for p in step_dir.iterdir() if p.name.endswith(".safetensors")) if step_dir.is_dir() else []
    if mode == "memory":
        mgr = CheckpointManager(ckpt, memory_tier=True)
        tier = mgr.components.staging.memory
        clock.start()
        step = mgr.restore(state)
        clock.stop(res)
        res["from_memory"] = tier is not None and tier.restored == [step]
        if check:
            res["equal"] = h.states_equal(state, h.gpt_state(nbytes))
        out.write_text(json.dumps(res))
        os.kill(os.getpid(), signal.SIGKILL)  # a crash again: the memory copy stays for the next round
    if mode.startswith("disk"):
        if mode == "disk cold":
            h.drop_files(ckpt)
        else:
            h.read_into_page_cache(ckpt)
        with CheckpointManager(ckpt) as mgr:
            clock.start()
            mgr.restore(state)
            clock.stop(res)
    elif mode.startswith("memcpy"):
        lengths = np.array([t.nbytes for t in ts], dtype=np.uint64)
        if mode == "memcpy":
            src = aligned_empty(int(lengths.sum()), pin=False)
            src.fill_(1)  # faulted in
            base = src.data_ptr()
            clock.start()
        else:  # the slot file mapped afresh, every page mapped up front (MAP_POPULATE), as a plain copy would
            (copy,) = memory.job_copies(str(ckpt))[0].values()
            end = copy.files[-1].offset + copy.files[-1].size
            clock.start()  # mapping the file afresh is part of what a restore from it pays
            with open(copy.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), end, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=mmap.PROT_READ)
            mv = np.frombuffer(mapped, dtype=np.uint8)
            base = mv.ctypes.data
        addrs = base + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        assert hostcopy.copy_from_addresses(ts, addrs, lengths)
        clock.stop(res)
    else:  # raw reads of the data files into one buffer
        total = sum(p.stat().st_size for p in files)
        buf = aligned_empty(total + 4096 * len(files), pin=False)
        buf.fill_(0)
        view = memoryview(buf.numpy())
        if mode == "read cold":
            h.drop_files(ckpt)
        else:
            h.read_into_page_cache(ckpt)
        clock.start()
        off = 0
        for p in files:
            size = p.stat().st_size
            piece = view[off : off + size]
            if mode == "read cold":
                h.direct_io(p, piece, write=False)
            else:
                with open(p, "rb", buffering=0) as f:
                    f.readinto(piece)
            off += -(-size // 4096) * 4096
        clock.stop(res)
    out.write_text(json.dumps(res))


def _save(ckpt: Path, nbytes: int) -> None:
    """The training process: one save with the memory tier, then a crash."""
    from tierckpt import CheckpointManager

    mgr = CheckpointManager(ckpt, memory_tier=True)
    mgr.save(1, h.gpt_state(nbytes))
    mgr.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, ckpt, nbytes, out, check = sys.argv[2:7]
        if mode == "save":
            _save(Path(ckpt), int(nbytes))
        _child(mode, Path(ckpt), int(nbytes), Path(out), check == "1")
        return
    cli = h.Cli(__doc__, __file__)
    cli.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    cli.add_argument("--rounds", type=int, default=5, help="rounds of every case, in rotated order (default 5)")
    cli.add_argument("--cases", default=",".join(CASES),
                     help="comma-separated cases to run (default: all; memory, memcpy and memcpy shm always run)")
    args = cli.parse()
    wanted = {c.strip() for c in args.cases.split(",")} | {"memory", "memcpy", "memcpy shm"}
    if wanted - set(CASES):
        raise SystemExit(f"unknown cases {sorted(wanted - set(CASES))}; known: {', '.join(CASES)}")
    cases = tuple(c for c in CASES if c in wanted)
    nbytes = int(args.gib * h.GiB)
    scratch = h.scratch_dir(args.dir)
    work = h.fresh_dir(scratch, "memory-tier")
    shm = Path(tempfile.mkdtemp(prefix="tckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    env = {"TIERCKPT_SHM_DIR": str(shm), "TIERCKPT_FAULT": ""}
    ckpt = work / "ckpt"
    runs: dict[str, list[float]] = {c: [] for c in cases}
    cpu: dict[str, list[float]] = {c: [] for c in cases}
    checks: dict[str, Any] = {}
    try:
        h.log(f"saving {args.gib} GiB with memory_tier=True, then SIGKILL")
        done = h.launch([[__file__, "--child", "save", ckpt, nbytes, "-", "0"]], [work / "save.log"],
                        timeout_s=600, env=env)
        if done.returncodes != [-signal.SIGKILL]:
            raise SystemExit(f"the saver exited with {done.returncodes}: {(work / 'save.log').read_text()[-2000:]}")
        for r in range(args.rounds):
            for case in h.rotate(cases, r):
                out = work / f"{case.replace(' ', '-')}-{r}.json"
                logf = work / f"{case.replace(' ', '-')}-{r}.log"
                h.launch([[__file__, "--child", case, ckpt, nbytes, out, "1" if r == 0 else "0"]], [logf],
                         timeout_s=600, env=env)
                if not out.exists():
                    raise SystemExit(f"{case} failed: {logf.read_text()[-3000:]}")
                res = json.loads(out.read_text())
                runs[case].append(res["s"])
                cpu[case].append(res["cpu"])
                if case == "memory":
                    if not res["from_memory"]:
                        raise SystemExit(f"round {r}: the restore did not come from memory: {logf.read_text()[-3000:]}")
                    if "equal" in res:
                        checks["memory_restore_equal"] = res["equal"]
                h.log(f"round {r} {case}: {res['s']:.3f} s ({res['cpu']:.3f} s CPU)")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        h.remove(work)
    med = {c: h.median(v) for c, v in runs.items()}
    med_cpu = {c: h.median(v) for c, v in cpu.items()}
    gbs = {c: (nbytes / 1e9 / m if m else None) for c, m in med.items()}
    # each round's ratio to the same round's copy out of the fresh mapping: rounds a busy machine slowed alike
    paired = {c: h.median([a / b for a, b in zip(runs[c], runs["memcpy shm"])]) for c in cases}
    rows = [[c, med[c], gbs[c], h.ratio(med[c], med["memcpy"]), h.ratio(med[c], med["memcpy shm"]), paired[c],
             f"{min(runs[c]):.3f}-{max(runs[c]):.3f}", med_cpu[c], h.ratio(med_cpu[c], med_cpu["memcpy shm"])]
            for c in cases]
    table = h.markdown_table(["case", "median s", "GB/s", "x memcpy", "x memcpy shm", "x memcpy shm (per round)",
                              "min-max s", "CPU s", "CPU x memcpy shm"], rows)
    print(table)
    h.finish(args, {"benchmark": "memory_tier", "state_bytes": nbytes, "rounds": args.rounds, "runs": runs,
                    "cpu_s": cpu, "median_s": med, "median_cpu_s": med_cpu,
                    "ratios_to_memcpy": {c: h.ratio(med[c], med["memcpy"]) for c in cases},
                    "ratios_to_memcpy_shm": {c: h.ratio(med[c], med["memcpy shm"]) for c in cases},
                    "paired_ratios_to_memcpy_shm": paired,
                    "cpu_ratios_to_memcpy_shm": {c: h.ratio(med_cpu[c], med_cpu["memcpy shm"]) for c in cases},
                    "load_average": os.getloadavg(), "checks": checks, "drop_caches": h.drop_caches_status(),
                    "machine": h.machine(scratch)}, table + "\n")


if __name__ == "__main__":
    main()
