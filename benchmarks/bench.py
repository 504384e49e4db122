"""Side-by-side checkpoint benchmark: the hardware limits, the peers (torch.save, safetensors, DCP) and tierckpt.

    python benchmarks/bench.py --size-gib 1 --repeats 3 [--quick] [--out results.json] [--markdown table.md]
    python benchmarks/bench.py --scaling [--sizes 0.25,0.5,1,2] [--counts 100,1000,10000] [--plot PNG]

Every case saves and/or loads the same generated state once per repeat, in an order rotated every repeat so that a
drift of the shared disk spreads over all systems. Medians are reported, with ratios to the matching limit (``copy_``
for the stall, raw write + fsync for durability, raw read for loads) and to the best peer. Every system's metrics
have the same names: ``stall`` (training blocked: a synchronous save whole, ``async_save`` until it returns or its
staging completes, ``save()`` until it returns), ``durable`` (until fsynced locally), ``load_cold``/``load_warm``
(``*_inplace``: ``restore(in_place=True)``), ``rss_extra``; ``*_ref``, ``*_vs_ref`` and ``*_pairs``: the raw read or
write of the same bytes timed right before or after a cold load or steady save, in turn (:class:`_suite.RefFiles`),
and the ratio to it, which the disk's drift from minute to minute cannot skew. Every timed write and cold read
starts on a quiet disk (:func:`harness.disk_idle`). benchmarks/README.md says what every number means.

The cases live where their question does: ``limits.py`` (the hardware), ``peers.py`` (torch.save, safetensors,
DCP), ``save_restore.py`` (tierckpt); each of those runs its own cases alone with these options, and ``scaling.py``
is ``--scaling``. This script runs them all together, interleaved, and derives the ratios and tables.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import harness as h
import limits as limit_cases
import peers as peer_cases
import save_restore
from _suite import Case, Ctx, RefFiles, paired_ratios, parse_kv, run_suite
from harness import GiB, Metrics, ratio

#: what a run measures: the limits, the peers, tierckpt (``limits.py`` and the others run a part of them)
PARTS = ("limits", "peers", "tierckpt")


# ------------------------------------------------------------------------------------------ the cases
def build_cases(*, tierckpt: bool, remote: bool, s3: bool, peers: list[str] | None = None, limits: bool = True,
                overlap: bool = False) -> dict[str, Case]:
    """The cases of one suite by display name (``overlap``: also tierckpt copying first)."""
    cases: dict[str, Case] = limit_cases.cases() if limits else {}
    cases.update(peer_cases.cases(peers))
    if tierckpt:
        cases.update(save_restore.cases(overlap=overlap, remote=remote, s3=s3))
    return cases


# ------------------------------------------------------------------------------------------ ratios
def derive(med: dict[str, Metrics], nbytes: int) -> dict[str, Any]:
    """The limits (each the fastest raw way: buffered or ``O_DIRECT``, 1 file or N), a row per system with its
    ratios to them and to the best peer, and the pooled adjacent pairs, from the per-case medians."""
    limits = {**limit_cases.measured(med),
              # the reads and writes timed next to loads and saves: the median of the systems' medians
              "read_cold_adjacent": h.median([v for m in med.values() for k, v in m.items()
                                              if k.endswith("_ref") and not k.endswith("_vs_ref")
                                              and v is not None]),
              "write_adjacent": h.median([w for m in med.values() for _, w in m.get("durable_pairs") or []])}
    systems = [n for n in med if n not in ("memcpy", "hash", "raw")]
    peers = [n for n in systems if n in peer_cases.PEERS and "error" not in med[n]]
    best_peer = {}
    for metric in ("stall", "durable", "load_cold", "load_warm"):
        vals = [(med[p][metric], p) for p in peers if med[p].get(metric) is not None]
        best_peer[metric] = min(vals)[::-1] if vals else (None, None)
    rows: dict[str, Metrics] = {}

    def row(m: Metrics, **known: Any) -> Metrics:
        r = {k: m.get(k) for k in ("stall", "durable", "remote_durable", "load_cold", "load_warm", "rss_extra")}
        r.update(stall_vs_memcpy=ratio(r["stall"], limits["memcpy"]),
                 stall_vs_stream=ratio(r["stall"], limits["memcpy_stream"]),
                 durable_vs_write=ratio(r["durable"], limits["write"]),
                 load_cold_vs_read=ratio(r["load_cold"], limits["read_cold"]),
                 load_cold_vs_ref=m.get("load_cold_vs_ref"),
                 load_warm_vs_read=ratio(r["load_warm"], limits["read_warm"]),
                 **{f"{k}_vs_best_peer": ratio(r[k], best_peer[k][1]) for k in best_peer}, error=m.get("error"))
        return {**r, **known}

    for n in systems:
        pooled = paired_ratios(med[n].get("durable_pairs"))
        rows[n] = row(med[n], durable_vs_ref=pooled["median"] if pooled else None, durable_pairs=pooled)
    tk = med.get("tierckpt", {})
    inplace = paired_ratios(tk.get("load_cold_inplace_pairs"))
    if tk.get("load_cold_inplace") is not None:  # restore(in_place=True) as a row of its own, loads only
        rows["tierckpt in_place restore"] = row(
            {"load_cold": tk["load_cold_inplace"], "load_warm": tk.get("load_warm_inplace"),
             "load_cold_vs_ref": inplace["median"] if inplace else tk.get("load_cold_inplace_vs_ref")})
    return {"bytes": nbytes, "inplace_pairs": inplace, "limits": limits,
            "limits_gbps": {k: (nbytes / v / 1e9 if v else None) for k, v in limits.items()},
            "best_peer": {k: {"system": p, "seconds": v} for k, (p, v) in best_peer.items()}, "systems": rows}




# ------------------------------------------------------------------------------------------ reports
def _quartiles(p: dict[str, float] | None) -> str:
    return "-" if not p else "{median:.3f} ({q1:.3f}-{q3:.3f}; {n})".format(**p)


def _mib(v: float | None) -> float | None:
    return None if v is None else v / (1 << 20)


def report_tables(d: dict[str, Any], med: dict[str, Metrics]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, heads, rows) of the limits, the systems with their ratios, tierckpt against the best peer, and
    tierckpt's details."""
    nbytes, lim, bp = d["bytes"], d["limits"], d["best_peer"]
    heads = ["system", "stall s", "durable s", "remote s", "load cold s", "load warm s", "extra RSS GiB",
             "stall/memcpy", "stall/streaming memcpy", "durable/write", "durable/adjacent write", "cold/read",
             "cold/adjacent read", "warm/read"]
    systems = []
    for n, r in d["systems"].items():
        if r.get("error"):
            systems.append([n, "ERROR: " + str(r["error"])[:60]] + [""] * (len(heads) - 2))
            continue
        systems.append([n, r["stall"], r["durable"], r["remote_durable"], r["load_cold"], r["load_warm"],
                        None if r.get("rss_extra") is None else r["rss_extra"] / GiB, r["stall_vs_memcpy"],
                        r.get("stall_vs_stream"), r["durable_vs_write"], r.get("durable_vs_ref"),
                        r["load_cold_vs_read"], r.get("load_cold_vs_ref"), r["load_warm_vs_read"]])
    against = [[f"{n} {metric}", r[metric], bp[metric]["system"], bp[metric]["seconds"], r[f"{metric}_vs_best_peer"]]
               for n in ("tierckpt", "tierckpt copy-first", "tierckpt in_place restore", "tierckpt+posix",
                         "tierckpt+s3")
               if (r := d["systems"].get(n)) and not r.get("error")
               for metric in ("stall", "durable", "load_cold", "load_warm")
               if r.get(metric) is not None and bp[metric]["seconds"] is not None]
    details = []
    tk = med.get("tierckpt", {})
    if tk and "error" not in tk:
        details += [
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
            ["RSS growth 2nd -> last save MiB", _mib(tk.get("rss_growth_steady"))],
            ["peak extra RSS during restore MiB", _mib(tk.get("rss_extra_restore"))],
            ["restore in_place=True cold s (verified)", tk.get("load_cold_inplace")],
            ["restore in_place=True cold / raw read next to it (median of the repeats' ratios)",
             tk.get("load_cold_inplace_vs_ref")],
            ["restore in_place=True cold / raw read next to it, all pairs: median (quartiles; pairs)",
             _quartiles(d.get("inplace_pairs"))],
            ["restore in_place=True warm s (verified)", tk.get("load_warm_inplace")],
            ["restore in_place=True: right step, values equal", tk.get("load_inplace_ok")],
            ["peak extra RSS during in_place restore MiB", _mib(tk.get("rss_extra_restore_inplace"))],
        ]
    for n in ("tierckpt+posix", "tierckpt+s3"):
        m = med.get(n, {})
        if m and "error" not in m and "skipped" not in m:
            details += [[f"{n}: remote durable s (2nd save)", m.get("remote_durable")],
                        [f"{n}: upload after local durable s", m.get("upload")],
                        [f"{n}: upload GB/s", nbytes / m["upload"] / 1e9 if m.get("upload") else None],
                        [f"{n}: remote durable / raw write", ratio(m.get("remote_durable"), lim.get("write"))]]
    out = [("Limits (median seconds for the whole state, GB/s)", ["limit", "seconds", "GB/s"],
            [[label, lim.get(k), d["limits_gbps"].get(k)] for k, label in limit_cases.LIMIT_LABELS.items()])]
    if systems:  # none where only the limits ran (limits.py)
        out.append(("Systems (median seconds; ratios to the matching limit)", heads, systems))
    if against:
        out.append(("tierckpt against the best peer", ["tierckpt metric", "seconds", "best peer", "peer s", "ratio"],
                    against))
    if details:
        out.append(("tierckpt details", ["metric", "value"], details))
    return out


