"""The hardware's limits that every checkpoint is measured against: ``copy_`` into preallocated tensors (and
tierckpt's native streaming copy), xxh3_128 on 1 and N threads, and the raw write + fsync and cold and warm read of
the same bytes (1 file, N files, N files with ``O_DIRECT`` from 4 KiB pages and from huge pages).

    python benchmarks/limits.py [--size-gib 1] [--repeats 3] [--quick] [--threads 2] [--out limits.json]

The cases of ``bench.py``'s "Limits" table, run alone here (its options; ``--help`` lists them); ``bench.py`` runs
them interleaved with every system's. Each limit is the fastest of its raw ways (:func:`measured`).
"""

from __future__ import annotations

import os
from typing import Any

import harness as h
import xxhash
from _suite import Case, Ctx, read_files, write_direct, write_files
from harness import Metrics

RAW_LIMITS = ("write_1f", "write_nf", "write_nf_direct", "write_nf_direct_huge", "read_cold_1f", "read_cold_nf",
              "read_cold_nf_direct", "read_cold_nf_direct_huge", "read_warm_1f", "read_warm_nf")
#: every limit's label in the reports
LIMIT_LABELS = {
    "memcpy": "memcpy into preallocated tensors (copy_)",
    "memcpy_stream": "memcpy into preallocated tensors, streaming stores, N threads (tierckpt's native copy)",
    "write_1f": "raw write + fsync, 1 file",
    "write_nf": "raw write + fsync, N files on N threads",
    "write_nf_direct": "raw write O_DIRECT + fsync, N files on N threads",
    "write_nf_direct_huge": "raw write O_DIRECT + fsync, N files on N threads, from huge pages",
    "read_cold_1f": "raw read, cold cache, 1 file",
    "read_cold_nf": "raw read, cold cache, N files",
    "read_cold_nf_direct": "raw read O_DIRECT, N files",
    "read_cold_nf_direct_huge": "raw read O_DIRECT, N files, into huge pages",
    "read_warm_1f": "raw read, warm cache, 1 file",
    "read_warm_nf": "raw read, warm cache, N files",
    "read_cold_adjacent": "raw read O_DIRECT into huge pages, N files, next to each cold load (median)",
    "write_adjacent": "raw write O_DIRECT + fsync from huge pages, N files, next to each steady tierckpt save (median)",
    "hash_1t": "xxh3_128, 1 thread",
    "hash_nt": "xxh3_128, N threads",
}


# ------------------------------------------------------------------------------------------ limits
def case_memcpy(ctx: Ctx) -> Metrics:
    """``copy_`` of every tensor into its preallocated twin (``time``: the floor of a snapshot), and the same copy with
    streaming stores on ``ctx.threads`` threads, tierckpt's native copy (``time_stream``: this memory's lower floor;
    absent where it is not built); the two go first in turn, by repeat."""
    from tierckpt.snapshot import hostcopy

    out: Metrics = {}

    def plain() -> None:
        with h.timed(out, "time"):
            for s, d in zip(ctx.src_list, ctx.dst_list, strict=True):
                d.copy_(s)

    def stream() -> None:
        if hostcopy.available:
            with h.timed(out, "time_stream"):
                rest, _ = hostcopy.copy_pairs(ctx.dst_list, ctx.src_list, threads=ctx.threads, min_bytes=0)
            assert not rest, "every benchmark tensor is contiguous"

    for fn in (plain, stream) if ctx.repeat % 2 == 0 else (stream, plain):
        fn()
    return out


def case_hash(ctx: Ctx) -> Metrics:
    """xxh3_128 over every tensor's bytes, on one thread and on ``ctx.threads`` threads."""
    out: Metrics = {}
    ts = ctx.src_list
    groups = h.split_balanced(ts, ctx.threads)

    def work(idx: list[int]) -> None:
        for i in idx:
            if ts[i].nbytes:
                xxhash.xxh3_128(h.byte_view(ts[i])).digest()

    with h.timed(out, "time_1t"):
        work(list(range(len(ts))))
    with h.timed(out, "time_nt"):
        h.parallel(lambda g: work(groups[g]), ctx.threads)
    return out


