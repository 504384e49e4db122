"""The growth fits and the tables of ``request_counts.py``: every count's growth with the world size W (a power law;
a + b*W or a/W + b) extrapolated to 1,024 and 8,192 ranks, the busiest prefix's request rate at that scale, and the
Markdown tables of a run's summaries (:func:`render`). Not a script.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import harness as h
from _request_counts_server import in_step_folder

PHASES = ("save", "restart", "restart-wiped")
EXTRAPOLATE_TO = (1024, 8192)
#: requests a second per prefix that S3 documents it serves: writes (PUT, COPY, POST, DELETE), reads (GET, HEAD)
S3_PREFIX_WRITES_PER_S, S3_PREFIX_READS_PER_S = 3500, 5500
#: what the per-rank tables count
PER_RANK_NOTE = (
    "Local: counted inside each rank on its own local folder, the calls of the os functions (and open) on paths there "
    "or on descriptors of files there, failed ones included: open (os.open, open), fsync (fsync, fdatasync), rename "
    "(rename, replace, renameat2), mkdir, unlink (unlink, remove, rmdir), listdir (listdir, scandir), stat (stat, "
    "lstat, fstat; os.path.exists and the like call stat); bytes read: through os reads and open() there. S3: the "
    "response bodies of the rank's GETs. Each cell with three numbers: the mean over ranks / rank 0 / the busiest "
    "other rank (of that row). k = 1,000 bytes, M = 1,000,000.")
#: what the busiest key and prefix tables count
TARGETS_NOTE = (
    "A request counts against its object key and the key's prefix: the key up to and including its step folder "
    "(run/step-0000000003/); a listing against its prefix parameter's (the root listing: run/); a multi-object delete "
    "against each key it names. In the save phase a key or prefix in a step folder belongs to that step's save, one "
    "outside (the root listing) is spread over the saves. Window: the seconds the rate is taken over (save: the "
    "median over saves of the slowest rank's time from save() until durable and committed on every tier; restart: "
    "the slowest rank's restore).")


# ------------------------------------------------------------------------------------------ growth fits
def _least_squares(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line through ``pts``; None without two distinct x."""
    if len({x for x, _ in pts}) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - slope * mx, slope


def fit_growth(values: dict[int, float | None]) -> dict[str, Any]:
    """Least-squares fits of ``values`` (W -> count), extrapolated to :data:`EXTRAPOLATE_TO`, over the W >= 2 when
    there are two (``fitted_over``; one rank runs the single-process protocol, no point of the multi-rank curve):
    ``exponent`` of count ~ c*W^e over the counts above 0 (``power``), ``exponent_tail`` between the two largest W
    (a constant plus a linear term shows an exponent that climbs towards 1: this is the nearer one); and ``a``,
    ``b`` of count = a + b*W or a/W + b (a per-rank mean of a constant total), whichever fits with the smaller
    squared error (``model``, the first on a tie; ``linear``)."""
    pts = [(w, v) for w, v in sorted(values.items()) if v is not None]
    if len([w for w, _ in pts if w >= 2]) >= 2:
        pts = [(w, v) for w, v in pts if w >= 2]
    out: dict[str, Any] = {"fitted_over": [w for w, _ in pts], "exponent": None, "exponent_tail": None,
                           "power": {}, "model": None, "a": None, "b": None, "linear": {}}
    pos = [(math.log(w), math.log(v)) for w, v in pts if v > 0]
    if (power := _least_squares(pos)) is not None:
        (x1, y1), (x2, y2) = pos[-2:]
        out.update(exponent=power[1], exponent_tail=(y2 - y1) / (x2 - x1),
                   power={str(n): math.exp(power[0]) * n ** power[1] for n in EXTRAPOLATE_TO})
    best: tuple[float, str, float, float] | None = None
    for model, x_of in (("a + b*W", lambda w: w), ("a/W + b", lambda w: 1 / w)):
        if (line := _least_squares([(x_of(w), v) for w, v in pts])) is not None:
            sse = sum((line[0] + line[1] * x_of(w) - v) ** 2 for w, v in pts)
            a, b = line if model == "a + b*W" else line[::-1]
            if best is None or sse < best[0] - 1e-9 * (1 + best[0]):
                best = (sse, model, a, b)
    if best is not None:
        _, model, a, b = best
        out.update(model=model, a=a, b=b, linear={str(n): a + b * n if model == "a + b*W" else a / n + b
                                                  for n in EXTRAPOLATE_TO})
    return out


