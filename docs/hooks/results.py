"""MkDocs hook: the performance page's tables, generated at build time from the newest results in ``docs/results/``.

Each benchmark of :data:`BENCHMARKS` names the results files it reads (a file-name pattern whose ``tag`` group is
the run: ``2026-12-03a`` of ``cpu_2026-12-03a_bench_2g_run1.json``), the command that reproduces it and how it
measures. A build takes, for each, the files of its newest run (several files of one run are its repeats) and
replaces two markers of ``benchmarks.md``:

- ``<!-- results:summary -->``: one row per benchmark, its headline numbers computed from those files;
- ``<!-- results:details -->``: per benchmark, the method, the command and the run's tables.

A build warns (an error under ``mkdocs build --strict``) when ``docs/results/`` holds a file of an older run of a
benchmark (superseded: remove it, git history keeps it), a file no benchmark reads, or a file whose recorded
arguments disagree with the benchmark's command.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.results")

PAGE = "benchmarks.md"
RESULTS = "results"
#: the manager's defaults the S3 upload row is read at (``upload_part_mb``, ``remote_write_concurrency``)
DEFAULT_PART_MB, DEFAULT_WRITE_CONCURRENCY = 16, 8
#: the remote read concurrency the remote restore row is read at (``remote_read_concurrency``)
DEFAULT_READ_CONCURRENCY = 8
TARGET = 1.1

Run = list[tuple[str, dict[str, Any]]]  # (file name, its JSON), the files of one run


# ------------------------------------------------------------------------------------------------------ formatting
def rng(values: list[float | None], fmt: str = "{:.3f}", unit: str = "") -> str:
    """``lo-hi`` of the values (one value as itself), each formatted with ``fmt``; ``-`` when none is known."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "-"
    lo, hi = fmt.format(vals[0]), fmt.format(vals[-1])
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def x(values: list[float | None]) -> str:
    return rng(values, "{:.2f}", "x")


def s(values: list[float | None]) -> str:
    return rng(values, "{:.3f}", " s")


def pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def table(heads: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def stored_markdown(text: str | None) -> str:
    """A results file's own Markdown tables, for a page: ``####`` headings as bold lines (no table of contents
    entries), sections whose table has no rows dropped."""
    if not text:
        return ""
    out = []
    for part in re.split(r"(?m)^(?=#{2,4} )", text.strip()):
        lines = [ln for ln in part.strip().splitlines()]
        if not lines:
            continue
        rows = [ln for ln in lines if ln.startswith("|")]
        if rows and len(rows) <= 2:
            continue  # a header and its separator: the run did not measure this
        if lines[0].startswith("#"):
            lines[0] = f"**{lines[0].lstrip('#').strip()}**\n"
        out.append("\n".join(lines))
    return "\n\n".join(out)


def collapsed(title: str, body: str) -> str:
    """A collapsed block (pymdownx.details) holding ``body``."""
    return f'??? note "{title}"\n\n' + "\n".join(f"    {ln}" if ln else "" for ln in body.splitlines()) + "\n"


# ------------------------------------------------------------------------------------------------------ headlines
def _bench(run: Run) -> tuple[str, str]:
    t = [d["derived"]["systems"]["tierckpt"] for _, d in run]
    med = [d["medians"]["tierckpt"] for _, d in run]
    inplace = [d["derived"].get("inplace_pairs") or {} for _, d in run]
    head = (f"`save()` stall {s([m['stall'] for m in med])} ({x([v['stall_vs_memcpy'] for v in t])} a `copy_` "
            f"into preallocated tensors); durable on the local disk at {x([v['durable_vs_ref'] for v in t])} the "
            f"raw write timed next to it; verified cold restore at {x([p.get('median') for p in inplace])} the raw "
            f"read next to it with `in_place=True`, {x([m.get('load_cold_vs_ref') for m in med])} by default")
    cols: dict[str, list[tuple[float | None, str]]] = {}
    rows = []
    for (name, d), v, m, p in zip(run, t, med, inplace):
        lim = d["derived"]["limits"]
        peers = d["derived"].get("best_peer") or {}
        ratios = {
            "stall / copy_": v.get("stall_vs_memcpy"),
            "durable / adjacent write": v.get("durable_vs_ref"),
            "durable / raw write": v.get("durable_vs_write"),
            "in place cold / adjacent read": p.get("median"),
            "in place cold / raw read": d["derived"]["systems"].get("tierckpt in_place restore", {}).get(
                "load_cold_vs_read"),
            "default cold / adjacent read": m.get("load_cold_vs_ref"),
            "default cold / raw read": v.get("load_cold_vs_read"),
        }
        for k, val in ratios.items():
            cols.setdefault(k, []).append((val, name))
        rows.append([f"[{Path(name).stem}]({RESULTS}/{name})", f"{m['stall']:.3f} s / {lim['memcpy']:.3f} s",
                     f"{m['durable']:.3f} s", *(x([val]) for val in ratios.values()),
                     f"{m['load_cold_inplace']:.3f} s", f"{m['load_cold']:.3f} s",
                     ", ".join(f"{k.replace('_', ' ')}: {b['system']} {b['seconds']:.3f} s"
                               for k, b in peers.items() if b)])
    met = ["runs at or under 1.1x", "", ""] + [
        f"{sum(1 for val, _ in cols[k] if val is not None and val <= TARGET)} of {len(cols[k])}" for k in cols]
    detail = table(["run", "stall s / copy_ s", "durable", *cols, "in place cold", "default cold", "best peer"],
                   rows + [met + ["", "", ""]])
    return head, detail


def _hugepages(run: Run) -> tuple[str, str]:
    by: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    rows = []
    for name, d in run:
        setting = "on" if "huge_pages=True" in d["args"]["tierckpt_opt"] else "off"
        m, t = d["medians"]["tierckpt"], d["derived"]["systems"]["tierckpt"]
        ip = (d["derived"].get("inplace_pairs") or {}).get("median")
        by[setting].append({"durable": t.get("durable_vs_ref"), "inplace": ip, "cold": m["load_cold"],
                            "first": m["first_stall"]})
        rows.append([f"`huge_pages={setting == 'on'}`", f"[{Path(name).stem}]({RESULTS}/{name})",
                     f"{m['durable']:.3f} s", x([t.get('durable_vs_ref')]), f"{m['load_cold_inplace']:.3f} s",
                     x([ip]), f"{m['load_cold']:.3f} s", f"{m['first_stall']:.2f} s"])

    def both(key: str, f: Callable[[list[float | None]], str]) -> str:
        return f"{f([r[key] for r in by['off']])} off, {f([r[key] for r in by['on']])} on"

    head = (f"steady durable / adjacent write {both('durable', x)}; in-place cold restore / adjacent read "
            f"{both('inplace', x)}; a fresh buffer: default cold restore {both('cold', s)}, first save's stall "
            f"{both('first', s)}")
    rows.sort(key=lambda r: r[0])
    return head, table(["setting", "run", "durable", "/ adjacent write", "in place cold", "/ adjacent read",
                        "default cold (fresh buffer)", "first save: stall"], rows)


def _restart(run: Run) -> tuple[str, str]:
    (name, d), = run
    a, b = d["summary"]["default"], d["summary"]["in_place"]
    head = (f"restore + first save's stall: {a['medians']['resume']:.2f} s by default "
            f"(restore {a['medians']['restore']:.2f} s), {b['medians']['resume']:.2f} s with `in_place=True` "
            f"(restore {b['medians']['restore']:.2f} s, first stall {b['medians']['stall']:.2f} s)")
    return head, stored_markdown(d.get("markdown"))


def _restore_paths(run: Run) -> tuple[str, str]:
    (name, d), = run
    ratios: dict[str, list[float | None]] = {}
    for key, v in d["summary"].items():
        if v.get("neighbour"):
            variant = key.rsplit(" ", 1)[1]
            ratios.setdefault(f"{variant} / {v['neighbour']}", []).append(v.get("ratio_median"))
    head = ("each path's time over its simpler neighbour's (per-round medians, cold and warm, every state): "
            + ", ".join(f"{k} {x(vals)}" for k, vals in ratios.items()))
    return head, stored_markdown(d.get("markdown"))


def _counts(run: Run) -> tuple[str, str]:
    (name, d), = run
    few, many = d["by_count"][0], d["by_count"][-1]
    a, b = few["medians"]["tierckpt"], many["medians"]["tierckpt"]

    def r(key: str) -> str:
        return x([b[key] / a[key]]) if a.get(key) and b.get(key) else "-"

    head = (f"{many['tensors']:,} tensors against {few['tensors']}, the same bytes: stall {r('stall')}, durable "
            f"{r('durable')}, cold restore {r('load_cold')} by default and {r('load_cold_inplace')} in place, warm "
            f"restore {r('load_warm')} and {r('load_warm_inplace')}")
    return head, stored_markdown(d.get("markdown"))


def _scaling(run: Run) -> tuple[str, str]:
    (name, d), = run
    stall, durable, first = [], [], []
    for size in d["by_size"]:
        sys_ = size["derived"]["systems"]
        t = sys_.get("tierckpt") or {}
        stall.append(t.get("stall_vs_memcpy"))
        durable.append(t.get("durable_vs_write"))
        peers = {k: v for k, v in sys_.items() if k != "tierckpt" and v.get("stall") is not None}
        first.append(all(t["stall"] <= v["stall"] and t["durable"] <= v["durable"] for v in peers.values()))
    sizes = [f"{size['gib']:g}" for size in d["by_size"]]
    head = (f"{sizes[0]}-{sizes[-1]} GiB, one repeat a size: stall {x(stall)} `copy_`, durable {x(durable)} the raw "
            f"write; the shortest stall and the earliest durable checkpoint of every system measured at "
            f"{sum(first)} of {len(first)} sizes")
    return head, stored_markdown(d.get("markdown"))


def _loop(run: Run) -> tuple[str, str]:
    (name, d), = run
    sm = d["summary"]
    parts = []
    for key, label in (("tierckpt", "tierckpt"), ("tierckpt-lazy", "lazy"), ("dcp.async_save+DefaultStager",
                                                                           "DCP `async_save` + `DefaultStager`")):
        if key in sm:
            parts.append(f"{label} {pct(sm[key]['overhead'])}, stall {sm[key]['stall_vs_memcpy']:.3f}x")
    head = f"{d['state_bytes'] / 2**20:.0f} MiB; step time and stall / `copy_`: " + "; ".join(parts)
    return head, stored_markdown(d.get("markdown"))


def _trainers(run: Run) -> tuple[str, str]:
    (name, d), = run
    rows, parts = [], []
    labels = {"lightning": "Lightning", "hf": "HF `Trainer`"}
    for fw, r in d["results"].items():
        label = labels.get(fw, fw)
        parts.append(f"{label} {r['ratio_within_run']:.2f}x")
        rows.append([label, f"{r['state_mb']:.0f} MB", f"{r['loop_s']['none']:.2f} s",
                     f"{r['default_overhead_per_ckpt_s']:.3f} / {r['tierckpt_overhead_per_ckpt_s']:.3f} s",
                     f"{r['default_ckpt_step_extra_s']:.3f} / {r['tierckpt_ckpt_step_extra_s']:.3f} s "
                     f"({r['ratio_within_run']:.2f}x)"])
    head = "per checkpoint, within a run, tierckpt's plug-in / the trainer's own: " + ", ".join(parts)
    return head, table(["framework", "state", f"no checkpoint: {d['steps']} steps",
                        "per checkpoint across runs: default / tierckpt",
                        "per checkpoint within a run: default / tierckpt"], rows)


def _dcp(run: Run) -> tuple[str, str]:
    (name, d), = run
    a, b, r = d["dcp"], d["tierckpt"], d["ratio_tierckpt_to_dcp"]
    head = (f"`tierckpt.dcp` / DCP's own storage: `async_save` stall {r['stall_s']:.2f}x, durable "
            f"{r['durable_s']:.2f}x, verified `dcp.load` {r['load_s']:.2f}x")
    rows = [["`async_save` stall (later saves)", f"{a['stall_s']:.3f} s", f"{b['stall_s']:.3f} s",
             f"{r['stall_s']:.2f}x"],
            ["first save: stall", f"{a['first_stall_s']:.3f} s", f"{b['first_stall_s']:.3f} s",
             f"{r['first_stall_s']:.2f}x"],
            ["durable (later saves)", f"{a['durable_s']:.3f} s", f"{b['durable_s']:.3f} s", f"{r['durable_s']:.2f}x"],
            ["`dcp.load`, verified", f"{a['load_s']:.3f} s", f"{b['load_s']:.3f} s", f"{r['load_s']:.2f}x"],
            ["`dcp.load`, `verify=False`", "", f"{b['load_noverify_s']:.3f} s", f"{r['load_noverify_s']:.2f}x"]]
    return head, table(["", "DCP's own", "tierckpt", "ratio"], rows)


def _upload(run: Run) -> tuple[str, str]:
    (name, d), = run
    names = {"posix": "POSIX folder", "s3": "S3 (moto, loopback)"}
    gib = d["state"]["gib"]
    head = f"{gib:.2g} GiB, tierckpt / a plain copy: " + ", ".join(
        f"{names.get(k, k)} {v['ratio']:.2f}x" for k, v in d["summary"].items())
    return head, stored_markdown(d.get("markdown"))


def _s3_parts(run: Run) -> tuple[str, str]:
    (name, d), = run
    res = d["results"]
    default = f"tierckpt {DEFAULT_PART_MB} MiB wc={DEFAULT_WRITE_CONCURRENCY}"
    parts = []
    for key, v in res.items():
        if key.endswith(" " + default):
            emu = key[: -len(default) - 1]
            plain = res.get(f"{emu} plain fs.put")
            if plain:
                parts.append(f"{emu}: {v['median_s'] / plain['median_s']:.2f}x")
    head = (f"default ({DEFAULT_PART_MB} MiB parts, {DEFAULT_WRITE_CONCURRENCY} in flight) / one plain "
            f"`fs.put`: " + "; ".join(parts))
    return head, stored_markdown(d.get("markdown"))


def _remote_restore(run: Run) -> tuple[str, str]:
    (name, d), = run
    res = d["results"]
    lat = max({k.split("ms", 1)[0] for k in res}, key=float)
    rc = DEFAULT_READ_CONCURRENCY
    one, dflt = res.get(f"{lat}ms tierckpt rc=1"), res.get(f"{lat}ms tierckpt rc={rc}")
    l1, ld = res.get(f"{lat}ms list 100 steps rc=1"), res.get(f"{lat}ms list 100 steps rc={rc}")
    parts = []
    if one and dflt:
        parts.append(f"restore with {rc} reads in flight (default) in {dflt['median_s'] / one['median_s']:.2f}x "
                     f"the time of 1")
    if l1 and ld:
        parts.append(f"listing 100 steps in {ld['median_s'] / l1['median_s']:.2f}x")
    return f"{lat} ms round trip: " + ", ".join(parts), stored_markdown(d.get("markdown"))


def _requests(run: Run) -> tuple[str, str]:
    (name, d), = run
    fits = {f["metric"]: f for f in d["fits"]}
    per = fits.get("save: per rank per save (mean)")
    rank0 = fits.get("save: rank 0 per save")
    wmax = str(max(d["ranks"]))
    parts = []
    if per:
        parts.append(f"S3 requests per rank per save {per['values'][wmax]:.2f} at {wmax} ranks "
                     f"(fit {per['a']:.2f}/W + {per['b']:.2f})")
    if rank0:
        parts.append(f"rank 0 {rank0['values'][wmax]:.1f}")
    return "; ".join(parts), collapsed("Every count, by operation", d.get("table", "").strip())


def _incremental(run: Run) -> tuple[str, str]:
    (name, d), = run
    li, lf = d["lora_summary"]["incremental"], d["lora_summary"]["full"]
    pi, pf = d["pretrain_summary"]["incremental"], d["pretrain_summary"]["full"]

    def f(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.3f}{unit}"

    rows = [
        ["LoRA-style", "bytes written locally / bytes changed", f(li["written_over_changed"]),
         f(lf["written_over_changed"])],
        ["LoRA-style", "bytes uploaded / bytes changed", f(li.get("uploaded_over_changed")),
         f(lf.get("uploaded_over_changed"))],
        ["LoRA-style", "stall", f(li["stall_s"], " s"), f(lf["stall_s"], " s")],
        ["LoRA-style", "durable locally", f(li["durable_s"], " s"), f(lf["durable_s"], " s")],
        ["LoRA-style", "durable in the remote tier", f(li["uploaded_s"], " s"), f(lf["uploaded_s"], " s")],
        ["LoRA-style", "restore of the newest step (cold, fresh manager)", f(li["restore_s"], " s"),
         f(lf["restore_s"], " s")],
        ["pretraining", "bytes written locally / bytes changed", f(pi["written_over_changed"]),
         f(pf["written_over_changed"])],
        ["pretraining", "stall", f(pi["stall_s"], " s"), f(pf["stall_s"], " s")],
        ["pretraining", "durable locally", f(pi["durable_s"], " s"), f(pf["durable_s"], " s")],
    ]
    head = (f"LoRA-style: {li['written_over_changed']:.3f}x the changed bytes written"
            + (f", {li['uploaded_over_changed']:.3f}x uploaded" if li.get("uploaded_over_changed") else "")
            + f" (full saves {lf['written_over_changed']:.1f}x); pretraining durable "
            f"{pi['durable_s'] / pf['durable_s']:.2f}x a full save's")
    return head, table(["state", "per save (median of the saves after the first)", "`incremental=True`",
                        "full saves"], rows)


def _gpu(run: Run) -> tuple[str, str]:
    (name, d), = run
    t, lim, dc = d["tierckpt"], d["d2h_limit"], d.get("dcp_async_save") or {}
    head = (f"{d['device']}, {d['state']['gib']:.0f} GiB CUDA state: `save()` stall {t['stall_s']:.4f} s, "
            f"{t['snapshot_gbps']:.1f} GB/s, {t['snapshot_vs_pinned_flat']:.2f}x the pinned device-to-host copy; "
            f"correctness checks {'passed' if d.get('correct') else 'FAILED'}")
    rows = [["limit: pinned device-to-host copy, one flat tensor", f"{lim['flat_s']:.4f} s",
             f"{lim['flat_gbps']:.1f} GB/s"],
            ["limit: the tensors one by one into one pinned buffer", f"{lim['per_tensor_s']:.4f} s",
             f"{lim['per_tensor_gbps']:.1f} GB/s"],
            ["tierckpt `save()` stall, steady state", f"{t['stall_s']:.4f} s", f"{t['snapshot_gbps']:.1f} GB/s"],
            ["tierckpt first save: stall", f"{t['first_stall_s']:.4f} s", ""],
            ["tierckpt durable on the local disk", f"{t['durable_s']:.2f} s", ""]]
    if dc:
        rows.append(["DCP `async_save` stall, later saves", f"{dc['stall_s']:.3f} s", f"{dc['stall_gbps']:.1f} GB/s"])
        rows.append(["DCP `async_save` durable", f"{dc['durable_s']:.2f} s", ""])
    ds = d.get("dcp_async_save_DefaultStager") or {}
    if ds:
        reused = ds.get("stager_reuse", True)
        how = "one stager reused" if reused else "a fresh stager a save: this torch cannot reuse one"
        rows.append([f"DCP `async_save` + `DefaultStager` stall, later saves ({how})", f"{ds['stall_s']:.3f} s",
                     f"{ds['stall_gbps']:.1f} GB/s"])
    for what, err in (d.get("errors") or {}).items():
        rows.append([f"{what}: failed", f"`{err}`", ""])
    return head, table(["", "seconds", "rate"], rows)


def _memory_tier(run: Run) -> tuple[str, str]:
    (name, d), = run
    med, runs = d["median_s"], d["runs"]
    gib = d["state_bytes"] / 2**30
    labels = {"memory": "tierckpt restore from the memory tier (`memory_tier=True`), verified",
              "disk warm": "tierckpt restore from the local disk, files in the page cache",
              "disk cold": "tierckpt restore from the local disk, files dropped from the page cache",
              "memcpy": "limit: native copy into the tensors from private memory faulted in before",
              "memcpy shm": "limit: native copy into the tensors from the slot file, mapped afresh",
              "read warm": "limit: raw buffered read of the data files (page cache)",
              "read cold": "limit: raw `O_DIRECT` read of the data files (dropped from the page cache)"}
    cpu = d.get("median_cpu_s")  # runs since the CPU time of each case is kept too
    rows = [[labels[c], f"{med[c]:.3f} s", f"{min(runs[c]):.3f}-{max(runs[c]):.3f} s",
             f"{med[c] / med['memcpy']:.2f}x", f"{med[c] / med['memcpy shm']:.2f}x"]
            + ([f"{cpu[c]:.3f} s", f"{cpu[c] / cpu['memcpy shm']:.2f}x"] if cpu else []) for c in labels if c in med]
    head = (f"{gib:.0f} GiB, restart after a crash: memory tier {med['memory']:.3f} s = "
            f"{med['memory'] / med['memcpy']:.2f}x a memcpy from private memory, "
            f"{med['memory'] / med['memcpy shm']:.2f}x one from the freshly mapped slot file"
            + (f" ({cpu['memory'] / cpu['memcpy shm']:.2f}x its CPU time)" if cpu else "")
            + (f"; local disk {med['disk cold']:.3f} s cold, {med['disk warm']:.3f} s warm"
               if "disk cold" in med else ""))
    return head, table(["case (a fresh process each)", "median", "min-max", "x memcpy", "x memcpy from the slot file"]
                       + (["CPU time", "CPU x memcpy from the slot file"] if cpu else []), rows)


def _peer_copies(run: Run) -> tuple[str, str]:
    (name, d), = run
    rp, st, cp = d["recovery_point_steps"], d["step_s"], d["copy_s"]
    mib = d["bytes_per_node_step"] / 2**20
    rows = [["recovery point after losing node 1 (saves back)", str(rp["off"]), str(rp["on"])],
            ["newest step every rank could restore", str(d["restorable"]["off"]), str(d["restorable"]["on"])],
            ["training step + `save()`, mean", f"{st['off']:.3f} s", f"{st['on']:.3f} s"]]
    copy = [["peer copy to commit on the partner (median, min-max)",
             f"{cp['median']:.3f} s ({cp['min']:.3f}-{cp['max']:.3f})"],
            ["raw loopback socket copy into fsync-ed files", f"{d['raw_copy_disk_s']:.3f} s"],
            ["raw loopback socket copy, no disk", f"{d['raw_copy_socket_s']:.3f} s"]]
    head = (f"node lost while uploads lag: {rp['off']} saves lost without peer copies, {rp['on']} with; step "
            f"{st['on'] / st['off']:.2f}x; a {mib:.0f} MiB copy commits in {cp['median']:.3f} s "
            f"({cp['median'] / d['raw_copy_disk_s']:.1f}x a raw socket copy to disk)")
    return head, (table(["", "`peer_replicas=0`", "`peer_replicas=1`"], rows) + "\n\n"
                  + table([f"one node's step ({mib:.0f} MiB)", "seconds"], copy))


def _restart_sim(run: Run) -> tuple[str, str]:
    (name, d), = run
    rows, worst, per_rank = [], 0.0, []
    largest = max(r["world"] for r in d["results"])
    for r in d["results"]:
        for scenario, v in r["scenarios"].items():
            ag = v["agreements"]
            slowest = max(a["seconds"] for a in ag)
            if scenario != "save" and r["world"] == largest:
                worst = max(worst, slowest)
            per_rank.append(sum(a["rank_bytes_max"] for a in ag))
            rows.append([f"{r['world']:,}", str(r["remote_only_steps"]), scenario.replace("_", " "), str(len(ag)),
                         f"{v['wall_s']:.1f} s", f"{slowest:.1f} s", f"{per_rank[-1]:,}",
                         f"{sum(a['rank0_bytes'] for a in ag):,}", f"{max(a['largest_request_bytes'] for a in ag):,}",
                         str(v["keys_left"])])
    head = (f"a rank's store bytes per save or restart {min(per_rank):,}-{max(per_rank):,} B at every W and step "
            f"count; slowest restart agreement at {largest:,} ranks {worst:.1f} s; keys left "
            f"{max(int(row[-1]) for row in rows)}")
    return head, table(["W", "remote-only steps", "scenario", "agreements", "total", "slowest agreement",
                        "bytes of a rank (busiest)", "rank 0 bytes", "largest request, bytes", "keys left"], rows)


def _reshard_index(run: Run) -> tuple[str, str]:
    (name, d), = run
    rows = [[f"{r['world']:,} -> {r['restored_on']:,}", f"{r['manifest_bytes']:,}", f"{r['before']['bytes']:,}",
             f"{r['after']['bytes']:,}", f"{r['before']['requests']} / {r['after']['requests']}",
             f"{(r['before']['parse_s'] + r['before']['plan_s']) * 1e3:.1f} ms",
             f"{(r['after']['parse_s'] + r['after']['plan_s']) * 1e3:.1f} ms"] for r in d["runs"]]
    largest = max(d["runs"], key=lambda r: r["world"])
    head = (f"a resharding rank reads {largest['after']['bytes']:,} B of the shard index at {largest['world']:,} "
            f"ranks, against {largest['before']['bytes']:,} B of manifest.json")
    return head, table(["W -> W/2", "manifest.json, bytes", "read a rank before, bytes", "after, bytes",
                        "requests before / after", "parse and plan before", "after"], rows)


# ------------------------------------------------------------------------------------------------------ benchmarks
@dataclass(frozen=True)
class Benchmark:
    key: str
    title: str
    #: regex on the results file name; group ``tag`` names the run (the newest tag sorts last)
    pattern: str
    #: the commands that reproduce it (from the repository root), one per configuration a run combines
    commands: tuple[str, ...]
    method: str
    render: Callable[[Run], tuple[str, str]]


_TAG = r"(?P<tag>\d{4}-\d{2}-\d{2}[a-z]?)"
VM = "the 2-vCPU VM described above"

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "local-2g", "The local tier at 2 GiB", rf"cpu_{_TAG}_bench_2g_run\d+\.json",
        (".venv/bin/python benchmarks/bench.py --size-gib 2 --repeats 5 --no-s3 --out bench_2g.json",),
        f"`bench.py` on {VM}, run three times: every system (`torch.save`, safetensors, DCP `save`, `async_save` "
        "with and without `DefaultStager`, tierckpt) saves the 2 GiB state and, but for `async_save`, loads it "
        "back, cases interleaved, five repeats a run; medians per run. Each steady-state save and each cold "
        "restore is paired with a raw `O_DIRECT` write or read of the same bytes timed next to it (\"adjacent\"); "
        "the run's own raw limits are the fastest of its raw ways; both kinds of ratio are given.",
        _bench),
    Benchmark(
        "restart", "A restart: restore, then the first save", rf"cpu_{_TAG}_restart\.json",
        (".venv/bin/python benchmarks/restart.py --size-gib 2 --rounds 6 --out restart.json",),
        "Each round a fresh Python process builds the 2 GiB state zero-filled, drops the page cache, restores the "
        "newest step (by default or with `in_place=True`, alternating) and saves at once; the parent times a raw "
        "cold `O_DIRECT` read of the same files next to it. Medians of 6 interleaved rounds.",
        _restart),
    Benchmark(
        "restore-paths", "Restore paths against their simpler neighbours", rf"cpu_{_TAG}_restore_paths\.json",
        (".venv/bin/python benchmarks/restore_paths.py --states 0.5x592,0.5x10000,2x592 --rounds 4 "
         "--out restore_paths.json",),
        "Each path a restore takes, forced the other way through the module attribute that chooses it (the "
        "variants of `benchmarks/restore_paths.py`), restoring one saved step cold (its files dropped from the "
        "page cache with `posix_fadvise(DONTNEED)`) and warm, variants interleaved, 4 rounds; the ratio is the "
        "median over the rounds of each path's time over its neighbour's in the same round. The default "
        "restore's variants run in a manager whose staging slot is already faulted in; the in-place ones from a "
        "fresh manager each time, as at a restart. [Design](design.md) says which paths remain and why.",
        _restore_paths),
    Benchmark(
        "counts-2g", "Many small tensors, 2 GiB", rf"cpu_{_TAG}_counts2g\.json",
        ('.venv/bin/python benchmarks/bench.py --scaling --sizes "" --counts 100,10000 --count-size-gib 2 '
         "--repeats 5 --peers torch.save,dcp.async_save --no-remote --out counts2g.json",),
        "The same bytes as 112 or as 10,000 tensors; every count's state built first and the counts interleaved "
        "within each repeat; tierckpt's medians at 10,000 tensors over those at 112 (target: < 1.5x).",
        _counts),
    Benchmark(
        "counts-05", "Many small tensors, 0.5 GiB", rf"cpu_{_TAG}_counts05(?:_run\d+)?\.json",
        ('.venv/bin/python benchmarks/bench.py --scaling --sizes "" --counts 100,10000 --count-size-gib 0.5 '
         "--repeats 5 --no-remote --out counts05.json",),
        "As above at 0.5 GiB, where the per-tensor work is a larger share of each operation.",
        _counts),
    Benchmark(
        "scaling", "State size", rf"cpu_{_TAG}_scaling\.json",
        (".venv/bin/python benchmarks/bench.py --scaling --sizes 0.25,0.5,1,2,4 --out scaling.json",),
        "One repeat per size, so single ratios scatter; measured on an Intel host of the same VM type with a disk "
        "about half as fast. The run also redraws the plot:\n\n"
        "![stall and durable time against state size](bench_scaling.png)",
        _scaling),
    Benchmark(
        "hugepages", "`huge_pages` on and off", rf"cpu_{_TAG}_ab_hugepages_(?:on|off)_\d+\.json",
        (".venv/bin/python benchmarks/bench.py --size-gib 2 --repeats 3 --no-s3 --no-remote --peers safetensors "
         "--tierckpt-opt huge_pages=False --out off.json",
         ".venv/bin/python benchmarks/bench.py --size-gib 2 --repeats 3 --no-s3 --no-remote --peers safetensors "
         "--tierckpt-opt huge_pages=True --out on.json"),
        "Four runs in turn (off, on, off, on), each a fresh process. The default restore and the first save "
        "fault in a fresh 2 GiB buffer, which on this VM (its balloon reports free memory to the host in 2 MiB "
        "blocks) is slower on huge pages; every steady-state number is faster on them.",
        _hugepages),
    Benchmark(
        "loop", "Inside a training loop, 153 MiB", rf"cpu_{_TAG}_loop\.json",
        (".venv/bin/python benchmarks/training_loop.py --out loop.json",),
        "A small GPT-like transformer trains on the CPU with AdamW and checkpoints model and optimizer every 5 "
        "steps right after `optimizer.step()`. Overhead: mean step time against no checkpointing; stall: the time "
        "the loop is blocked in checkpointing calls (`save()` and every barrier until the next save) over a plain "
        "`copy_` of the state. Steps during which other processes kept more than 0.25 cores busy are left out.",
        _loop),
    Benchmark(
        "loop768", "Inside a training loop, 469 MiB", rf"cpu_{_TAG}_loop768\.json",
        (".venv/bin/python benchmarks/training_loop.py --d 768 --steps 16 --every 4 --repeats 1 --out loop768.json",),
        "As above with a wider model, a checkpoint every 4 steps, one repeat.", _loop),
    Benchmark(
        "loop2g", "Inside a training loop, 2.5 GiB", rf"cpu_{_TAG}_loop2g\.json",
        (".venv/bin/python benchmarks/training_loop.py --d 1024 --layers 16 --heads 16 --steps 20 --every 4 "
         "--repeats 1 --out loop2g.json",),
        "As above at about the size the local-tier targets are stated at, on the Intel host.", _loop),
    Benchmark(
        "trainers", "Trainer plug-ins against the trainers' own checkpoints", rf"cpu_{_TAG}_trainers\.json",
        (".venv/bin/python benchmarks/trainers.py --repeats 3 --out trainers.json",),
        "Lightning trains a 3-layer 2048-wide MLP with Adam, `ModelCheckpoint` every 5 steps with its default "
        "`torch.save` against the same with `TieredCheckpointIO`; the HF `Trainer` trains a 2-layer GPT-2 with "
        "AdamW, its own `save_strategy=\"steps\"` against `TieredCheckpointCallback`. 20 measured steps, 4 "
        "checkpoints, each (framework, system) run 3 times interleaved; medians. \"Across runs\": (time with "
        "checkpoints - time without) / 4, which other jobs on the VM's 2 cores can make meaningless (even "
        "negative); \"within a run\": the steps that checkpoint against the median of the run's other steps, "
        "robust to that drift but blind to what background writes cost the other steps. The trainers' defaults "
        "write into the page cache without fsync; tierckpt fsyncs in the background.",
        _trainers),
    Benchmark(
        "dcp", "Under torch.distributed.checkpoint", rf"cpu_{_TAG}_dcp\.json",
        (".venv/bin/python benchmarks/dcp_compare.py --size-mib 256 --saves 3 --out dcp.json",),
        "One process, 256 MiB in 64 float32 tensors, three rounds of \"change the state, `dcp.async_save`, wait "
        "until durable\", then one `dcp.load` of the newest step. DCP: `FileSystemWriter` (files fsynced) with "
        "`async_save`'s default stager and `FileSystemReader`; tierckpt: `tierckpt.dcp.StorageWriter` with "
        "`tierckpt.dcp.Stager`, durable = committed on the local tier, loaded with `tierckpt.dcp.StorageReader` "
        "(`verify=True`, and `verify=False`). DCP reads back files it has just written through the page cache; "
        "tierckpt writes around it (`O_DIRECT`), so its load reads the disk.",
        _dcp),
    Benchmark(
        "upload", "Uploads, 0.5 GiB", rf"cpu_{_TAG}_upload\.json",
        (".venv/bin/python benchmarks/upload.py --size-gib 0.5 --repeats 3 --out upload.json",),
        "tierckpt replicates a committed step (592 tensors) to a POSIX folder on the same disk and to moto's S3 "
        "server on loopback; the baseline copies the same files (`shutil.copyfile` + fsync; one s3fs `fs.put`). "
        "tierckpt also re-hashes every byte it sends and commits the step manifest last. Moto parses every "
        "request in Python on the same cores: compare the ratios, not the GB/s.",
        _upload),
    Benchmark(
        "upload-posix", "Uploads to a POSIX folder, 1 GiB", rf"cpu_{_TAG}_upload_posix\.json",
        (".venv/bin/python benchmarks/upload.py --size-gib 1 --repeats 3 --no-s3 --out upload_posix.json",),
        "As above, 1 GiB, the POSIX folder only.", _upload),
    Benchmark(
        "s3-parts", "Uploads to S3 with parts in flight", rf"cpu_{_TAG}_s3_parts\.json",
        (".venv/bin/python benchmarks/s3_upload.py --size-gib 0.25 --repeats 3 --part-mb 64,16 --concurrency 4,8 "
         "--emulate 0:0,25:30,25:10 --out s3_parts.json",),
        "A 0.25 GiB step (2 files of 128 MiB) replicated to moto's S3 server (in a process of its own) with the "
        "uploader's own call, per part size and parts in flight, against one plain s3fs `fs.put` (nothing "
        "checked); S3's round trip and a per-connection rate emulated on every request. Medians of 3 "
        "interleaved repeats. On loopback moto's own parsing (about 60 MB/s on these cores) limits every case.",
        _s3_parts),
    Benchmark(
        "remote-restore", "Restores from object storage", rf"cpu_{_TAG}_remote_restore\.json",
        (".venv/bin/python benchmarks/remote_restore.py --size-gib 0.25 --repeats 5 --latency-ms 0,25 "
         "--concurrency 1,4,8 --list-steps 100 --out remote_restore.json",),
        "A manager with an empty local tier restores a 0.25 GiB step (32 MiB files) from moto's S3 server, every "
        "byte verified, with `remote_read_concurrency` 1, 4 or 8; the baseline fetches the same objects whole "
        "with s3fs, two at a time, hashing nothing. A wrapper emulates S3's round trip before every GET, HEAD "
        "and LIST. \"List 100 steps\" is what `mgr.steps()` and `tierckpt ls` do on a remote holding 100 steps. "
        "Medians of 5 interleaved repeats.",
        _remote_restore),
    Benchmark(
        "requests", "S3 requests of a multi-rank job", rf"cpu_{_TAG}_request_counts\.json",
        (".venv/bin/python benchmarks/request_counts.py --ranks 1,2,4,8,16 --out request_counts.json",),
        "A counting S3 server (moto on loopback behind a middleware counting every request by operation, rank "
        "and bytes) serves W gloo ranks, each on its own local folder as on separate nodes, 2 MiB per rank: "
        "three saves, a restart, and a restart with every local folder wiped. Counts per save and per restart, "
        "with the least-squares fit of each against W ([multi-rank jobs](distributed.md) discusses them).",
        _requests),
    Benchmark(
        "incremental", "Incremental checkpoints", rf"cpu_{_TAG}_incremental\.json",
        (".venv/bin/python benchmarks/incremental.py --base-gib 1 --pretrain-gib 1 --saves 8 "
         "--out incremental.json",),
        "A LoRA-style state (a frozen 1 GiB bf16 base of GPT shapes, rank-16 fp32 adapters on its 2-D weights and "
        "their AdamW moments) saved 8 times by a manager with `incremental=True` and by one without, both "
        "uploading to moto's S3 server on loopback, saves interleaved; before each save the adapters and their "
        "moments change. Bytes are those of the new local and remote step folders, manifests included, over the "
        "bytes that changed. Then each run's newest step is restored by a fresh manager, its files dropped from the "
        "page cache. A 1 GiB pretraining state (every tensor changes before every save) is saved 8 times locally "
        "the same two ways. Medians of the saves after the first (the first writes everything either way).",
        _incremental),
    Benchmark(
        "gpu", "GPU snapshot", r"gpu_h200_(?P<tag>\d{4}-\d{2}-\d{2}(?:_\d{4})?)\.json",
        ("python3 benchmarks/gpu_check.py --size-gib 4",),
        "A 4 GiB state of 592 tensors on the GPU: pinned device-to-host bandwidth (the limits), tierckpt's "
        "snapshot stall, DCP `async_save`, and two correctness checks: a state changed by a kernel launched the "
        "instant `save()` returns restores to its pre-save values, and a model saved and stepped with AdamW at "
        "once restores its pre-step parameters and optimizer state.",
        _gpu),
    Benchmark(
        "memory-tier", "Memory tier: restore after a process crash", rf"cpu_{_TAG}_memory_tier\.json",
        (".venv/bin/python benchmarks/memory_tier.py --gib 1 --rounds 5 --out memory_tier.json",),
        "A 1 GiB state saved once by a process with `memory_tier=True`, which is then SIGKILLed. Each case runs in a "
        "fresh process per round (5 rounds, rotated order), as a restarted job: a zero-filled state of the same "
        "layout, then the timed restore or copy. The memory-tier restore maps the slot file that outlived the "
        "crash (each chunk's pages as the reader reaches it, on the io threads), hashes every byte against the "
        "manifest and copies it into the tensors; the disk restores use a manager without the memory tier. The "
        "limits copy or read the same bytes: tierckpt's native copy into the tensors from private memory faulted "
        "in before, and from the slot file mapped afresh with `MAP_POPULATE` (what mapping shared memory in a new "
        "process costs is part of it), and raw reads of the data files. Medians of the wall time, and of each "
        "case's CPU time (all its threads); [the memory tier](memory-tier.md) explains the costs.",
        _memory_tier),
    Benchmark(
        "peer-copies", "Peer copies: recovery point after a node loss", rf"cpu_{_TAG}_peer_copies\.json",
        (".venv/bin/python benchmarks/peer_copies.py --mib 64 --saves 8 --step-s 1.0 --remote-mbps 30 "
         "--out peer_copies.json",),
        "Two one-rank nodes (gloo, a local folder each) train 1 s steps and save a 64 MiB state after every one "
        "to a POSIX remote capped at 30 MB/s (`upload_bandwidth_mbps`), so that uploads fall behind; once without "
        "and once with `peer_replicas=1`. Right after the last save is committed (and copied), rank 0 takes stock "
        "as if node 1 were lost: the newest step every rank could restore is the remote's newest, or one node 0 "
        "holds locally and as node 1's replica. The copy's time runs from the local commit's hand-over to the "
        "partner's reply that the replica is committed (received, checksummed, fsync-ed, renamed), while the next "
        "steps train and the uploads run on the same 2 cores; the raw copies send the same files over a loopback "
        "socket. The VM was shared with other work during the run (load average 98 at its end), which inflates "
        "every time here. [Peer copies](peer-copies.md) explains the costs.",
        _peer_copies),
    Benchmark(
        "restart-sim", "Agreements of thousands of ranks", rf"cpu_{_TAG}_restart_sim\.json",
        ("unshare -rn sh -c 'ip link set lo up; .venv/bin/python benchmarks/restart_sim.py --worlds 256 1024 2048 "
         "8192 --remote-only 1 100 --ranks-per-process 128 --out restart_sim.json'",),
        "Simulated ranks (threads, each with its own TCPStore client, 128 to a process, rank 0 alone) run "
        "tierckpt's coordinator and its save and restore code against one TCPStore server (libuv, torch's "
        "default) on the VM's 2 cores; "
        "only storage is simulated (each node's local tier holds the newest 2 steps, the remote those and 1 or 100 "
        "older ones). A save; a restart with every node intact; one with a node of 8 ranks wiped; one with every "
        "node wiped. Bytes count keys and values sent and received. [Multi-rank jobs](distributed.md) discusses "
        "them.",
        _restart_sim),
    Benchmark(
        "reshard-index", "Resharding: a step's metadata read per rank", rf"cpu_{_TAG}_reshard_index\.json",
        (".venv/bin/python benchmarks/reshard_index.py --out reshard_index.json",),
        "A synthetic FSDP step of W ranks (100 tensors, each `Shard(0)` on a 1-D mesh) restored on W/2: per "
        "target rank, what it reads to find the saved ranks it needs, counted by a POSIX store that counts every "
        "request and byte. Before: the remote's whole `manifest.json`, then every saved rank's box of every "
        "tensor; after: the shard index's head and the blocks naming the ranks needed (the library's own reader), "
        "and the overlapping mesh coordinates only. The most bytes and requests of 4 sampled ranks, median times "
        "(the VM was loaded by other work: upper bounds). [Multi-rank jobs](distributed.md) discusses them.",
        _reshard_index),
)