def case_raw_io(ctx: Ctx) -> Metrics:
    """The state's bytes written back to back + fsync: to one file, to N files on N threads, and to N files with
    ``O_DIRECT`` from page-aligned buffers (on 4 KiB pages and, where the kernel has them, on huge pages: 2 MiB DMA
    segments, tierckpt's staging memory; the two first in turn by repeat); read back cold and warm (direct: cold)."""
    from tierckpt.host.memory import huge_pages_available

    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, "raw")
    try:
        one = d / "all.bin"
        h.disk_idle(d)
        with h.timed(out, "write_1f"):
            h.write_file(one, ctx.src_list)
            h.fsync_path(one)
        out["cold_cache"] = h.drop_caches()
        h.disk_idle(d)
        with h.timed(out, "read_cold_1f"):
            h.read_file_into(one, ctx.dst_list)
        with h.timed(out, "read_warm_1f"):
            h.read_file_into(one, ctx.dst_list)
        h.remove(one)

        n = ctx.threads
        groups = h.split_balanced(ctx.src_list, n)
        paths = [d / f"part{g}.bin" for g in range(n)]
        h.disk_idle(d)
        with h.timed(out, "write_nf"):
            write_files(ctx, paths, groups)
        h.drop_caches()
        h.disk_idle(d)
        with h.timed(out, "read_cold_nf"):
            read_files(ctx, paths, groups)
        with h.timed(out, "read_warm_nf"):
            read_files(ctx, paths, groups)
        if ctx.check and ctx.repeat == 0:
            out["read_ok"] = h.states_equal(ctx.state, ctx.dst)
        for p in paths:
            h.remove(p)

        kinds = [("", False)] + ([("_huge", True)] if huge_pages_available() else [])
        for suffix, huge in h.rotate(kinds, ctx.repeat):
            if not hasattr(os, "O_DIRECT"):
                break
            bufs = [h.pack_aligned([ctx.src_list[i] for i in g], huge=huge) for g in groups]  # untimed
            try:
                h.disk_idle(d)
                with h.timed(out, f"write_nf_direct{suffix}"):
                    write_direct(paths, bufs)
                h.drop_caches()
                h.disk_idle(d)
                with h.timed(out, f"read_cold_nf_direct{suffix}"):
                    h.parallel(lambda g, bufs=bufs: h.direct_io(paths[g], bufs[g], write=False), n)
            except OSError as exc:  # EINVAL: no O_DIRECT on this file system; the buffered limits stand
                out.pop(f"write_nf_direct{suffix}", None)
                out["direct_error"] = str(exc)
                break
            finally:
                del bufs
    finally:
        h.remove(d)
    return out



def cases() -> dict[str, Case]:
    """The limits' cases by display name."""
    return {"memcpy": case_memcpy, "hash": case_hash, "raw": case_raw_io}


def measured(med: dict[str, Metrics]) -> dict[str, Any]:
    """The limits of a run from its per-case medians: ``write``, ``read_cold`` and ``read_warm`` each the fastest raw
    way (buffered or ``O_DIRECT``, 1 file or N), beside ``memcpy``, ``hash`` and every raw way's own time."""
    raw, mem = med.get("raw", {}), med.get("memcpy", {})

    def fastest(prefix: str) -> float | None:
        return min((raw[k] for k in RAW_LIMITS if k.startswith(prefix) and raw.get(k)), default=None)

    return {"memcpy": mem.get("time"), "memcpy_stream": mem.get("time_stream"), "write": fastest("write"),
            "read_cold": fastest("read_cold"), "read_warm": fastest("read_warm"),
            "hash_1t": med.get("hash", {}).get("time_1t"), "hash_nt": med.get("hash", {}).get("time_nt"),
            **{k: raw.get(k) for k in RAW_LIMITS}}


if __name__ == "__main__":
    import bench

    raise SystemExit(bench.main(doc=__doc__, script=__file__, parts=("limits",)))
