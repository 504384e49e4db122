"""How many S3 requests a multi-rank job sends, by operation, and how each count grows with the world size W.

    .venv/bin/python benchmarks/request_counts.py [--ranks 1,2,4,8,16] [--steps 3] [--out request_counts.json] [--trace]
    .venv/bin/python benchmarks/request_counts.py --render request_counts.json      # the tables of a saved run again

A counting S3 server runs in this process: moto's app on loopback behind a middleware that counts every request by
operation kind (a listing, a GET of a step ``manifest.json``, of a rank manifest, of a data file, a PUT, a multipart
upload's calls, ...), by rank and phase (each rank tags its User-Agent), by object key and prefix, with the bytes of
request and response bodies. For each W, W rank processes (``_request_counts_rank.py``) are launched once and run
three phases, each counted apart: ``save`` (S saves of 2 MiB per rank, each awaited), ``restart`` (a new manager
restores step S) and ``restart-wiped`` (every local folder deleted first: every shard comes from the remote).

Reported per W and phase: requests by kind, per save, per rank (mean, rank 0, busiest other rank), bytes of
manifests and listings read; each rank's local-tier calls by category and bytes read there and through GETs; the
busiest object key and prefix, and the busiest prefix's request rate at 1,024 and 8,192 ranks; then, for every
count, fits of its growth with W (a power law; a + b*W or a/W + b) extrapolated to 1,024 and 8,192 ranks. The
protocol is meant to cost O(1) requests and local calls per rank per save and per restart, rank 0 alone doing the
job-wide work. A launch whose ranks fail, restore wrong bytes or hang fails the run with each rank's error and, for
a rank still running at the timeout, its threads' stacks (ranks are never left behind).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import statistics
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness as h
from _request_counts_report import PHASES, busiest_prefix_at_scale, fit_all, render
from _request_counts_server import (
    UNTAGGED,
    Counts,
    RequestCounter,
    TargetTally,
    counting_s3_server,
    in_step_folder,
    root_prefix,
)

RANK_SCRIPT = Path(__file__).resolve().parent / "_request_counts_rank.py"
MANIFEST_GETS = ("GET step-manifest", "GET rank-manifest")


# ------------------------------------------------------------------------------------------ launching the ranks
@dataclass
class Launch:
    """One phase of one world size: the requests counted, the ranks' records, its wall time (the first rank's start
    to the last rank's end), the remote (``s3://bucket/folder``), and the launch's requests without a phase tag."""

    phase: str
    world: int
    counts: Counts
    records: list[dict[str, Any]]
    wall_s: float
    remote: str = ""
    untagged: int = 0


class LaunchFailed(RuntimeError):
    """A launch whose ranks failed; ``launches`` holds what was counted and what each rank recorded."""

    def __init__(self, msg: str, launches: dict[str, Launch]) -> None:
        super().__init__(msg)
        self.launches = launches


def launch(server: h.S3, world: int, folder: Path, remote: str, *, steps: int, numel: int,
           phases: Iterable[str] = PHASES, timeout_s: float = 300.0, collective_timeout_s: float = 60.0,
           log_level: str = "WARNING") -> dict[str, Launch]:
    """``world`` rank processes running ``phases`` in turn on ``folder``'s local folders and ``remote``: each phase's
    requests and records. :class:`LaunchFailed` when a rank fails, restores wrong bytes, or the ranks are not done
    after ``timeout_s`` (all are killed then, after each printed its threads' stacks into its log)."""
    phases = list(phases)
    run_dir = folder / f"run-{secrets.token_hex(3)}"
    run_dir.mkdir(parents=True)
    cfg = {"phases": phases, "world": world, "steps": steps, "numel": numel, "remote": remote,
           "storage_options": server.storage_options, "local_root": str(folder / "local"), "run_dir": str(run_dir),
           "collective_timeout_s": collective_timeout_s, "log_level": log_level}
    (cfg_path := run_dir / "config.json").write_text(json.dumps(cfg))
    counter: RequestCounter = server.app.counter
    counter.clear()  # nothing from before this launch
    logs = [run_dir / f"log-r{r:05d}.txt" for r in range(world)]
    done = h.launch([[RANK_SCRIPT, r, cfg_path] for r in range(world)], logs, timeout_s=timeout_s, cwd=run_dir,
                    env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **h.S3_ENV})
    untagged = counter.take("").total()
    launches = {}
    for phase in phases:
        paths = [run_dir / f"result-r{r:05d}-{phase}.json" for r in range(world)]
        records = [json.loads(p.read_text()) if p.exists() else {"rank": r, "ok": False} for r, p in enumerate(paths)]
        spans = [(rec["wall_start"], rec["wall_end"]) for rec in records if "wall_end" in rec]
        wall = max(e for _, e in spans) - min(s for s, _ in spans) if spans else done.wall_s
        launches[phase] = Launch(phase, world, counter.take(phase), records, wall, remote, untagged)
    failed = {r: next((launches[p].records[r] for p in phases if not launches[p].records[r].get("ok")), None)
              for r in range(world)}
    bad = [r for r in range(world) if done.returncodes[r] != 0 or failed[r] is not None]
    if done.stuck or bad:
        # the stuck ranks' stacks first, then the errors of phases (a barrier's error follows another rank's)
        first = [*done.stuck, *sorted((r for r in bad if r not in done.stuck),
                                      key=lambda r: (failed[r] or {}).get("stage") != "phase")]
        detail = [f"--- rank {r} (rc {done.returncodes[r]}): {rec.get('mismatch') or rec.get('error')}\n"
                  f"{rec.get('traceback', '')}{logs[r].read_text()[-6000:]}"
                  for r in first[:4] for rec in [failed[r] or {}]]
        why = (f"rank(s) {done.stuck} still running after {timeout_s:.0f} s (stacks in their logs, {run_dir})"
               if done.stuck else f"rank(s) {bad} failed ({run_dir})")
        raise LaunchFailed(f"{'/'.join(phases)} with {world} ranks: {why}\n" + "\n".join(detail), launches)
    return launches