# ------------------------------------------------------------------------------------------ the runs
def main_bench(args: Any, parts: Sequence[str] = PARTS) -> tuple[dict[str, Any], str]:
    """The side-by-side benchmark at one size, of the cases of ``parts`` (:data:`PARTS`): the results and their
    Markdown."""
    scratch = h.scratch_dir(args.dir)
    tc, why = h.import_tierckpt()
    if tc is None:
        h.log(f"tierckpt skipped: {why}")
    measure_tc = tc is not None and "tierckpt" in parts
    h.log(f"generating a {args.size_gib} GiB state")
    state = h.gpt_state(int(args.size_gib * GiB), n_layer=args.layers)
    desc = h.describe(state)
    h.log(f"state: {desc['tensors']} tensors, {desc['gib']:.3f} GiB")
    peers = None if args.peers is None else [p.strip() for p in args.peers.split(",") if p.strip()]
    with contextlib.ExitStack() as stack:
        s3 = h.try_s3(stack) if measure_tc and not args.no_s3 else None
        ctx = Ctx(state, h.empty_like_state(state), scratch, threads=args.threads, tierckpt=tc,
                  tierckpt_kwargs=parse_kv(args.tierckpt_opt), saves=args.saves, s3=s3, quiet_wait=args.quiet_wait,
                  restore_pairs=args.restore_pairs)
        cases = build_cases(tierckpt=measure_tc, remote=not args.no_remote, s3=s3 is not None,
                            peers=peers if "peers" in parts else [], overlap=True)
        if not args.no_adjacent_read and set(parts) != {"limits"}:
            h.log("writing the reference files for the raw read next to each cold load")
            ctx.ref = RefFiles.create(ctx)
            stack.callback(ctx.ref.remove)
        res = run_suite(ctx, cases, args.repeats)
    d = derive(res["medians"], desc["bytes"])
    drop = h.drop_caches_status()
    notes = [f"tierckpt not measured: {why}"] if tc is None and "tierckpt" in parts else []
    if drop["ok"] is False:
        notes.append(f"could not drop the page cache ({drop['error']}): 'cold' numbers are warm")
    if not h.default_stager_available() and "peers" in parts:
        notes.append("DefaultStager not in this torch: that DCP variant skipped")
    tables = h.sections(report_tables(d, res["medians"]))
    md = (f"state: {desc['tensors']} tensors, {desc['gib']:.3f} GiB; repeats: {args.repeats} (medians)\n\n{tables}"
          + "".join(f"\nnote: {n}\n" for n in notes))
    return {"kind": "bench", "machine": h.machine(scratch), "tierckpt_version": getattr(tc, "__version__", None),
            "state": desc, "drop_caches": drop, "notes": notes, "derived": d, "medians": res["medians"],
            "runs": res["runs"], "markdown": tables, "max_rss_bytes": h.max_rss_bytes()}, md


