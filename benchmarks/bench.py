"""Side-by-side checkpoint benchmark: hardware limits, peers (torch.save, safetensors, DCP) and tierckpt.

    python benchmarks/bench.py --size-gib 1 --repeats 3 [--quick] [--out results.json] [--markdown table.md]
    python benchmarks/bench.py --scaling [--sizes 0.25,0.5,1,2] [--counts 100,1000,10000]
        [--plot docs/bench_scaling.png]

All cases run on the same generated state (see :mod:`state`), once per repeat, in an order rotated every repeat so
that slow drift of the shared disk spreads over all systems; medians are reported. Each system's numbers are then
given as ratios to the matching hardware limit (memcpy for the stall, raw write+fsync for durability, raw read for
loads) and to the best peer. Every cold load is also given over a raw read of the same number of bytes timed right
next to it (``cold/adjacent read``), which the disk's drift from case to case cannot skew. See benchmarks/README.md
for what every number means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import (
    GiB,
    cpu_snapshot,
    drop_caches_status,
    foreign_cpu,
    import_tierckpt,
    machine_description,
    markdown_table,
    max_rss_bytes,
    median,
    ratio,
    s3_loopback,
    scratch_dir,
    settle,
    table,
    tierckpt_version,
    wait_for_quiet,
    write_json,
)
from measure import (
    Ctx,
    Metrics,
    RefFiles,
    case_hash,
    case_memcpy,
    case_raw_io,
    case_safetensors,
    case_tierckpt,
    case_tierckpt_copy_first,
    case_torch_save,
    default_stager_available,
    make_case_dcp_async,
    make_case_dcp_save,
    make_case_tierckpt_remote,
)
from state import describe, empty_like_state, gpt_state

Case = Callable[[Ctx], Metrics]

#: The peers, in table order.
PEERS = [
    "torch.save",
    "safetensors",
    "dcp.save(t1)",
    "dcp.save(t2)",
    "dcp.async_save",
    "dcp.async_save+DefaultStager",
]


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_cases(
    *, tierckpt: bool, remote: bool, s3: bool, peers: list[str] | None = None, limits: bool = True,
    overlap: bool = False,
) -> dict[str, Case]:
    """The cases of one suite, by display name (``overlap``: also tierckpt with ``overlap_writes=False``, the other
    side of the overlap trade-off)."""
    cases: dict[str, Case] = {}
    if limits:
        cases["memcpy"] = case_memcpy
        cases["hash"] = case_hash
        cases["raw"] = case_raw_io
    all_peers: dict[str, Case] = {
        "torch.save": case_torch_save,
        "safetensors": case_safetensors,
        "dcp.save(t1)": make_case_dcp_save(1),
        "dcp.save(t2)": make_case_dcp_save(2),
        "dcp.async_save": make_case_dcp_async(stager=False),
    }
    if default_stager_available():
        all_peers["dcp.async_save+DefaultStager"] = make_case_dcp_async(stager=True)
    for name in peers if peers is not None else PEERS:
        if name in all_peers:
            cases[name] = all_peers[name]
    if tierckpt:
        cases["tierckpt"] = case_tierckpt
        if overlap:
            cases["tierckpt copy-first"] = case_tierckpt_copy_first
        if remote:
            cases["tierckpt+posix"] = make_case_tierckpt_remote("posix")
        if s3:
            cases["tierckpt+s3"] = make_case_tierckpt_remote("s3")
    return cases


def run_suite(ctx: Ctx, cases: dict[str, Case], repeats: int, label: str = "") -> dict[str, Any]:
    """Run every case ``repeats`` times, rotating the order each repeat; return per-case medians and raw runs."""
    return run_suites([(label, ctx, cases)], repeats)[0]


def run_suites(suites: list[tuple[str, Ctx, dict[str, Case]]], repeats: int) -> list[dict[str, Any]]:
    """Several suites (``(label, ctx, cases)``, e.g. one state per tensor count) run interleaved: each repeat runs
    every suite once, the suites and each suite's cases in an order rotated every repeat, so that a drift of the
    machine (the virtual disk's speed changes over minutes) falls on every suite alike. Per suite, per-case medians
    and raw runs, as :func:`run_suite`."""
    raws: list[dict[str, list[Metrics]]] = [{name: [] for name in cases} for _, _, cases in suites]
    order = list(range(len(suites)))
    for r in range(repeats):
        for i in order[r % len(order) :] + order[: r % len(order)]:
            (label, ctx, cases), raw = suites[i], raws[i]
            ctx.repeat = r
            names = list(cases)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                settle()
                waited, before = wait_for_quiet(ctx.quiet_wait) if ctx.quiet_wait > 0 else (0.0, None)
                t0 = time.perf_counter()
                snap = cpu_snapshot()
                try:
                    m = cases[name](ctx)
                except Exception as exc:  # one broken system must not take the whole run down; it is reported
                    m = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"{label}{name} repeat {r + 1}: FAILED {m['error']}")
                m["foreign_cores"] = foreign_cpu(snap)
                m["foreign_cores_before"] = before
                raw[name].append(m)
                note = (
                    f", other processes busy {m['foreign_cores']:.2f} cores" if m["foreign_cores"] > 0.2 else ""
                )
                wait_note = f", waited {waited:.0f}s for quiet" if waited > 1 else ""
                log(f"{label}{name} repeat {r + 1}/{repeats} ({time.perf_counter() - t0:.1f}s{note}{wait_note})")
    return [{"medians": {name: summarize(runs) for name, runs in raw.items()}, "runs": raw} for raw in raws]


def summarize(runs: list[Metrics]) -> Metrics:
    """Median of each numeric metric over the repeats; booleans are AND-ed; strings (errors) kept."""
    out: Metrics = {}
    keys = {k for m in runs for k in m}
    for k in sorted(keys):
        vals = [m[k] for m in runs if k in m]
        if all(isinstance(v, list) for v in vals):  # samples of every repeat (e.g. restore pairs): pooled
            out[k] = [x for v in vals for x in v]
        elif all(isinstance(v, bool) or v is None for v in vals):
            known = [v for v in vals if v is not None]
            out[k] = all(known) if known else None
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = median(vals)
            if len(vals) > 1:
                out[f"{k}__min"] = min(vals)
        else:
            out[k] = next((v for v in vals if isinstance(v, str)), vals[0])
    return out


def paired_ratios(pairs: list[list[float]] | None) -> dict[str, float] | None:
    """Median and quartiles of load / adjacent read over (load, read) pairs (``None`` without any)."""
    ratios = sorted(a / b for a, b in pairs or [] if a and b)
    if not ratios:
        return None

    def q(f: float) -> float:  # linear interpolation between the closest ranks
        x = f * (len(ratios) - 1)
        lo = int(x)
        return ratios[lo] + (ratios[min(lo + 1, len(ratios) - 1)] - ratios[lo]) * (x - lo)

    return {"n": len(ratios), "median": q(0.5), "q1": q(0.25), "q3": q(0.75), "min": ratios[0], "max": ratios[-1]}


def derive(med: dict[str, Metrics], nbytes: int) -> dict[str, Any]:
    """Limits, per-system rows and ratios (to the limits and to the best peer) from the medians."""
    raw = med.get("raw", {})
    mem = med.get("memcpy", {}).get("time")
    mem_stream = med.get("memcpy", {}).get("time_stream")
    h = med.get("hash", {})
    # the limit is the fastest raw way to move the bytes: buffered or O_DIRECT, 1 file or N
    write = min((v for v in (raw.get("write_1f"), raw.get("write_nf"), raw.get("write_nf_direct"),
                             raw.get("write_nf_direct_huge")) if v), default=None)
    read_cold = min((v for v in (raw.get("read_cold_1f"), raw.get("read_cold_nf"), raw.get("read_cold_nf_direct"),
                                 raw.get("read_cold_nf_direct_huge")) if v), default=None)
    read_warm = min((v for v in (raw.get("read_warm_1f"), raw.get("read_warm_nf")) if v), default=None)
    # the same N-file read, timed next to every cold load (measure.cold): the median of the systems' medians
    adjacent = median([v for m in med.values() for k, v in m.items()
                       if k.endswith("_ref") and not k.endswith("_vs_ref") and v is not None])
    adjacent_write = median([w for m in med.values() for _, w in m.get("durable_pairs") or []])
    limits = {
        "memcpy": mem,
        "memcpy_stream": mem_stream,
        "write": write,
        "read_cold": read_cold,
        "read_warm": read_warm,
        "hash_1t": h.get("time_1t"),
        "hash_nt": h.get("time_nt"),
        **{
            k: raw.get(k)
            for k in ("write_1f", "write_nf", "write_nf_direct", "write_nf_direct_huge", "read_cold_1f",
                      "read_cold_nf", "read_cold_nf_direct", "read_cold_nf_direct_huge", "read_warm_1f",
                      "read_warm_nf")
        },
        "read_cold_adjacent": adjacent,
        "write_adjacent": adjacent_write,
    }
    systems = [n for n in med if n not in ("memcpy", "hash", "raw")]
    peers = [n for n in systems if n in PEERS and "error" not in med[n]]

    def best(metric: str) -> tuple[str | None, float | None]:
        vals = [(med[p][metric], p) for p in peers if med[p].get(metric) is not None]
        if not vals:
            return None, None
        v, p = min(vals)
        return p, v

    best_peer = {m: best(m) for m in ("stall", "durable", "load_cold", "load_warm")}
    rows: dict[str, Metrics] = {}
    for n in systems:
        m = med[n]
        rows[n] = {
            "stall": m.get("stall"),
            "durable": m.get("durable"),
            "remote_durable": m.get("remote_durable"),
            "load_cold": m.get("load_cold"),
            "load_warm": m.get("load_warm"),
            "rss_extra": m.get("rss_extra"),
            "stall_vs_memcpy": ratio(m.get("stall"), mem),
            "stall_vs_stream": ratio(m.get("stall"), mem_stream),
            "durable_vs_write": ratio(m.get("durable"), write),
            "load_cold_vs_read": ratio(m.get("load_cold"), read_cold),
            "load_cold_vs_ref": m.get("load_cold_vs_ref"),
            "load_warm_vs_read": ratio(m.get("load_warm"), read_warm),
            "stall_vs_best_peer": ratio(m.get("stall"), best_peer["stall"][1]),
            "durable_vs_best_peer": ratio(m.get("durable"), best_peer["durable"][1]),
            "load_cold_vs_best_peer": ratio(m.get("load_cold"), best_peer["load_cold"][1]),
            "load_warm_vs_best_peer": ratio(m.get("load_warm"), best_peer["load_warm"][1]),
            "error": m.get("error"),
        }
    for n in systems:  # saves with the write limit timed next to each (measure.case_tierckpt), pooled
        durable_pooled = paired_ratios(med[n].get("durable_pairs"))
        rows[n]["durable_vs_ref"] = durable_pooled["median"] if durable_pooled else None
        rows[n]["durable_pairs"] = durable_pooled
    tk = med.get("tierckpt", {})
    pooled = paired_ratios(tk.get("load_cold_inplace_pairs"))
    if tk.get("load_cold_inplace") is not None:  # restore(in_place=True) as its own row, loads only
        cold, warm = tk["load_cold_inplace"], tk.get("load_warm_inplace")
        rows["tierckpt in_place restore"] = {
            "stall": None, "durable": None, "remote_durable": None, "load_cold": cold, "load_warm": warm,
            "rss_extra": None, "stall_vs_memcpy": None, "stall_vs_stream": None, "durable_vs_write": None,
            "load_cold_vs_read": ratio(cold, read_cold),
            "load_cold_vs_ref": pooled["median"] if pooled else tk.get("load_cold_inplace_vs_ref"),
            "load_warm_vs_read": ratio(warm, read_warm),
            "stall_vs_best_peer": None, "durable_vs_best_peer": None,
            "load_cold_vs_best_peer": ratio(cold, best_peer["load_cold"][1]),
            "load_warm_vs_best_peer": ratio(warm, best_peer["load_warm"][1]), "error": None,
        }  # fmt: skip
    return {
        "bytes": nbytes,
        "inplace_pairs": pooled,
        "limits": limits,
        "limits_gbps": {k: (nbytes / v / 1e9 if v else None) for k, v in limits.items()},
        "best_peer": {k: {"system": p, "seconds": v} for k, (p, v) in best_peer.items()},
        "systems": rows,
    }


# --------------------------------------------------------------------------------------------------------------
# reports
# --------------------------------------------------------------------------------------------------------------


def _quartiles(p: dict[str, float] | None) -> str:
    return "-" if not p else "{median:.3f} ({q1:.3f}-{q3:.3f}; {n})".format(**p)


def report_tables(d: dict[str, Any], med: dict[str, Metrics]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, headers, rows) for the limits, the systems with ratios, and tierckpt's details."""
    nbytes = d["bytes"]
    lim, gbps = d["limits"], d["limits_gbps"]
    labels = {
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
        "write_adjacent": "raw write O_DIRECT + fsync from huge pages, N files, next to each steady tierckpt save "
                          "(median)",
        "hash_1t": "xxh3_128, 1 thread",
        "hash_nt": "xxh3_128, N threads",
    }
    t1 = [[labels[k], lim.get(k), gbps.get(k)] for k in labels]
    heads = ["system", "stall s", "durable s", "remote s", "load cold s", "load warm s", "extra RSS GiB",
             "stall/memcpy", "stall/streaming memcpy", "durable/write", "durable/adjacent write", "cold/read",
             "cold/adjacent read", "warm/read"]  # fmt: skip
    t2 = []
    for n, r in d["systems"].items():
        if r.get("error"):
            t2.append([n, "ERROR: " + str(r["error"])[:60]] + [""] * (len(heads) - 2))
            continue
        rss = r["rss_extra"] / GiB if r.get("rss_extra") is not None else None
        t2.append([n, r["stall"], r["durable"], r["remote_durable"], r["load_cold"], r["load_warm"], rss,
                   r["stall_vs_memcpy"], r.get("stall_vs_stream"), r["durable_vs_write"], r.get("durable_vs_ref"),
                   r["load_cold_vs_read"], r.get("load_cold_vs_ref"), r["load_warm_vs_read"]])  # fmt: skip
    bp = d["best_peer"]
    t3 = []
    for n in ("tierckpt", "tierckpt copy-first", "tierckpt in_place restore", "tierckpt+posix", "tierckpt+s3"):
        r = d["systems"].get(n)
        if not r or r.get("error"):
            continue
        for metric in ("stall", "durable", "load_cold", "load_warm"):
            if r.get(metric) is None or bp[metric]["seconds"] is None:
                continue
            t3.append([f"{n} {metric}", r[metric], f"{bp[metric]['system']}", bp[metric]["seconds"],
                       r[f"{metric}_vs_best_peer"]])  # fmt: skip
    t4 = []
    tk = med.get("tierckpt", {})
    if tk and "error" not in tk:
        t4 += [
            ["first save: stall s", tk.get("first_stall")],
            ["first save: durable s", tk.get("first_durable")],
            ["steady save: stall p50 s", tk.get("stall")],
            ["steady save: stall max s", tk.get("stall_max")],
            ["steady save: durable p50 s", tk.get("durable")],
            ["steady save: durable (library's own clock) s", tk.get("durable_lib")],
            ["steady save: durable / raw write next to it, all pairs: median (quartiles; pairs)",
             _quartiles(d["systems"].get("tierckpt", {}).get("durable_pairs"))],
            ["restore cold s (verified)", tk.get("load_cold")],
            ["restore cold / raw read next to it (median of the repeats' ratios)", tk.get("load_cold_vs_ref")],
            ["restore warm s (verified)", tk.get("load_warm")],
            ["restore returned the last step, values equal", f"{tk.get('restored_step_ok')}, {tk.get('load_ok')}"],
            ["peak extra RSS during saves / state bytes", ratio(tk.get("rss_extra"), nbytes)],
            ["RSS growth 2nd -> last save MiB",
             (tk["rss_growth_steady"] / (1 << 20)) if tk.get("rss_growth_steady") is not None else None],
            ["peak extra RSS during restore MiB",
             (tk["rss_extra_restore"] / (1 << 20)) if tk.get("rss_extra_restore") is not None else None],
            ["restore in_place=True cold s (verified)", tk.get("load_cold_inplace")],
            ["restore in_place=True cold / raw read next to it (median of the repeats' ratios)",
             tk.get("load_cold_inplace_vs_ref")],
            ["restore in_place=True cold / raw read next to it, all pairs: median (quartiles; pairs)",
             _quartiles(d.get("inplace_pairs"))],
            ["restore in_place=True warm s (verified)", tk.get("load_warm_inplace")],
            ["restore in_place=True: right step, values equal", tk.get("load_inplace_ok")],
            ["peak extra RSS during in_place restore MiB",
             (tk["rss_extra_restore_inplace"] / (1 << 20))
             if tk.get("rss_extra_restore_inplace") is not None else None],
        ]  # fmt: skip
    for n in ("tierckpt+posix", "tierckpt+s3"):
        m = med.get(n, {})
        if m and "error" not in m and "skipped" not in m:
            t4 += [
                [f"{n}: remote durable s (2nd save)", m.get("remote_durable")],
                [f"{n}: upload after local durable s", m.get("upload")],
                [f"{n}: upload GB/s", nbytes / m["upload"] / 1e9 if m.get("upload") else None],
                [f"{n}: remote durable / raw write", ratio(m.get("remote_durable"), lim.get("write"))],
            ]
    out = [
        ("Limits (median seconds for the whole state, GB/s)", ["limit", "seconds", "GB/s"], t1),
        ("Systems (median seconds; ratios to the matching limit)", heads, t2),
    ]
    if t3:
        out.append(
            (
                "tierckpt against the best peer",
                ["tierckpt metric", "seconds", "best peer", "peer s", "ratio"],
                t3,
            )
        )
    if t4:
        out.append(("tierckpt details", ["metric", "value"], t4))
    return out


def print_report(tables: list[tuple[str, list[str], list[list[Any]]]]) -> None:
    """Print the tables to stdout."""
    for title, heads, rows in tables:
        print(f"\n== {title} ==")
        print(table(heads, rows))


def markdown_report(tables: list[tuple[str, list[str], list[list[Any]]]]) -> str:
    """The same tables as Markdown sections."""
    return (
        "\n\n".join(f"#### {title}\n\n{markdown_table(heads, rows)}" for title, heads, rows in tables) + "\n"
    )


# --------------------------------------------------------------------------------------------------------------
# main benchmark
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def maybe_s3(enabled: bool) -> Iterator[dict[str, Any] | None]:
    """The loopback S3 server when enabled and available; ``None`` (with a note) otherwise."""
    if not enabled:
        yield None
        return
    try:
        cm = s3_loopback()
        info = cm.__enter__()
    except Exception as exc:
        log(f"S3 loopback server unavailable, S3 case skipped: {type(exc).__name__}: {exc}")
        yield None
        return
    try:
        yield info
    finally:
        cm.__exit__(None, None, None)


def parse_kv(items: list[str]) -> dict[str, Any]:
    """``["writer_threads=4", "x=true"]`` -> ``{"writer_threads": 4, "x": True}`` (ints, floats, bools, None)."""
    out: dict[str, Any] = {}
    for it in items:
        k, _, v = it.partition("=")
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        elif v.lower() == "none":
            val = None
        else:
            for conv in (int, float):
                try:
                    val = conv(v)
                    break
                except ValueError:
                    pass
        out[k] = val
    return out


def main_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The side-by-side benchmark at one size."""
    scratch = scratch_dir(args.dir)
    tc, why = import_tierckpt()
    if tc is None:
        log(f"tierckpt skipped: {why}")
    nbytes = int(args.size_gib * GiB)
    log(f"generating a {args.size_gib} GiB state")
    state = gpt_state(nbytes, n_layer=args.layers)
    dst = empty_like_state(state)
    desc = describe(state)
    log(f"state: {desc['tensors']} tensors, {desc['gib']:.3f} GiB")
    peers = None if args.peers is None else [p.strip() for p in args.peers.split(",") if p.strip()]
    with maybe_s3(tc is not None and not args.no_s3) as s3:
        ctx = Ctx(state, dst, scratch, threads=args.threads, tierckpt=tc, tierckpt_kwargs=parse_kv(args.tierckpt_opt),
                  saves=args.saves, s3=s3, quiet_wait=args.quiet_wait, restore_pairs=args.restore_pairs)  # fmt: skip
        cases = build_cases(
            tierckpt=tc is not None, remote=not args.no_remote, s3=s3 is not None, peers=peers, overlap=True
        )
        if not args.no_adjacent_read:
            log("writing the reference files for the raw read next to each cold load")
            ctx.ref = RefFiles.create(ctx)
        try:
            res = run_suite(ctx, cases, args.repeats)
        finally:
            if ctx.ref is not None:
                ctx.ref.remove()
    d = derive(res["medians"], desc["bytes"])
    tables = report_tables(d, res["medians"])
    drop = drop_caches_status()
    notes = []
    if tc is None:
        notes.append(f"tierckpt not measured: {why}")
    if drop["ok"] is False:
        notes.append(f"could not drop the page cache ({drop['error']}): 'cold' numbers are warm")
    if not default_stager_available():
        notes.append("DefaultStager not in this torch: that DCP variant skipped")
    print(
        f"\nstate: {desc['tensors']} tensors, {desc['bytes'] / GiB:.3f} GiB; repeats: {args.repeats} (medians)"
    )
    print_report(tables)
    for n in notes:
        print(f"note: {n}")
    return {
        "kind": "bench",
        "args": vars(args),
        "machine": machine_description(scratch),
        "tierckpt_version": tierckpt_version(tc),
        "state": desc,
        "drop_caches": drop,
        "notes": notes,
        "derived": d,
        "medians": res["medians"],
        "runs": res["runs"],
        "markdown": markdown_report(tables),
        "max_rss_bytes": max_rss_bytes(),
    }


# --------------------------------------------------------------------------------------------------------------
# scaling
# --------------------------------------------------------------------------------------------------------------

SCALING_SYSTEMS = [
    "torch.save",
    "safetensors",
    "dcp.save(t2)",
    "dcp.async_save",
    "dcp.async_save+DefaultStager",
]


#: tierckpt's metrics compared across tensor counts: key in the case's medians, column label.
COUNT_METRICS = [
    ("stall", "stall"),
    ("durable", "durable"),
    ("load_cold", "restore cold"),
    ("load_cold_inplace", "in place cold"),
    ("load_warm", "restore warm"),
    ("load_warm_inplace", "in place warm"),
]


def _count_ratio(e: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """``"1.23x (45/55 ms)"``: tierckpt's ``key`` at this count against the base count's."""
    a, b = base["medians"]["tierckpt"].get(key), e["medians"]["tierckpt"].get(key)
    r = ratio(b, a)
    return "-" if r is None else f"{r:.2f}x ({a * 1e3:.0f}/{b * 1e3:.0f} ms)"


def main_scaling(args: argparse.Namespace) -> dict[str, Any]:
    """State-size sweep (stall and durable per system) and tensor-count sweep (same bytes, more tensors)."""
    scratch = scratch_dir(args.dir)
    tc, why = import_tierckpt()
    if tc is None:
        log(f"tierckpt skipped: {why}")
    kw = parse_kv(args.tierckpt_opt)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    counts = [int(c) for c in args.counts.split(",") if c]
    by_size: list[dict[str, Any]] = []
    for gib in sizes:
        state = gpt_state(int(gib * GiB), n_layer=args.layers)
        dst = empty_like_state(state)
        desc = describe(state)
        ctx = Ctx(state, dst, scratch, threads=args.threads, loads=False, check=False, tierckpt=tc,
                  tierckpt_kwargs=kw, saves=3, quiet_wait=args.quiet_wait)  # fmt: skip
        cases = build_cases(tierckpt=tc is not None, remote=False, s3=False, peers=SCALING_SYSTEMS)
        cases.pop("hash", None)
        res = run_suite(ctx, cases, args.repeats, label=f"[{gib} GiB] ")
        by_size.append(
            {
                "gib": gib,
                "state": desc,
                "medians": res["medians"],
                "derived": derive(res["medians"], desc["bytes"]),
            }
        )
        del state, dst, ctx
        settle()
    # the count sweep's states are all in memory at once, so that its repeats interleave them (a ratio between
    # two counts is then not a ratio between two stretches of the machine's drift)
    suites: list[tuple[str, Ctx, dict[str, Case]]] = []
    descs: list[dict[str, Any]] = []
    for n in counts:
        state = gpt_state(int(args.count_size_gib * GiB), n_tensors=n)
        dst = empty_like_state(state)
        (scratch / f"n{n}").mkdir(parents=True, exist_ok=True)
        ctx = Ctx(state, dst, scratch / f"n{n}", threads=args.threads, loads=True, check=False, tierckpt=tc,
                  tierckpt_kwargs=kw, saves=3, quiet_wait=args.quiet_wait)  # fmt: skip
        cases = build_cases(
            tierckpt=tc is not None, remote=False, s3=False, peers=["torch.save", "dcp.async_save"]
        )
        cases.pop("hash", None)
        descs.append(describe(state))
        suites.append((f"[{descs[-1]['tensors']} tensors] ", ctx, cases))
    by_count: list[dict[str, Any]] = []
    for desc, res in zip(descs, run_suites(suites, args.repeats)):
        by_count.append({"tensors": desc["tensors"], "state": desc, "medians": res["medians"],
                         "derived": derive(res["medians"], desc["bytes"])})  # fmt: skip
    del suites
    settle()

    systems = [
        s for s in ["memcpy", "raw", *SCALING_SYSTEMS, "tierckpt"] if any(s in e["medians"] for e in by_size)
    ]
    size_rows = []
    for e in by_size:
        m = e["medians"]
        for s in systems:
            if s == "memcpy":
                size_rows.append([f"{e['gib']}", "memcpy (limit)", m[s].get("time"), None])
            elif s == "raw":
                size_rows.append(
                    [f"{e['gib']}", "raw write+fsync (limit)", None, e["derived"]["limits"]["write"]]
                )
            elif s in m:
                size_rows.append([f"{e['gib']}", s, m[s].get("stall"), m[s].get("durable")])
    count_rows = []
    base = by_count[0] if by_count else None
    for e in by_count:
        m = e["medians"]
        for s in ["memcpy", "raw", "torch.save", "dcp.async_save", "tierckpt"]:
            if s not in m or "error" in m[s]:
                continue
            if s == "memcpy":
                vals = [m[s].get("time"), None, None]
            elif s == "raw":
                lim = e["derived"]["limits"]
                vals = [None, lim["write"], lim["read_cold"]]
            else:
                vals = [m[s].get("stall"), m[s].get("durable"), m[s].get("load_cold")]
            b = base["medians"].get(s, {}) if base else {}
            bref = (
                b.get("time")
                if s == "memcpy"
                else (base["derived"]["limits"]["write"] if s == "raw" and base else b.get("stall"))
            )
            key = vals[0] if vals[0] is not None else vals[1]
            count_rows.append([str(e["tensors"]), s, *vals, ratio(key, bref)])
    tables = [
        ("State-size sweep (median seconds)", ["GiB", "system", "stall s", "durable s"], size_rows),
        (f"Tensor-count sweep at {args.count_size_gib} GiB (median seconds; ratio to the fewest-tensors run)",
         ["tensors", "system", "stall s", "durable s", "load cold s", "ratio"], count_rows),
    ]  # fmt: skip
    if len(by_count) > 1 and all("tierckpt" in e["medians"] for e in by_count):
        tables.append((
            "tierckpt per tensor count: each metric's median against the fewest-tensors run's (the target: < 1.5x)",
            ["tensors", *(label for _, label in COUNT_METRICS)],
            [[str(e["tensors"]), *(_count_ratio(e, by_count[0], k) for k, _ in COUNT_METRICS)] for e in by_count[1:]],
        ))  # fmt: skip
    print_report(tables)
    if args.plot and by_size:  # a count-only sweep leaves the size plot alone
        plot_scaling(by_size, Path(args.plot))
        log(f"plot written to {args.plot}")
    if tc is None:
        print(f"note: tierckpt not measured: {why}")
    return {
        "kind": "scaling",
        "args": vars(args),
        "machine": machine_description(scratch),
        "tierckpt_version": tierckpt_version(tc),
        "drop_caches": drop_caches_status(),
        "by_size": by_size,
        "by_count": by_count,
        "markdown": markdown_report(tables),
    }


def plot_scaling(by_size: list[dict[str, Any]], path: Path) -> None:
    """Stall and durable time against state size, one line per system, limits dashed (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = [e["gib"] for e in by_size]
    names = [n for n in [*SCALING_SYSTEMS, "tierckpt"] if any(n in e["medians"] for e in by_size)]
    for ax, metric, limit_key, limit_label in (
        (axes[0], "stall", "memcpy", "memcpy (limit)"),
        (axes[1], "durable", "write", "raw write+fsync (limit)"),
    ):
        lim = [e["derived"]["limits"][limit_key] for e in by_size]
        ax.plot(xs, lim, "k--", label=limit_label, linewidth=2)
        for n in names:
            ys = [e["medians"].get(n, {}).get(metric) for e in by_size]
            style = "o-" if n == "tierckpt" else ".-"
            lw = 2.5 if n == "tierckpt" else 1.2
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], style, label=n, linewidth=lw)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set_xlabel("state size (GiB)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(
            {"stall": "stall: training blocked per save", "durable": "time until durable on local disk"}[
                metric
            ]
        )
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Checkpoint stall and durability vs state size (CPU, bf16 params + fp32 AdamW state)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=None, help="state size (default 1; 0.25 with --quick)")
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats, interleaved (default 3; 1 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repeat, 2 tierckpt saves")
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--markdown", help="write the tables as Markdown here")
    p.add_argument("--dir", help="scratch folder on a real disk (default: REPO/.bench)")
    p.add_argument("--threads", type=int, default=2, help="threads/files for the N-file limits (default 2)")
    p.add_argument(
        "--layers", type=int, default=12, help="transformer layers of the generated state (default 12)"
    )
    p.add_argument("--saves", type=int, default=None, help="tierckpt saves per repeat (default 4)")
    p.add_argument("--peers", help=f"comma list of peers to run (default all: {','.join(PEERS)})")
    p.add_argument("--no-remote", action="store_true", help="skip tierckpt's remote tier cases")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 loopback case")
    p.add_argument("--tierckpt-opt", action="append", default=[], metavar="K=V",
                   help="extra CheckpointManager keyword (repeatable), e.g. writer_threads=4")  # fmt: skip
    p.add_argument("--no-adjacent-read", action="store_true",
                   help="do not time a raw read next to every cold load (saves a raw read per load)")  # fmt: skip
    p.add_argument("--restore-pairs", type=int, default=None,
                   help="cold in-place restores per repeat, each next to a raw read "
                        "(default 4; 1 with --quick)")  # fmt: skip
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="before each case wait up to this many s for other processes to go quiet "
                        "(0: never)")  # fmt: skip
    p.add_argument("--scaling", action="store_true", help="run the size and tensor-count sweeps instead")
    p.add_argument("--sizes", default="0.25,0.5,1,2", help="GiB sizes of the size sweep")
    p.add_argument("--counts", default="100,1000,10000", help="tensor counts of the count sweep")
    p.add_argument(
        "--count-size-gib", type=float, default=0.5, help="state size of the count sweep (default 0.5)"
    )
    p.add_argument(
        "--plot", default=None, help="PNG of the size sweep (default docs/bench_scaling.png with --scaling)"
    )
    p.add_argument("--plot-from", metavar="JSON", help="only redraw --plot from a saved --scaling --out JSON")
    a = p.parse_args(argv)
    if a.size_gib is None:
        a.size_gib = 0.25 if a.quick else 1.0
    if a.repeats is None:
        a.repeats = 1 if a.quick or a.scaling else 3
    if a.saves is None:
        a.saves = 2 if a.quick else 4
    if a.restore_pairs is None:
        a.restore_pairs = 1 if a.quick else 4
    if a.restore_pairs < 1:
        p.error("--restore-pairs must be at least 1")
    if a.scaling and a.plot is None:
        from common import REPO_ROOT

        a.plot = str(REPO_ROOT / "docs" / "bench_scaling.png")
    return a


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args.plot_from:
        from common import REPO_ROOT

        saved = json.loads(Path(args.plot_from).read_text())
        plot_scaling(saved["by_size"], Path(args.plot or REPO_ROOT / "docs" / "bench_scaling.png"))
        return 0
    t0 = time.perf_counter()
    result = main_scaling(args) if args.scaling else main_bench(args)
    result["wall_s"] = time.perf_counter() - t0
    if args.out:
        write_json(args.out, result)
        log(f"results written to {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(result["markdown"])
    log(f"done in {result['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