# ------------------------------------------------------------------------------------------------------ runs
def _args_of(doc: dict[str, Any]) -> dict[str, Any]:
    """What a results file recorded of its command line: ``args`` (bench, restart, ...), ``config`` (training
    loops), and top-level scalars (``repeats``, ``saves``, ``size_mib``)."""
    found = {k: v for k, v in doc.items() if not isinstance(v, (dict, list))}
    found.update(doc.get("config") or {})
    found.update(doc.get("args") or {})
    return found


def disagreements(command: str, doc: dict[str, Any]) -> list[str]:
    """The options of ``command`` whose value the results file recorded otherwise (paths are not compared)."""
    recorded = _args_of(doc)
    words = shlex.split(command)
    out = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        key = word[2:].replace("-", "_")
        value = None
        if i < len(words) and not words[i].startswith("--"):
            value, i = words[i], i + 1
        if key in ("out", "markdown", "dir", "plot") or key not in recorded:
            continue
        got = recorded[key]
        if value is None:
            ok = got is True
        elif isinstance(got, list):
            ok = value in got or value.split(",") == [str(v) for v in got]
        elif isinstance(got, bool) or got is None:
            ok = False
        elif isinstance(got, (int, float)):
            try:
                ok = float(value) == float(got)
            except ValueError:
                ok = False
        else:
            ok = str(got) == value
        if not ok:
            out.append(f"{word} {value if value is not None else ''}".strip() + f" (the file recorded {got!r})")
    return out