#: (label, phase, field of :func:`summarize_launch`) of the counts whose growth is fitted
FITTED = [(f"{phase}: {label}", phase, key) for phase in PHASES for label, key in (
    (("requests per save", "per_save"), ("per rank per save (mean)", "per_rank"), ("rank 0 per save", "rank0"),
     ("busiest other rank per save", "max_other_rank"),
     ("manifest GET bytes per rank per save", "manifest_get_bytes_per_rank"),
     ("LIST response bytes per save", "list_bytes")) if phase == "save" else
    (("requests", "per_restart"), ("per rank (mean)", "per_rank"), ("rank 0", "rank0"),
     ("busiest other rank", "max_other_rank"), ("manifest GET bytes per rank", "manifest_get_bytes_per_rank"),
     ("LIST response bytes", "list_bytes")))]
FITTED += [(f"{phase}: {what}{' per save' if phase == 'save' else ''}{' (mean)' if key.endswith('per_rank') else ''}",
            phase, key) for phase in PHASES for what, key in (
    ("busiest key requests", "busiest_key_requests"), ("busiest prefix requests", "busiest_prefix_requests"),
    ("root listing prefix requests", "root_prefix_requests"), ("local ops per rank", "local_ops_per_rank"),
    ("local ops, rank 0", "local_ops_rank0"), ("local ops, busiest other rank", "local_ops_max_other_rank"),
    ("local bytes read per rank", "local_read_bytes_per_rank"), ("local bytes read, rank 0", "local_read_bytes_rank0"),
    ("local bytes read, busiest other rank", "local_read_bytes_max_other_rank"),
    ("S3 bytes read per rank", "read_bytes_per_rank"), ("S3 bytes read, rank 0", "read_bytes_rank0"),
    ("S3 bytes read, busiest other rank", "read_bytes_max_other_rank"))]


