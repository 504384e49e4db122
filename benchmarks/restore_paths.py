"""Each restore path against its simpler neighbour: the A/B behind the paths docs/design.md keeps.

    python benchmarks/restore_paths.py [--states 0.5x592,0.5x10000,2x592] [--rounds 4] [--out paths.json]

For each state (``gpt_state`` of each size and tensor count; 592 tensors: the benchmark's 12 layers) one step is
saved with a default manager; then, round after round, it is restored into a zero-filled state of the same shapes
with each variant below, cold (the step's files dropped from the page cache with ``posix_fadvise(DONTNEED)``, on a
quiet disk) and, where the variant differs warm, warm (the files read into the page cache first). The variants'
order rotates each round. The default restore's variants (``guarded``, ``staged``, ``guarded-buffered``) run in one
manager per state whose staging slot an untimed first restore allocated: both modes fill a state-sized slot, and
faulting a fresh one in on the reference VM takes 0.5-6 s, much more than the paths differ by. The in-place variants
restore from a fresh manager each time (no slot, fresh bounce buffers: a restart). A variant is the library's own
path with one choice forced the other way, through the module attribute that makes it:

| variant | forced | neighbour |
|---|---|---|
| ``guarded`` | nothing: the default restore of local files | ``staged`` |
| ``staged`` | ``engine.restore.GUARD_MIN_SHARE`` above 1: every byte into the slot, verified, then copied in | |
| ``guarded-buffered`` | no bounce buffers: cold scattered reads go through the page cache | ``guarded`` |
| ``in-place`` | ``restore(in_place=True)`` | |
| ``in-place-buffered`` | as ``guarded-buffered``, in place | ``in-place`` |
| ``in-place-slot`` | ``engine.restore.SPARSE_MAX_SHARE`` below 0: the small rest into a fresh slot | ``in-place`` |
| ``in-place-ready`` | in place, the manager holding a ready slot (``reserve_staging``, untimed) | |
| ``in-place-ready-own`` | as ``in-place-ready``, bounce buffers of its own, not cut from it | ``in-place-ready`` |

Reported per state and cache: each variant's median seconds with its spread (min-max), and the median of the
per-round ratios of each variant to its neighbour (the same round, so that a drift of the shared disk cancels).
Every restore is checked: the right step, and one tensor's sum equal to the saved one's.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness as h

RESTORE = "tierckpt.engine.restore"
NO_BOUNCE = (RESTORE, "_bounce_buffers", lambda *a, **k: None)
#: variant -> (restore keywords, module attributes forced: (module, name, value; None: own bounce buffers))
VARIANTS: dict[str, tuple[dict[str, Any], tuple[tuple[str, str, Any], ...]]] = {
    "guarded": ({}, ()),
    "staged": ({}, ((RESTORE, "GUARD_MIN_SHARE", 2.0),)),
    "guarded-buffered": ({}, (NO_BOUNCE,)),
    "in-place": ({"in_place": True}, ()),
    "in-place-buffered": ({"in_place": True}, (NO_BOUNCE,)),
    "in-place-slot": ({"in_place": True}, ((RESTORE, "SPARSE_MAX_SHARE", -1.0),)),
    "in-place-ready": ({"in_place": True}, ()),
    "in-place-ready-own": ({"in_place": True}, ((RESTORE, "_bounce_buffers", None),)),
}
#: variant -> the simpler neighbour it is compared with
NEIGHBOUR = {"guarded": "staged", "guarded-buffered": "guarded", "in-place-buffered": "in-place",
             "in-place-slot": "in-place", "in-place-ready-own": "in-place-ready"}
#: variants restored by one manager per state, its staging slot allocated by an untimed first restore
SHARED = ("guarded", "staged", "guarded-buffered")
#: variants restored by a fresh manager that reserved its staging slot first (untimed)
READY = {"in-place-ready", "in-place-ready-own"}
#: variants that differ from their neighbour only in cold reads (a warm restore takes the same path)
COLD_ONLY = {"guarded-buffered", "in-place-buffered", "in-place-ready", "in-place-ready-own"}


@contextlib.contextmanager
def forced(attrs: tuple[tuple[str, str, Any], ...]) -> Iterator[None]:
    """Each module attribute set for the duration (each must exist: a variant never adds a knob); value None for
    ``_bounce_buffers``: the real one, told not to borrow from a ready slot."""
    saved = []
    try:
        for mod, name, value in attrs:
            m = sys.modules[mod]
            if not hasattr(m, name):
                raise SystemExit(f"{mod}.{name} does not exist: this variant's path is gone")
            old = getattr(m, name)
            saved.append((m, name, old))
            if value is None:
                def value(*args: Any, _real: Any = old, **kwargs: Any) -> Any:
                    return _real(*args, **{**kwargs, "borrow": False})
            setattr(m, name, value)
        yield
    finally:
        for m, name, old in reversed(saved):
            setattr(m, name, old)


def probe(tree: Any) -> Any:
    """The state's largest tensor (the embedding's master weights): the one whose sum checks each restore."""
    return max(h.tensors(tree), key=lambda t: t.nbytes)


def one_restore(tc: Any, folder: Path, target: Any, variant: str, cold: bool, expect: float, shared: Any) -> float:
    """Seconds of one verified restore of ``variant``; in ``shared`` (a manager) for the :data:`SHARED` ones."""
    kwargs, attrs = VARIANTS[variant]
    if variant in SHARED:
        folder = Path(shared.local.root)
    with forced(attrs), contextlib.ExitStack() as stack:
        mgr = shared if variant in SHARED else stack.enter_context(tc.CheckpointManager(folder, keep_local=2))
        if variant in READY:
            mgr.reserve_staging(target).result()
        if cold:
            h.drop_files(folder)
        else:
            h.read_into_page_cache(folder)
        h.wait_for_quiet(2.0)
        h.disk_idle(folder)
        pool = mgr.components.staging
        allocations = pool.allocations
        t0 = time.perf_counter()
        step = mgr.restore(target, **kwargs)
        dt = time.perf_counter() - t0
        if allocations and pool.allocations != allocations:  # a ready slot was there: it must be used
            raise SystemExit(f"{variant}: the restore allocated a staging slot beside the ready one")
    got = float(probe(target).double().sum())
    if step != 1 or got != expect:
        raise SystemExit(f"{variant}: restored step {step} (sum {got!r}), expected step 1 (sum {expect!r})")
    probe(target).zero_()  # the next restore must bring its bytes again
    h.settle()
    return dt


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--states", default="0.5x592,0.5x10000,2x592",
                   help="GiBxTENSORS, comma-separated (592 tensors: the benchmark's 12 layers)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    a = p.parse(argv)
    variants = a.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    tc = h.need_tierckpt("restore paths benchmark")
    __import__(RESTORE)  # the module whose attributes the variants force
    scratch = h.scratch_dir(a.dir)
    rows, summary = [], {}
    for gib, count in ((float(g), int(c)) for g, c in (st.split("x") for st in a.states.split(","))):
        folder = h.fresh_dir(scratch, "restore_paths")
        shared_dir = scratch / f"{folder.name}-shared"  # a copy of the step: a folder takes one manager at a time
        try:
            state = h.gpt_state(int(gib * h.GiB), **({"n_layer": 12} if count == 592 else {"n_tensors": count}))
            label = f"{h.state_bytes(state) / h.GiB:.2f} GiB, {len(h.tensors(state))} tensors"
            expect = float(probe(state).double().sum())
            with tc.CheckpointManager(folder, keep_local=2) as mgr:
                mgr.save(1, state)
            target = h.empty_like_state(state)
            del state
            h.settle()
            shutil.copytree(folder, shared_dir)
            with tc.CheckpointManager(shared_dir, keep_local=2) as shared:
                one_restore(tc, folder, target, "guarded", True, expect, shared)  # untimed: allocates its slot
                times: dict[tuple[str, str], list[float]] = {}
                for r in range(a.rounds):
                    for v in h.rotate(variants, r):
                        for cache in ("cold",) if v in COLD_ONLY else ("cold", "warm"):
                            dt = one_restore(tc, folder, target, v, cache == "cold", expect, shared)
                            times.setdefault((v, cache), []).append(dt)
                            h.log(f"{label} round {r + 1}/{a.rounds} {v} {cache}: {dt:.3f} s")
            del target
            h.settle()
        finally:
            h.remove(folder)
            h.remove(shared_dir)
        for (v, cache), ts in times.items():
            nb = NEIGHBOUR.get(v)
            base = times.get((nb, cache)) if nb else None
            ratios = [x / y for x, y in zip(ts, base, strict=True)] if base else []
            rows.append([label, cache, v, f"{h.median(ts):.3f}", f"{min(ts):.3f}-{max(ts):.3f}", nb or "",
                         f"{h.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""])
            summary[f"{label} {cache} {v}"] = {"median_s": h.median(ts), "all_s": ts, "neighbour": nb,
                                                "ratio_median": h.median(ratios), "ratios": ratios}
    heads = ["state", "cache", "variant", "median s", "min-max s", "neighbour",
             "/ neighbour, per round: median (min-max)"]
    md = h.sections([(f"Restore paths against their neighbours ({a.rounds} interleaved rounds)", heads, rows)])
    print(md)
    h.finish(a, {"kind": "restore_paths", "summary": summary, "machine": h.machine(scratch),
                 "tierckpt_version": tc.__version__, "markdown": md}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