def parse_args(argv: Sequence[str] | None = None, *, doc: str | None = __doc__, script: str = __file__,
               sweeps: bool = True, scaling: bool = False) -> Any:
    """The command line of ``script`` (``bench.py`` or one that runs a part of it): ``sweeps``, the options of the
    size and tensor-count sweeps; ``scaling``, the sweeps are what it runs (``scaling.py``)."""
    p = h.Cli(doc, script)
    p.add_argument("--size-gib", type=float, default=None, help="state size (default 1; 0.25 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="repeats, interleaved (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke run: 0.25 GiB, 1 repeat, 2 tierckpt saves")
    p.add_argument("--threads", type=int, default=2, help="threads/files of the N-file limits (default 2)")
    p.add_argument("--layers", type=int, default=12, help="transformer layers of the generated state (default 12)")
    p.add_argument("--saves", type=int, default=None, help="tierckpt saves per repeat (default 4)")
    p.add_argument("--peers", help=f"comma list of peers to run (default all: {','.join(peer_cases.PEERS)})")
    p.add_argument("--no-remote", action="store_true", help="skip tierckpt's remote tier cases")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 loopback case")
    p.add_argument("--tierckpt-opt", action="append", default=[], metavar="K=V",
                   help="extra CheckpointManager keyword (repeatable), e.g. writer_threads=4")
    p.add_argument("--no-adjacent-read", action="store_true",
                   help="do not time a raw read next to every cold load (saves a raw read per load)")
    p.add_argument("--restore-pairs", type=int, default=None,
                   help="cold in-place restores per repeat, each next to a raw read (default 4; 1 with --quick)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="before each case wait up to this many s for other processes to go quiet (0: never)")
    if sweeps and not scaling:
        p.add_argument("--scaling", action="store_true", help="run the size and tensor-count sweeps instead")
    if sweeps:
        p.add_argument("--sizes", default="0.25,0.5,1,2", help="GiB sizes of the size sweep")
        p.add_argument("--counts", default="100,1000,10000", help="tensor counts of the count sweep")
        p.add_argument("--count-size-gib", type=float, default=0.5, help="state size of the count sweep (default 0.5)")
        p.add_argument("--plot", default=None,
                       help="PNG of the size sweep (default docs/bench_scaling.png with the sweeps)")
        p.add_argument("--plot-from", metavar="JSON", help="only redraw --plot from a saved sweeps' --out JSON")
    p.set_defaults(scaling=scaling, plot=None, plot_from=None)
    a = p.parse(argv)
    for key, quick, default in (("size_gib", 0.25, 1.0), ("repeats", 1, 1 if a.scaling else 3), ("saves", 2, 4),
                                ("restore_pairs", 1, 4)):
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else default)
    if a.restore_pairs < 1:
        p.error("--restore-pairs must be at least 1")
    if a.plot is None and (a.scaling or a.plot_from):
        a.plot = str(h.REPO_ROOT / "docs" / "bench_scaling.png")
    return a


def main(argv: Sequence[str] | None = None, *, doc: str | None = __doc__, script: str = __file__,
         parts: Sequence[str] = PARTS, scaling: bool = False) -> int:
    """Run ``script``: the cases of ``parts`` side by side, or (``--scaling``, or ``scaling``) the sweeps."""
    args = parse_args(argv, doc=doc, script=script, sweeps=tuple(parts) == PARTS, scaling=scaling)
    if args.plot_from:
        from scaling import plot_scaling

        plot_scaling(json.loads(Path(args.plot_from).read_text())["by_size"], Path(args.plot))
        print(f"plot written to {args.plot}")
        return 0
    t0 = time.perf_counter()
    if args.scaling:
        from scaling import main_scaling

        result, md = main_scaling(args)
    else:
        result, md = main_bench(args, parts)
    result["wall_s"] = time.perf_counter() - t0
    print(md)
    h.finish(args, result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