def fit_all(summary: dict[int, dict[str, dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
    """Growth fits of :data:`FITTED`, of every kind's count (per save in the save phase) and of every local-tier call
    category's mean per rank, over the worlds; a field that no world has is left out."""
    worlds = sorted(summary)
    rows = []

    def fit(metric: str, values: dict[int, Any]) -> None:
        rows.append({"metric": metric, "values": values, **fit_growth(values)})

    for label, phase, key in FITTED:
        values = {w: summary[w][phase].get(key) for w in worlds if phase in summary[w]}
        if any(v is not None for v in values.values()):
            fit(label, values)
    for phase in PHASES:
        have = [w for w in worlds if phase in summary[w]]
        per, what = (steps, "per save") if phase == "save" else (1, "total")
        for kind in sorted({k for w in have for k in summary[w][phase]["by_kind"]}):
            fit(f"{phase}: {kind} ({what})", {w: summary[w][phase]["by_kind"].get(kind, {"n": 0})["n"] / per
                                              for w in have})
    for phase in PHASES:
        local = {w: summary[w][phase]["local_ops"]["categories"] for w in worlds
                 if phase in summary[w] and summary[w][phase].get("local_ops")}
        what = "per rank per save" if phase == "save" else "per rank"
        for cat in next(iter(local.values()), {}):
            fit(f"{phase}: local {cat} {what} (mean)", {w: c[cat]["per_rank"] for w, c in local.items()})
    return rows


def busiest_prefix_at_scale(summary: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """For each phase and W of :data:`EXTRAPOLATE_TO`: the requests per save (per restart) on the busiest prefix, its
    reads and writes, each from the better linear model of :func:`fit_growth`, and the rates they make spread over
    the phase's window measured at the largest W (``window_s``, ``at_w``): the assumption that a save's upload
    phase at that scale takes the time it took here."""
    out = []
    for phase in PHASES:
        have = [w for w in sorted(summary)
                if phase in summary[w] and summary[w][phase].get("busiest_prefix_requests") is not None]
        if not have:
            continue
        window = summary[have[-1]][phase].get("window_s")
        fits = {k: fit_growth({w: summary[w][phase][f"busiest_prefix_{k}"] for w in have})
                for k in ("requests", "reads", "writes")}
        for n in EXTRAPOLATE_TO:
            row: dict[str, Any] = {"phase": phase, "world": n, "window_s": window, "at_w": have[-1],
                                   "model": fits["requests"]["model"]}
            for k, f in fits.items():
                v = row[k] = f["linear"].get(str(n))
                row[f"{k}_per_s"] = v / window if v is not None and window else None
            out.append(row)
    return out


# ------------------------------------------------------------------------------------------ tables
def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v - round(v)) < 1e-9:
        return f"{int(round(v))}"
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def _size(v: float | None) -> str:
    """A byte count in decimal units (k = 1,000, M = 1,000,000)."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if v is not None and abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return _num(v)


def _trio(spread: dict[str, Any] | None, fmt: Callable[[float | None], str] = _num) -> str:
    """A :func:`_spread` as "mean / rank 0 / busiest other rank"."""
    return " / ".join(fmt(spread.get(k)) for k in ("per_rank", "rank0", "max_other_rank")) if spread else ""


def _per_rank_rows(s: dict[str, Any]) -> dict[str, str]:
    """One phase of one W in the per-rank table (label -> cell)."""
    ops = s.get("local_ops") or {}
    cells = {f"local {cat}": _trio(spread) for cat, spread in ops.get("categories", {}).items()}
    if ops:
        off = [f"{c} {a['wrapped']}!={a['audited']}" for c, a in ops["audit"].items() if a["wrapped"] != a["audited"]]
        cells.update({"local: all calls": _trio(ops["all"]),
                      "local: opens that may create (mean)": _num(ops["creates"]),
                      "local: bytes read": _trio(ops["read_bytes"], _size),
                      "local: audit events = wrapped calls": ", ".join(off) if off else "yes"})
    if s.get("read_bytes_per_rank") is not None:
        cells["S3 bytes read"] = _trio({k: s[f"read_bytes_{k}"] for k in ("per_rank", "rank0", "max_other_rank")},
                                       _size)
        cells.update({f"S3 bytes read: {what} (mean)": _size(v) for what, v in s.get("read_bytes_by_what", {}).items()})
    return cells


def _target_rows(s: dict[str, Any]) -> dict[str, str]:
    """One phase of one W in the busiest key and prefix table (label -> cell)."""
    cells: dict[str, str] = {}
    key, prefix, root = s.get("busiest_key"), s.get("busiest_prefix"), s.get("root_prefix")
    if key:
        cells.update({"busiest key: requests": _num(key["requests"]), "busiest key: kind": key["kind"],
                      "busiest key: reads / writes": f"{_num(key['reads'])} / {_num(key['writes'])}"})
    if prefix:
        name = prefix["name"]
        which = ("step folder" if in_step_folder(name) else "root listing" if root and name == root["name"]
                 else name or "bucket")
        cells.update({"busiest prefix: requests": _num(prefix["requests"]), "busiest prefix: which": which,
                      "busiest prefix: reads / writes": f"{_num(prefix['reads'])} / {_num(prefix['writes'])}"})
    if root:
        cells["root listing prefix: requests"] = _num(root["requests"])
    if "window_s" in s:
        cells["window s"] = _num(s["window_s"])
        cells["busiest prefix: requests / s"] = _num(s["busiest_prefix_rate_per_s"])
    return cells


def _by_phase(summary: dict[int, dict[str, dict[str, Any]]], steps: int, title: str,
              cells_of: Callable[[dict[str, Any]], dict[str, str]]) -> list[str]:
    """One table per phase of ``cells_of``'s rows (in first-seen order), a column per W; none without rows."""
    worlds, lines = sorted(summary), []
    for phase in PHASES:
        cells = {w: cells_of(summary[w][phase]) for w in worlds if phase in summary[w]}
        if labels := list(dict.fromkeys(label for c in cells.values() for label in c)):
            per = f"per save (total / {steps})" if phase == "save" else "per restart"
            lines += ["", f"### {phase}: {title}, {per}", "", h.markdown_table(
                ["what", *(f"W={w}" for w in worlds)], [[lb, *(cells.get(w, {}).get(lb, "") for w in worlds)]
                                                         for lb in labels])]
    return lines


def render_scale(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`busiest_prefix_at_scale` as a table, with its assumption."""
    if not rows:
        return []
    heads = ["phase", "W", "model", "requests", "reads", "writes", "window s", "at W", "req/s", "reads/s", "writes/s"]
    return ["", "### busiest prefix at scale", "",
            "Requests per save (per restart) on the busiest prefix from the better linear fit (a + b*W or a/W + b) "
            "over the measured W; rates assume that these requests arrive spread evenly over the phase's window "
            "measured at the largest W run (save: the median over saves of the slowest rank's time from save() until "
            "durable and committed on every tier; restart: the slowest rank's restore), i.e. that a save's upload "
            f"phase at that scale takes the measured time. S3 documents {S3_PREFIX_WRITES_PER_S:,} writes (PUT, COPY, "
            f"POST, DELETE) and {S3_PREFIX_READS_PER_S:,} reads (GET, HEAD) a second per prefix.", "",
            h.markdown_table(heads, [[r["phase"], str(r["world"]), r["model"] or "-",
                                      *(_num(r[k]) for k in ("requests", "reads", "writes", "window_s")),
                                      str(r["at_w"]), *(_num(r[k]) for k in ("requests_per_s", "reads_per_s",
                                                                             "writes_per_s"))] for r in rows])]


def render(summary: dict[int, dict[str, dict[str, Any]]], fits: list[dict[str, Any]], steps: int) -> str:
    """The tables: each phase's counts by kind for every W; each rank's local-tier calls and bytes read; the
    busiest key and prefix, and the busiest prefix at scale; the fitted growth laws."""
    worlds, lines = sorted(summary), []
    for phase in PHASES:
        rows = [summary[w][phase] for w in worlds if phase in summary[w]]
        if not rows:
            continue
        per = steps if phase == "save" else 1
        cells: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
            (kind, lambda s, k=kind, d=per: s["by_kind"].get(k, {"n": 0})["n"] / d)
            for kind in sorted({k for r in rows for k in r["by_kind"]})]
        cells += [("**all**", lambda s, d=per: s["total"] / d), ("per rank", lambda s: s["per_rank"]),
                  ("rank 0", lambda s: s["rank0"]), ("busiest other rank", lambda s: s["max_other_rank"]),
                  ("manifest GET bytes per rank", lambda s: s["manifest_get_bytes_per_rank"]),
                  ("LIST response bytes", lambda s: s["list_bytes"]),
                  ("untagged (not a rank's)", lambda s: s["untagged"]), ("wall s (all ranks)", lambda s: s["wall_s"]),
                  ("phase s (slowest rank)", lambda s: s["phase_s"])]
        title = f"{phase}: requests per save (total / {steps})" if phase == "save" else f"{phase}: requests (total)"
        lines += ["", f"## {title}", "", h.markdown_table(
            ["kind", *(f"W={w}" for w in worlds)],
            [[label, *(_num(fn(summary[w][phase])) if phase in summary[w] else "" for w in worlds)]
             for label, fn in cells])]
    for title, heading, cells_of, note, more in (
            ("per rank", "per rank: local-tier calls, bytes read", _per_rank_rows, PER_RANK_NOTE, []),
            ("busiest key and prefix", "busiest object key and prefix", _target_rows, TARGETS_NOTE,
             render_scale(busiest_prefix_at_scale(summary)))):
        if tables := _by_phase(summary, steps, title, cells_of):
            lines += ["", f"## {heading}", "", note, *tables, *more]
    n1, n2 = EXTRAPOLATE_TO
    lines += ["", "## growth with W", "",
              "Fitted over W >= 2 (W = 1 runs the single-process protocol) when there are two such W. e: exponent "
              "of count ~ c*W^e (least squares over the W with count > 0); e tail: between the two largest W; "
              "pow@N: that power law at W = N. model: the better least-squares fit of a + b*W and a/W + b; "
              "lin@N: that model at W = N.", "",
              h.markdown_table(["metric", "e", "e tail", f"pow@{n1}", f"pow@{n2}", "model", "a", "b", f"lin@{n1}",
                                f"lin@{n2}"],
                               [[f["metric"], *("-" if v is None else f"{v:+.2f}"
                                                for v in (f["exponent"], f["exponent_tail"])),
                                 *(_num(f["power"].get(str(n))) for n in EXTRAPOLATE_TO), f["model"] or "-",
                                 *("-" if v is None else f"{v:.3g}" for v in (f["a"], f["b"])),
                                 *(_num(f["linear"].get(str(n))) for n in EXTRAPOLATE_TO)] for f in fits])]
    return "\n".join(lines)

