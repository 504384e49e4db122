"""Each restore path against its simpler neighbour: the A/B behind the paths docs/design.md keeps.

    python benchmarks/restore_paths.py [--states 0.5x592,0.5x10000,2x592] [--rounds 4] [--out paths.json]

For each state (``gpt_state`` of each size and tensor count; 592 tensors: the benchmark's 12 layers) the script
saves one step with a default manager, then, round after round, restores it into a zero-filled state of the same
shapes with each variant below, cold (the step's files dropped from the page cache with ``posix_fadvise(DONTNEED)``,
on a quiet disk) and, where the variant differs warm, warm (the files read into the page cache first). The
variants' order rotates each round. The default restore's variants (``guarded``, ``staged``, ``guarded-buffered``)
run in one manager per state whose staging slot an untimed first restore allocated: both modes fill a state-sized
slot, and faulting a fresh one in on the reference VM takes 0.5-6 s, so much more than the paths differ by that a
fresh slot a restore leaves nothing to compare. The in-place variants restore from a fresh manager each time (no
slot, fresh bounce buffers: a restart). A variant is the library's own path with one choice forced the other way,
through the module attribute that makes it:

| variant | forced | neighbour |
|---|---|---|
| ``guarded`` | nothing: the default restore of local files | ``staged`` |
| ``staged`` | ``_restore.GUARD_MIN_SHARE`` above 1: every byte into the slot, verified, then copied in | |
| ``guarded-buffered`` | no bounce buffers: cold scattered reads go through the page cache | ``guarded`` |
| ``in-place`` | ``restore(in_place=True)`` | |
| ``in-place-buffered`` | as ``guarded-buffered``, in place | ``in-place`` |
| ``in-place-slot`` | ``_restore.SPARSE_MAX_SHARE`` below 0: the small rest goes into a fresh slot | ``in-place`` |
| ``in-place-ready`` | in place, the manager holding a ready slot (``reserve_staging``, untimed) | |
| ``in-place-ready-own`` | as ``in-place-ready``, bounce buffers of its own, not cut from it | ``in-place-ready`` |

Reported per state and cache: each variant's median seconds with its spread (min-max), and the median of the
per-round ratios of each variant to its neighbour (the same round, so a drift of the shared disk cancels). Every
restore is checked: the right step and one tensor's sum equal to the saved one's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from common import (
    GiB,
    add_output_args,
    disk_idle,
    emit_table,
    fresh_dir,
    import_tierckpt,
    markdown_table,
    median,
    read_into_page_cache,
    remove,
    scratch_dir,
    settle,
    wait_for_quiet,
)
from state import gpt_state, state_bytes

#: variant -> (restore keywords, module attributes forced: (module, name, value))
VARIANTS: dict[str, tuple[dict[str, Any], tuple[tuple[str, str, Any], ...]]] = {
    "guarded": ({}, ()),
    "staged": ({}, (("tierckpt._restore", "GUARD_MIN_SHARE", 2.0),)),
    "guarded-buffered": ({}, (("tierckpt._restore", "_bounce_buffers", lambda *a, **k: None),)),
    "in-place": ({"in_place": True}, ()),
    "in-place-buffered": ({"in_place": True}, (("tierckpt._restore", "_bounce_buffers", lambda *a, **k: None),)),
    "in-place-slot": ({"in_place": True}, (("tierckpt._restore", "SPARSE_MAX_SHARE", -1.0),)),
    "in-place-ready": ({"in_place": True}, ()),
    "in-place-ready-own": ({"in_place": True}, (("tierckpt._restore", "_bounce_buffers", None),)),
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
    """Set each module attribute for the duration (every one must exist: a variant never adds a knob)."""
    saved = []
    try:
        for mod, name, value in attrs:
            m = sys.modules[mod]
            if not hasattr(m, name):
                raise SystemExit(f"{mod}.{name} does not exist: this variant's path is gone")
            old = getattr(m, name)
            saved.append((m, name, old))
            setattr(m, name, _own_bounce(old) if name == "_bounce_buffers" and value is None else value)
        yield
    finally:
        for m, name, old in reversed(saved):
            setattr(m, name, old)


def _own_bounce(real: Any) -> Any:
    def own(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "borrow": False})

    return own


def zeros_like_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return tree


def probe(tree: Any) -> torch.Tensor:
    """The state's largest tensor (the embedding's master weights): the one whose sum checks each restore."""
    out: list[torch.Tensor] = []

    def walk(t: Any) -> None:
        if isinstance(t, dict):
            for v in t.values():
                walk(v)
        elif isinstance(t, torch.Tensor):
            out.append(t)

    walk(tree)
    return max(out, key=lambda t: t.nbytes)


def drop_files(folder: Path) -> None:
    """Drop every file under ``folder`` from the page cache (clean pages: the save fsynced them)."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_restore(tc: Any, folder: Path, target: Any, variant: str, cold: bool, expect: float,
                shared: Any = None) -> float:
    """Seconds of one verified restore of ``variant``; in ``shared`` (a manager) for :data:`SHARED` ones."""
    kwargs, attrs = VARIANTS[variant]
    if variant in SHARED:
        folder = Path(shared.local.root)
    with forced(attrs), contextlib.ExitStack() as stack:
        mgr = shared if variant in SHARED else stack.enter_context(
            tc.CheckpointManager(folder, keep_local=2))
        if variant in READY:
            mgr.reserve_staging(target).result()
        if cold:
            drop_files(folder)
        else:
            read_into_page_cache(folder)
        wait_for_quiet(2.0)
        disk_idle(folder)
        allocations = mgr._pool.allocations
        t0 = time.perf_counter()
        step = mgr.restore(target, **kwargs)
        dt = time.perf_counter() - t0
        if allocations and mgr._pool.allocations != allocations:  # a ready slot was there: it must be used
            raise SystemExit(f"{variant}: the restore allocated a staging slot beside the ready one")
    got = float(probe(target).double().sum())
    if step != 1 or got != expect:
        raise SystemExit(f"{variant}: restored step {step} (sum {got!r}), expected step 1 (sum {expect!r})")
    probe(target).zero_()  # the next restore must bring its bytes again
    settle()
    return dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", default="0.5x592,0.5x10000,2x592",
                   help="GiBxTENSORS, comma-separated (592 tensors: the benchmark's 12 layers)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    add_output_args(p)
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or a.rounds < 1:
        p.error(f"unknown variants {unknown}" if unknown else "--rounds must be at least 1")
    tc, why = import_tierckpt()
    if tc is None:
        print(f"restore paths benchmark skipped: {why}")
        return 0
    import tierckpt._restore  # noqa: F401  (the module the variants force attributes of)

    scratch = scratch_dir(a.dir)
    rows = []
    summary: dict[str, Any] = {}
    for gib, count in ((float(g), int(c)) for g, c in (st.split("x") for st in a.states.split(","))):
        folder = fresh_dir(scratch, "restore_paths")
        try:
            state = gpt_state(int(gib * GiB), **({"n_layer": 12} if count == 592 else {"n_tensors": count}))
            nbytes, n = state_bytes(state), sum(1 for _ in _leaves(state))
            expect = float(probe(state).double().sum())
            with tc.CheckpointManager(folder, keep_local=2) as mgr:
                mgr.save(1, state)
            target = zeros_like_tree(state)
            del state
            settle()
            label = f"{nbytes / GiB:.2f} GiB, {n} tensors"
            # a copy of the step for the shared manager (each folder takes one manager at a time)
            shutil.copytree(folder, shared_dir := scratch / f"{folder.name}-shared")
            shared = tc.CheckpointManager(shared_dir, keep_local=2)
            one_restore(tc, folder, target, "guarded", True, expect, shared)  # untimed: allocates its slot
            times: dict[tuple[str, str], list[float]] = {}
            for r in range(a.rounds):
                order = variants[r % len(variants):] + variants[: r % len(variants)]
                for v in order:
                    for cache in ("cold", "warm"):
                        if cache == "warm" and v in COLD_ONLY:
                            continue
                        dt = one_restore(tc, folder, target, v, cache == "cold", expect, shared)
                        times.setdefault((v, cache), []).append(dt)
                        print(f"[{time.strftime('%H:%M:%S')}] {label} round {r + 1}/{a.rounds} {v} {cache}: "
                              f"{dt:.3f} s", file=sys.stderr, flush=True)
            shared.close()
            del target, shared
            settle()
        finally:
            remove(folder)
            remove(scratch / f"{folder.name}-shared")
        for (v, cache), ts in times.items():
            nb = NEIGHBOUR.get(v)
            base = times.get((nb, cache)) if nb else None
            ratios = [x / y for x, y in zip(ts, base, strict=True)] if base else []
            rows.append([label, cache, v, f"{median(ts):.3f}", f"{min(ts):.3f}-{max(ts):.3f}",
                         nb or "", f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios
                         else ""])
            summary[f"{label} {cache} {v}"] = {"median_s": median(ts), "all_s": ts, "neighbour": nb,
                                                "ratio_median": median(ratios) if ratios else None,
                                                "ratios": ratios}
    heads = ["state", "cache", "variant", "median s", "min-max s", "neighbour",
             "/ neighbour, per round: median (min-max)"]
    title = f"#### Restore paths against their neighbours ({a.rounds} interleaved rounds)"
    emit_table(a, "restore_paths", f"{title}\n\n{markdown_table(heads, rows)}", scratch, tc, summary=summary)
    return 0


def _leaves(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


if __name__ == "__main__":
    raise SystemExit(main())
