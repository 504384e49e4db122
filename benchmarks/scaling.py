"""How stall and durable time grow with the state's size, and tierckpt's save and restore with its tensor count.

    python benchmarks/scaling.py [--sizes 0.25,0.5,1,2] [--counts 100,1000,10000] [--count-size-gib 0.5] [--plot PNG]
    python benchmarks/scaling.py --plot-from scaling.json                    # only redraw the plot of a saved run

The same as ``bench.py --scaling`` (its options; ``--help`` lists them). The size sweep runs every system's saves
(``torch.save``, safetensors, DCP, tierckpt) at each size, the limits beside them, and draws them (default
docs/bench_scaling.png); the count sweep stores the same bytes as more tensors, every count's state in memory at once
and the counts interleaved within every repeat, and reports tierckpt's medians over the fewest tensors' (target:
< 1.5x).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import harness as h
from _suite import Ctx, parse_kv, run_suite, run_suites
from bench import build_cases, derive
from harness import GiB, ratio

#: the systems of the state-size sweep
SCALING_SYSTEMS = ["torch.save", "safetensors", "dcp.save(t2)", "dcp.async_save", "dcp.async_save+DefaultStager"]
#: tierckpt's metrics compared across tensor counts: (key of the medians, label)
COUNT_METRICS = [("stall", "stall"), ("durable", "durable"), ("load_cold", "restore cold"),
                 ("load_cold_inplace", "in place cold"), ("load_warm", "restore warm"),
                 ("load_warm_inplace", "in place warm")]


def _count_ratio(e: dict[str, Any], base: dict[str, Any], key: str) -> str:
    """``"1.23x (45/55 ms)"``: tierckpt's ``key`` at this count against the fewest tensors'."""
    a, b = base["medians"]["tierckpt"].get(key), e["medians"]["tierckpt"].get(key)
    r = ratio(b, a)
    return "-" if r is None else f"{r:.2f}x ({a * 1e3:.0f}/{b * 1e3:.0f} ms)"


def main_scaling(args: Any) -> tuple[dict[str, Any], str]:
    """The state-size sweep (stall and durable time of every system) and the tensor-count sweep (the same bytes in
    more tensors): the results and their Markdown."""
    scratch = h.scratch_dir(args.dir)
    tc, why = h.import_tierckpt()
    if tc is None:
        h.log(f"tierckpt skipped: {why}")
    kw = parse_kv(args.tierckpt_opt)

    def suite(label: str, state: dict[str, Any], where: Path, loads: bool, peers: list[str]) -> tuple:
        ctx = Ctx(state, h.empty_like_state(state), where, threads=args.threads, loads=loads, check=False,
                  tierckpt=tc, tierckpt_kwargs=kw, saves=3, quiet_wait=args.quiet_wait)
        cases = build_cases(tierckpt=tc is not None, remote=False, s3=False, peers=peers)
        cases.pop("hash")
        return label, ctx, cases

    def entry(desc: dict[str, Any], res: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**extra, "state": desc, "medians": res["medians"], "derived": derive(res["medians"], desc["bytes"])}

    by_size = []
    for gib in (float(s) for s in args.sizes.split(",") if s):
        label, ctx, cases = suite(f"[{gib} GiB] ", h.gpt_state(int(gib * GiB), n_layer=args.layers), scratch, False,
                                  SCALING_SYSTEMS)
        by_size.append(entry(h.describe(ctx.state), run_suite(ctx, cases, args.repeats, label), gib=gib))
        del ctx, cases
        h.settle()
    # every count's state is in memory at once, so that the repeats interleave them: a ratio between two counts is
    # then not a ratio between two stretches of the machine's drift
    suites = []
    for n in (int(c) for c in args.counts.split(",") if c):
        (where := scratch / f"n{n}").mkdir(parents=True, exist_ok=True)
        state = h.gpt_state(int(args.count_size_gib * GiB), n_tensors=n)
        suites.append(suite(f"[{h.describe(state)['tensors']} tensors] ", state, where, True,
                            ["torch.save", "dcp.async_save"]))
    by_count = [entry(h.describe(ctx.state), res, tensors=len(ctx.src_list))
                for (_, ctx, _), res in zip(suites, run_suites(suites, args.repeats))]
    del suites
    h.settle()

    size_rows = []
    for e in by_size:
        m = e["medians"]
        size_rows.append([f"{e['gib']}", "memcpy (limit)", m["memcpy"].get("time"), None])
        size_rows.append([f"{e['gib']}", "raw write+fsync (limit)", None, e["derived"]["limits"]["write"]])
        size_rows += [[f"{e['gib']}", s, m[s].get("stall"), m[s].get("durable")]
                      for s in (*SCALING_SYSTEMS, "tierckpt") if s in m]
    count_rows = []
    for e in by_count:
        m, base = e["medians"], by_count[0]
        for s in ("memcpy", "raw", "torch.save", "dcp.async_save", "tierckpt"):
            if s not in m or "error" in m[s]:
                continue
            if s == "memcpy":
                vals, ref = [m[s].get("time"), None, None], base["medians"].get(s, {}).get("time")
            elif s == "raw":
                lim = e["derived"]["limits"]
                vals, ref = [None, lim["write"], lim["read_cold"]], base["derived"]["limits"]["write"]
            else:
                vals = [m[s].get(k) for k in ("stall", "durable", "load_cold")]
                ref = base["medians"].get(s, {}).get("stall")
            count_rows.append([str(e["tensors"]), s, *vals, ratio(vals[0] if vals[0] is not None else vals[1], ref)])
    tables = [("State-size sweep (median seconds)", ["GiB", "system", "stall s", "durable s"], size_rows),
              (f"Tensor-count sweep at {args.count_size_gib} GiB (median seconds; ratio to the fewest-tensors run)",
               ["tensors", "system", "stall s", "durable s", "load cold s", "ratio"], count_rows)]
    if len(by_count) > 1 and all("tierckpt" in e["medians"] for e in by_count):
        tables.append(("tierckpt per tensor count: each metric's median against the fewest-tensors run's (the "
                       "target: < 1.5x)", ["tensors", *(label for _, label in COUNT_METRICS)],
                       [[str(e["tensors"]), *(_count_ratio(e, by_count[0], k) for k, _ in COUNT_METRICS)]
                        for e in by_count[1:]]))
    if args.plot and by_size:  # a count-only sweep leaves the size plot alone
        plot_scaling(by_size, Path(args.plot))
        h.log(f"plot written to {args.plot}")
    md = h.sections(tables) + (f"\nnote: tierckpt not measured: {why}\n" if tc is None else "")
    return {"kind": "scaling", "machine": h.machine(scratch), "tierckpt_version": getattr(tc, "__version__", None),
            "drop_caches": h.drop_caches_status(), "by_size": by_size, "by_count": by_count, "markdown": md}, md


def plot_scaling(by_size: list[dict[str, Any]], path: Path) -> None:
    """Stall and durable time against state size, one line per system, the limits dashed (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = [e["gib"] for e in by_size]
    names = [n for n in [*SCALING_SYSTEMS, "tierckpt"] if any(n in e["medians"] for e in by_size)]
    for ax, metric, limit, title in ((axes[0], "stall", "memcpy", "stall: training blocked per save"),
                                     (axes[1], "durable", "write", "time until durable on local disk")):
        ax.plot(xs, [e["derived"]["limits"][limit] for e in by_size], "k--", linewidth=2,
                label="memcpy (limit)" if limit == "memcpy" else "raw write+fsync (limit)")
        for n in names:
            ys = [e["medians"].get(n, {}).get(metric) for e in by_size]
            ax.plot(xs, [float("nan") if y is None else y for y in ys], "o-" if n == "tierckpt" else ".-", label=n,
                    linewidth=2.5 if n == "tierckpt" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" for x in xs])
        ax.set(xlabel="state size (GiB)", ylabel="seconds (median)", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Checkpoint stall and durability vs state size (CPU, bf16 params + fp32 AdamW state)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)



if __name__ == "__main__":
    import bench

    raise SystemExit(bench.main(doc=__doc__, script=__file__, scaling=True))