def run_world(server: h.S3, world: int, scratch: Path, *, steps: int, numel: int, timeout_s: float = 300.0,
              phases: Iterable[str] = PHASES) -> dict[str, Launch]:
    """Every phase for ``world`` ranks, in one launch, on a fresh remote prefix and fresh local folders."""
    folder = scratch / f"w{world:05d}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    return launch(server, world, folder, f"s3://{server.bucket}/{folder.name}", steps=steps, numel=numel,
                  phases=phases, timeout_s=timeout_s)


# ------------------------------------------------------------------------------------------ summaries
def _spread(values: list[float], w: int, per: float) -> dict[str, float | None]:
    """Of one number per rank (rank order): the mean, rank 0's and the largest other rank's, each / ``per``."""
    return {"per_rank": sum(values) / w / per, "rank0": values[0] / per,
            "max_other_rank": max(values[1:]) / per if w > 1 else None}


def summarize_local_ops(records: list[dict[str, Any]], w: int, per: float) -> dict[str, Any]:
    """The ranks' local-tier calls per save (``per``: the saves) or per restart: each category's and all calls'
    :func:`_spread`, the mean of every function's count (``by_call``), of the opens that may create a file, the bytes
    read locally; ``audit``: over all ranks, each audited category's wrapped calls against CPython's audit events.
    Empty when the records hold no counts."""
    ops = [rec.get("local_ops") for rec in records]
    if len(ops) != w or not all(ops):
        return {}
    cats = [o["categories"] for o in ops]
    calls = sorted({k for o in ops for k in o["calls"]})
    return {"categories": {c: _spread([x.get(c, 0) for x in cats], w, per) for c in cats[0]},
            "all": _spread([sum(x.values()) for x in cats], w, per),
            "creates": sum(o["creates"] for o in ops) / w / per,
            "read_bytes": _spread([o["read_bytes"] for o in ops], w, per),
            "by_call": {k: sum(o["calls"].get(k, 0) for o in ops) / w / per for k in calls},
            "failed": {k: n for k in calls if (n := sum(o["failed"].get(k, 0) for o in ops))},
            "audit": {c: {"wrapped": sum(o["audit_wrapped"][c] for o in ops),
                          "audited": sum(o["audit"].get(c, 0) for o in ops)} for c in ops[0]["audit_wrapped"]}}


def _hottest(tallies: dict[str, TargetTally], phase: str, steps: int) -> dict[str, Any] | None:
    """The key or prefix with the most requests per save (per restart outside the save phase): a name in a step
    folder belongs to one save, any other is spread over every save; the first in name order on a tie."""
    if not tallies:
        return None

    def spans(name: str) -> int:
        return 1 if phase != "save" or in_step_folder(name) else steps

    name = max(sorted(tallies), key=lambda k: tallies[k].n / spans(k))
    return _target(name, tallies[name], spans(name))


def _target(name: str, t: TargetTally, spans: int) -> dict[str, Any]:
    return {"name": name, "kind": t.kind, "requests": t.n / spans, "reads": t.reads / spans,
            "writes": t.writes / spans, "total": t.n, "saves": spans}


def phase_window_s(launch: Launch) -> float | None:
    """The seconds a phase's requests are spread over, for a rate: in the save phase the median over saves of the
    slowest rank's save (from ``save()`` until durable and committed on every tier), else the slowest restore."""
    if launch.phase == "save":
        times = [rec.get("save_s") for rec in launch.records]
        if not times or not all(times) or len({len(t) for t in times}) != 1:
            return None
        return statistics.median(max(t[i] for t in times) for i in range(len(times[0])))
    restores = [rec.get("restore_s") for rec in launch.records]
    return max(restores) if restores and all(r is not None for r in restores) else None


