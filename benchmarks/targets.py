"""Where each local-tier target stands, run by run, from ``bench.py``'s JSON results.

    python benchmarks/targets.py [RESULT.json ...] [--size-gib 2] [--markdown targets.md]

Without files it reads the newest committed run: of the ``docs/results/cpu_<date><letter>_bench_*.json`` files of
the given state size (2 GiB, the size the targets are stated at), those whose ``<date><letter>`` tag sorts last
(one run's repeats, e.g. ``cpu_2026-12-03a_bench_2g_run1.json`` to ``..._run3.json``). One row per file, each
ratio a median of that file's repeats:

- stall: the steady-state ``save()`` stall over ``copy_`` into preallocated tensors (target <= 1.1x);
- durable: time until ``handle.persisted`` over the run's raw write+fsync limit (the fastest of its ways),
  and over the ``O_DIRECT`` write timed next to each save (the median of the per-save ratios);
- cold restores, verified: in place and by default, over the run's raw cold-read limit and over the read timed
  next to each restore (the median of the per-restore ratios).

The limits are those ``bench.py`` measured in the same run: results whose ``raw`` case lacks the huge-page ways
(``write_nf_direct_huge``, ``read_cold_nf_direct_huge``) hold slower limits and do not compare with those that
have them.

The last row counts the files that met each target. A run's own limit and the write or read timed next to a save
can differ by 10-40% on a shared virtual disk, so both are shown and neither is picked after the fact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

from common import markdown_table

TARGET = 1.1
ROOT = Path(__file__).resolve().parent.parent


def _run_tag(path: Path) -> str:
    """The run a committed result belongs to: ``2026-12-03a`` of ``cpu_2026-12-03a_bench_2g_run1.json``."""
    return path.stem.removeprefix("cpu_").split("_", 1)[0]


def _pairs(run: dict[str, Any]) -> list[float]:
    """Every steady save's durable time over the write timed next to it, over all repeats of the run."""
    out = []
    for rep in run["runs"].get("tierckpt", []):
        if isinstance(rep, dict):
            out += [a / b for a, b in rep.get("durable_pairs") or [] if b]
    return out


def ratios(run: dict[str, Any]) -> dict[str, tuple[float | None, str]]:
    """The run's ratios by column: (value, text)."""
    lim = run["derived"]["limits"]
    t = run["medians"].get("tierckpt") or {}

    def over(key: str, limit: str) -> float | None:
        return t[key] / lim[limit] if t.get(key) and lim.get(limit) else None

    pairs = _pairs(run)
    inplace = run["derived"].get("inplace_pairs") or {}
    cols: dict[str, tuple[float | None, str]] = {
        "stall / copy_": (over("stall", "memcpy"), ""),
        "durable / raw write": (over("durable", "write"), ""),
        "durable / adjacent write": (median(pairs) if pairs else None, f" ({len(pairs)})" if pairs else ""),
        "in place cold / raw read": (over("load_cold_inplace", "read_cold"), ""),
        "in place cold / adjacent read": (inplace.get("median"), f" ({inplace['n']})" if inplace else ""),
        "default cold / raw read": (over("load_cold", "read_cold"), ""),
        "default cold / adjacent read": (t.get("load_cold_vs_ref"), ""),
    }
    return cols


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*",
                   help="bench.py JSON results (default: the newest run's docs/results/cpu_*_bench_*.json)")
    p.add_argument("--size-gib", type=float, default=2.0, help="only runs of this state size (default 2)")
    p.add_argument("--markdown", help="write the table as Markdown here")
    a = p.parse_args(argv)
    paths = [Path(f) for f in a.files] or sorted((ROOT / "docs" / "results").glob("cpu_*_bench_*.json"))
    runs = []
    for path in paths:
        run = json.loads(path.read_text())
        if run.get("kind") != "bench" or abs(run["state"]["gib"] - a.size_gib) > 0.01:
            continue
        if "tierckpt" not in run["medians"] or "derived" not in run:
            continue
        runs.append((path, run))
    if not a.files and runs:  # the default: the newest run's files only
        newest = max(map(_run_tag, (path for path, _ in runs)))
        runs = [(path, run) for path, run in runs if _run_tag(path) == newest]
    if not runs:
        print(f"no bench.py results of {a.size_gib:g} GiB among {len(paths)} files", file=sys.stderr)
        return 1
    heads = ["run", "cpu"]
    rows: list[list[str]] = []
    met: dict[str, list[int]] = {}
    for path, run in runs:
        cols = ratios(run)
        heads = ["run", "cpu", *cols]
        cpu = run["machine"].get("cpu", "?").split()[0].replace("(R)", "")
        row = [path.stem.removeprefix("cpu_"), cpu]
        for name, (value, extra) in cols.items():
            row.append("-" if value is None else f"{value:.2f}x{extra}")
            if value is not None:
                met.setdefault(name, [0, 0])
                met[name][0] += value <= TARGET
                met[name][1] += 1
        rows.append(row)
    rows.append([f"runs at or under {TARGET}x", ""] + [f"{met[h][0]} of {met[h][1]}" if h in met else "-"
                                                      for h in heads[2:]])
    text = markdown_table(heads, rows)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