@dataclass
class Found:
    """The results of one benchmark: the newest run's files, and the older ones (superseded)."""

    bench: Benchmark
    run: Run
    tag: str
    superseded: list[str]


def collect(results_dir: Path) -> tuple[list[Found], list[str]]:
    """Each benchmark's newest run in ``results_dir``, and the messages for what the build warns about."""
    problems: list[str] = []
    by_bench: dict[str, dict[str, list[str]]] = {b.key: {} for b in BENCHMARKS}
    for path in sorted(results_dir.glob("*.json")):
        matches = [(b, m) for b in BENCHMARKS if (m := re.fullmatch(b.pattern, path.name))]
        if not matches:
            problems.append(f"{RESULTS}/{path.name} is read by no benchmark of docs/hooks/results.py: add one, "
                            "or remove the file")
            continue
        if len(matches) > 1:
            problems.append(f"{RESULTS}/{path.name} matches benchmarks {[b.key for b, _ in matches]}")
        b, m = matches[0]
        by_bench[b.key].setdefault(m.group("tag"), []).append(path.name)
    found = []
    for b in BENCHMARKS:
        tags = by_bench[b.key]
        if not tags:
            problems.append(f"benchmark {b.key!r} has no results file in {RESULTS}/")
            continue
        newest = max(tags)
        old = sorted(n for t, names in tags.items() if t != newest for n in names)
        for name in old:
            problems.append(f"{RESULTS}/{name} is superseded by the newer run {newest} of {b.key!r}: remove it "
                            "(git history keeps it)")
        run = [(n, json.loads((results_dir / n).read_text())) for n in sorted(tags[newest])]
        for name, doc in run:
            wrong = [disagreements(c, doc) for c in b.commands]
            if all(wrong):
                problems.append(f"{RESULTS}/{name}: the command of {b.key!r} disagrees with the recorded "
                                f"arguments: {'; '.join(min(wrong, key=len))}")
        found.append(Found(b, run, newest, old))
    return found, problems