def summarize_launch(launch: Launch, steps: int) -> dict[str, Any]:
    """The numbers reported for one phase of one world size (JSON-able); the save phase's per save."""
    c, w, save = launch.counts, launch.world, launch.phase == "save"
    per = steps if save else 1
    by_rank = c.by_rank()
    others = [by_rank.get(r, 0) for r in range(1, w)]
    gets = [c.get_bytes(r) for r in range(w)]
    read = _spread([sum(b.values()) for b in gets], w, per)
    out: dict[str, Any] = {
        "world": w, "phase": launch.phase, "wall_s": round(launch.wall_s, 3),
        "phase_s": round(max(rec.get("phase_s", 0.0) for rec in launch.records), 3), "total": c.total(),
        "per_save" if save else "per_restart": c.total() / per, "per_rank": c.total() / per / w,
        "rank0": by_rank.get(0, 0) / per, "max_other_rank": max(others) / per if others else None,
        "untagged": by_rank.get(UNTAGGED, 0) + launch.untagged,
        "manifest_get_bytes_per_rank": c.bytes_out(kinds=MANIFEST_GETS) / per / w,
        "list_bytes": c.bytes_out(kinds=["GET list"]) / per,
        **{f"read_bytes_{k}": v for k, v in read.items()},
        "read_bytes_by_what": {k: sum(b[k] for b in gets) / w / per for k in gets[0]},
    }
    if ops := summarize_local_ops(launch.records, w, per):
        out["local_ops"] = ops
        for name, spread in (("local_ops", ops["all"]), ("local_read_bytes", ops["read_bytes"])):
            out.update({f"{name}_{k}": v for k, v in spread.items()})
    key, prefix = _hottest(c.keys, launch.phase, steps), _hottest(c.prefixes, launch.phase, steps)
    root = _target(root_prefix(launch.remote), c.prefixes.get(root_prefix(launch.remote), TargetTally()), per)
    window = phase_window_s(launch)
    out.update(busiest_key=key, busiest_key_requests=key and key["requests"], busiest_prefix=prefix,
               **{f"busiest_prefix_{k}": prefix and prefix[k] for k in ("requests", "reads", "writes")},
               root_prefix=root, root_prefix_requests=root["requests"], window_s=window,
               busiest_prefix_rate_per_s=prefix["requests"] / window if window and prefix else None,
               by_kind={k: vars(t) for k, t in c.by_kind().items()}, by_rank={str(r): n for r, n in by_rank.items()})
    if c.trace:
        out["trace"] = [list(t) for t in c.trace]
    return out



def run(worlds: Iterable[int], *, steps: int = 3, numel: int = 512 * 1024, scratch: Path | None = None,
        timeout_s: float = 300.0, trace: bool = False) -> dict[str, Any]:
    """The whole benchmark (JSON-able): a counting server, every world size's phases, the summaries and the fits.
    ``scratch``: the ranks' local folders (a temporary folder by default); ``trace``: every request in each phase's
    summary too."""
    worlds = sorted(set(worlds))
    summary: dict[int, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tierckpt-requests-")))
        scratch.mkdir(parents=True, exist_ok=True)
        server = stack.enter_context(counting_s3_server(trace=trace))
        for w in worlds:
            launches = run_world(server, w, scratch, steps=steps, numel=numel, timeout_s=timeout_s)
            summary[w] = {p: summarize_launch(launch, steps) for p, launch in launches.items()}
            h.log(f"W={w}: " + ", ".join(f"{p} {s['wall_s']:.1f} s" for p, s in summary[w].items()))
    fits = fit_all(summary, steps)
    return {"kind": "requests", "ranks": worlds, "steps": steps, "numel": numel, "state_bytes_per_rank": 4 * numel,
            "summary": {str(w): s for w, s in summary.items()}, "fits": fits,
            "busiest_prefix_at_scale": busiest_prefix_at_scale(summary), "table": render(summary, fits, steps)}


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__, markdown=False, scratch=False)
    p.add_argument("--dir", help="folder for the ranks' local tiers (default: a temporary folder)")
    p.add_argument("--ranks", default="1,2,4,8,16", help="world sizes, comma-separated (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="saves per world size (default %(default)s)")
    p.add_argument("--numel", type=int, default=512 * 1024, help="float32 values per rank (default %(default)s: 2 MiB)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch of W ranks (default %(default)s)")
    p.add_argument("--trace", action="store_true", help="every request (rank, method, path, status) in the JSON")
    p.add_argument("--render", type=Path, default=None, metavar="JSON",
                   help="run nothing: fit and print the tables of a JSON that --out wrote")
    args = p.parse(argv)
    if args.render is not None:
        old = json.loads(args.render.read_text())
        summary = {int(w): s for w, s in old["summary"].items()}
        print(render(summary, fit_all(summary, old["steps"]), old["steps"]))
        return 0
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not worlds or min(worlds) < 1 or args.steps < 1:
        p.error("--ranks needs positive world sizes and --steps a positive count")
    report = run(worlds, steps=args.steps, numel=args.numel, scratch=Path(args.dir) if args.dir else None,
                 timeout_s=args.timeout, trace=args.trace)
    print(report["table"])
    h.finish(args, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
