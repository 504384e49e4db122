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

    .venv/bin/python benchmarks/memory_tier.py --gib 1 --rounds 5
"""

from __future__ import annotations

import json
import mmap
import os
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


def _child(mode: str, ckpt: Path, nbytes: int, out: Path, check: bool) -> None:
    """One case in this fresh process; writes ``{"s": seconds, ...}`` to ``out``."""
    from tierckpt import CheckpointManager
    from tierckpt.snapshot import hostcopy
    from tierckpt.snapshot.staging import aligned_empty
    from tierckpt.tiers import memory

    state = h.gpt_state(nbytes, zeros=True)
    ts = h.tensors(state)
    res: dict[str, Any] = {}
    step_dir = ckpt / "step-0000000001"
    files = sorted(p for p in step_dir.iterdir() if p.name.endswith(".safetensors")) if step_dir.is_dir() else []
    if mode == "memory":
        mgr = CheckpointManager(ckpt, memory_tier=True)
        tier = mgr.components.staging.memory
        t0 = time.perf_counter()
        step = mgr.restore(state)
        res["s"] = time.perf_counter() - t0
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
            t0 = time.perf_counter()
            mgr.restore(state)
            res["s"] = time.perf_counter() - t0
    elif mode.startswith("memcpy"):
        lengths = np.array([t.nbytes for t in ts], dtype=np.uint64)
        if mode == "memcpy":
            src = aligned_empty(int(lengths.sum()), pin=False)
            src.fill_(1)  # faulted in
            base, t0 = src.data_ptr(), 0.0
        else:  # the slot file mapped afresh, every page mapped up front (MAP_POPULATE), as a plain copy would
            (copy,) = memory.job_copies(str(ckpt))[0].values()
            end = copy.files[-1].offset + copy.files[-1].size
            t0 = time.perf_counter()  # mapping the file afresh is part of what a restore from it pays
            with open(copy.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), end, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=mmap.PROT_READ)
            mv = np.frombuffer(mapped, dtype=np.uint8)
            base = mv.ctypes.data
        addrs = base + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        t1 = time.perf_counter()
        assert hostcopy.copy_from_addresses(ts, addrs, lengths)
        res["s"] = time.perf_counter() - (t0 or t1)
    else:  # raw reads of the data files into one buffer
        total = sum(p.stat().st_size for p in files)
        buf = aligned_empty(total + 4096 * len(files), pin=False)
        buf.fill_(0)
        view = memoryview(buf.numpy())
        if mode == "read cold":
            h.drop_files(ckpt)
        else:
            h.read_into_page_cache(ckpt)
        t0 = time.perf_counter()
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
        res["s"] = time.perf_counter() - t0
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
    args = cli.parse()
    nbytes = int(args.gib * h.GiB)
    scratch = h.scratch_dir(args.dir)
    work = h.fresh_dir(scratch, "memory-tier")
    shm = Path(tempfile.mkdtemp(prefix="tckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    env = {"TIERCKPT_SHM_DIR": str(shm), "TIERCKPT_FAULT": ""}
    ckpt = work / "ckpt"
    runs: dict[str, list[float]] = {c: [] for c in CASES}
    checks: dict[str, Any] = {}
    try:
        h.log(f"saving {args.gib} GiB with memory_tier=True, then SIGKILL")
        done = h.launch([[__file__, "--child", "save", ckpt, nbytes, "-", "0"]], [work / "save.log"],
                        timeout_s=600, env=env)
        if done.returncodes != [-signal.SIGKILL]:
            raise SystemExit(f"the saver exited with {done.returncodes}: {(work / 'save.log').read_text()[-2000:]}")
        for r in range(args.rounds):
            for case in h.rotate(CASES, r):
                out = work / f"{case.replace(' ', '-')}-{r}.json"
                logf = work / f"{case.replace(' ', '-')}-{r}.log"
                h.launch([[__file__, "--child", case, ckpt, nbytes, out, "1" if r == 0 else "0"]], [logf],
                         timeout_s=600, env=env)
                if not out.exists():
                    raise SystemExit(f"{case} failed: {logf.read_text()[-3000:]}")
                res = json.loads(out.read_text())
                runs[case].append(res["s"])
                if case == "memory":
                    if not res["from_memory"]:
                        raise SystemExit(f"round {r}: the restore did not come from memory: {logf.read_text()[-3000:]}")
                    if "equal" in res:
                        checks["memory_restore_equal"] = res["equal"]
                h.log(f"round {r} {case}: {res['s']:.3f} s")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        h.remove(work)
    med = {c: h.median(v) for c, v in runs.items()}
    gbs = {c: (nbytes / 1e9 / m if m else None) for c, m in med.items()}
    rows = [[c, med[c], gbs[c], h.ratio(med[c], med["memcpy"]), h.ratio(med[c], med["memcpy shm"]),
             f"{min(runs[c]):.3f}-{max(runs[c]):.3f}"] for c in CASES]
    table = h.markdown_table(["case", "median s", "GB/s", "x memcpy", "x memcpy shm", "min-max s"], rows)
    print(table)
    h.finish(args, {"benchmark": "memory_tier", "state_bytes": nbytes, "rounds": args.rounds, "runs": runs,
                    "median_s": med, "ratios_to_memcpy": {c: h.ratio(med[c], med["memcpy"]) for c in CASES},
                    "ratios_to_memcpy_shm": {c: h.ratio(med[c], med["memcpy shm"]) for c in CASES},
                    "checks": checks, "drop_caches": h.drop_caches_status(),
                    "machine": h.machine(scratch)}, table + "\n")


if __name__ == "__main__":
    main()