def _machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine")
    if isinstance(m, dict):
        return f"{m.get('cores', '?')}-core {m.get('cpu', '?').replace('(R)', '')}"
    if "device" in doc:
        return str(doc["device"])
    if "cpus" in doc:
        return f"{doc['cpus']}-core {doc.get('machine', '')}".strip()
    return "machine not recorded"


def render(found: list[Found]) -> tuple[str, str]:
    """The summary table and the details sections."""
    rows, details = [], []
    for f in found:
        head, detail = f.bench.render(f.run)
        files = ", ".join(f"[{Path(n).stem}]({RESULTS}/{n})" for n, _ in f.run)
        rows.append([f"[{f.bench.title}](#{f.bench.key})", head, f"{f.tag[:10]}, {_machine(f.run[0][1])}", files])
        commands = "\n".join(f.bench.commands)
        details.append(f"### {f.bench.title} {{#{f.bench.key}}}\n\n{f.bench.method}\n\n```bash\n{commands}\n```\n\n"
                       f"Results: {files}.\n\n{detail}\n")
    return table(["benchmark", "result", "run", "results"], rows), "\n".join(details)


# ------------------------------------------------------------------------------------------------------ the hook
def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    found, problems = collect(Path(config.docs_dir) / RESULTS)
    for msg in problems:
        log.warning("%s", msg)
    summary, details = render(found)
    for marker in ("<!-- results:summary -->", "<!-- results:details -->"):
        if marker not in markdown:
            log.warning("%s has no %s marker", PAGE, marker)
    return markdown.replace("<!-- results:summary -->", summary).replace("<!-- results:details -->", details)
