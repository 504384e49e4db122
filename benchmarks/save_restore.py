"""tierckpt's own saves and restores on the local tier, and with a remote tier: the first and the steady save's
stall and durable time (each steady save next to a raw write of the same bytes), RSS, the default and the in-place
restore cold and warm (each cold one next to a raw read of the same bytes), ``overlap_writes=False``, and the upload
to a POSIX folder and to S3 (moto on loopback).

    python benchmarks/save_restore.py [--size-gib 1] [--repeats 3] [--quick] [--saves 4] [--restore-pairs 4] \
        [--tierckpt-opt K=V] [--no-remote] [--no-s3] [--out save_restore.json]

tierckpt's rows and details of ``bench.py``'s tables (its options; ``--help`` lists them), with the limits they are
measured against; ``bench.py`` runs these cases interleaved with the peers'.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import harness as h
from _suite import Case, Ctx, cold
from harness import Metrics


# ------------------------------------------------------------------------------------------ tierckpt
def _since(fut: Any, t0: float) -> float:
    """Wait for a stage's future; seconds since ``t0`` on this clock (the library's own number is kept apart)."""
    fut.result()
    return time.perf_counter() - t0


def case_tierckpt(ctx: Ctx) -> Metrics:
    """tierckpt, local tier only: ``ctx.saves`` saves, each awaited, then verified restores, cold and warm, by default
    and in place, from a fresh manager over the same folder. The first save apart from the steady state (p50 and
    max of the rest); RSS growth between the second and the last save (a steady save should allocate nothing
    large); peak extra RSS."""
    tc = ctx.tierckpt
    assert tc is not None
    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, "tierckpt")
    stalls: list[float] = []
    durables: list[float] = []
    lib_durables: list[float] = []
    rss_after: list[int] = []
    durable_pairs: list[tuple[float, float]] = []
    try:
        base = h.rss_bytes()
        with h.RssSampler() as rss, tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs) as mgr:
            for k in range(ctx.saves):
                ref = ctx.ref if k > 0 else None  # steady saves get the write limit next to them, before or after
                first = ref is not None and ctx.ref_turns % 2 == 0
                ctx.ref_turns += ref is not None
                wref = ref.write(ctx) if ref is not None and first else None
                h.disk_idle(d)  # the previous save's retention deleted a step: its discards finish first
                t0 = time.perf_counter()
                handle = mgr.save(k + 1, ctx.state)
                stalls.append(time.perf_counter() - t0)
                durables.append(_since(handle.persisted, t0))
                lib_durables.append(float(handle.persisted.result()))
                mgr.wait()
                rss_after.append(h.rss_bytes())
                if ref is not None and not first:
                    wref = ref.write(ctx)
                if wref is not None:
                    durable_pairs.append((durables[-1], wref))
        steady = stalls[1:] or stalls
        out.update(rss_extra=rss.peak - base, first_stall=stalls[0], first_durable=durables[0],
                   stall=h.median(steady), stall_max=max(steady), durable=h.median(durables[1:] or durables),
                   durable_lib=h.median(lib_durables[1:] or lib_durables),
                   rss_growth_steady=rss_after[-1] - rss_after[1] if len(rss_after) > 2 else None)
        if durable_pairs:
            out["durable_pairs"] = durable_pairs
        del mgr  # its staging memory goes before the restores
        h.settle()
        if ctx.loads:
            with tc.CheckpointManager(d / "local", **ctx.tierckpt_kwargs) as mgr:
                _restores(ctx, out, mgr, d / "local")
    finally:
        h.remove(d)
    return out


def _restores(ctx: Ctx, out: Metrics, mgr: Any, folder: Path) -> None:
    """The default restore and ``in_place=True``, each cold (with RSS) and warm (the step's files read into the page
    cache first, untimed: a cold restore reads around the cache and leaves nothing there); then
    ``ctx.restore_pairs - 1`` more cold in-place restores, each with its adjacent read: one pair a repeat cannot
    tell 1.05x from 1.15x on a disk whose reads vary by 10-25% (the default restore gets one pair: its first
    restore in a process, with a fresh staging buffer, is the one a restarting job pays)."""
    for suffix, kwargs in (("", {}), ("_inplace", {"in_place": True})):
        with cold(ctx, out, f"load_cold{suffix}"):
            base = h.rss_bytes()
            with h.RssSampler() as rss, h.timed(out, f"load_cold{suffix}"):
                step = mgr.restore(ctx.dst, **kwargs)
            out[f"rss_extra_restore{suffix}"] = rss.peak - base
            if suffix:
                out["load_inplace_ok"] = step == ctx.saves and ctx.verify() is not False
            else:
                out["restored_step_ok"], out["load_ok"] = step == ctx.saves, ctx.verify()
            h.read_into_page_cache(folder)
            with h.timed(out, f"load_warm{suffix}"):
                mgr.restore(ctx.dst, **kwargs)
    pairs = [(out["load_cold_inplace"], out.get("load_cold_inplace_ref"))]
    for _ in range(ctx.restore_pairs - 1):
        more: Metrics = {}
        with cold(ctx, more, "load_cold_inplace"), h.timed(more, "load_cold_inplace"):
            mgr.restore(ctx.dst, in_place=True)
        pairs.append((more["load_cold_inplace"], more.get("load_cold_inplace_ref")))
    if ctx.ref is not None:
        out["load_cold_inplace_pairs"] = pairs


def case_tierckpt_copy_first(ctx: Ctx) -> Metrics:
    """tierckpt with ``overlap_writes=False`` (the whole copy, then the writes), saves only: the other side of the
    trade-off from the default, which writes while it copies."""
    kwargs = {**ctx.tierckpt_kwargs, "overlap_writes": False}
    return case_tierckpt(dataclasses.replace(ctx, loads=False, tierckpt_kwargs=kwargs))


def make_case_tierckpt_remote(kind: str) -> Case:
    """tierckpt with a remote tier (``posix``: a folder on the same disk; ``s3``: moto on loopback): two saves, the
    second reported: ``stall``, ``durable`` (local), ``remote_durable`` (until ``handle.uploaded``, from the start of
    the save) and ``upload`` (remote minus local)."""

    def case(ctx: Ctx) -> Metrics:
        tc = ctx.tierckpt
        assert tc is not None
        if kind == "s3" and ctx.s3 is None:
            return {"skipped": "no S3 server"}
        out: Metrics = {}
        d = h.fresh_dir(ctx.scratch, f"tierckpt-{kind}")
        kwargs = {"keep_remote": 1, **ctx.tierckpt_kwargs}
        if kind == "posix":
            remote = str(d / "remote")
        else:
            remote = f"s3://{ctx.s3.bucket}/{d.name}"  # type: ignore[union-attr]
            kwargs["storage_options"] = ctx.s3.storage_options  # type: ignore[union-attr]
        try:
            base = h.rss_bytes()
            with h.RssSampler() as rss, tc.CheckpointManager(d / "local", remote=remote, **kwargs) as mgr:
                for k in range(2):
                    h.disk_idle(d)
                    t0 = time.perf_counter()
                    handle = mgr.save(k + 1, ctx.state)
                    stall = time.perf_counter() - t0
                    durable, remote_durable = _since(handle.persisted, t0), _since(handle.uploaded, t0)
                    mgr.wait()
                    if k == 0:
                        out["first_stall"], out["first_remote_durable"] = stall, remote_durable
            out.update(stall=stall, durable=durable, remote_durable=remote_durable, upload=remote_durable - durable)
            if kind != "s3":  # moto's server runs in this process and holds the objects in memory
                out["rss_extra"] = rss.peak - base
        finally:
            h.remove(d)
            if kind == "s3":
                ctx.s3.rm(d.name)  # type: ignore[union-attr]
        return out

    return case



def cases(*, overlap: bool, remote: bool, s3: bool) -> dict[str, Case]:
    """tierckpt's cases by display name (``overlap``: also copying first; ``remote``: a POSIX remote; ``s3``: S3)."""
    out: dict[str, Case] = {"tierckpt": case_tierckpt}
    if overlap:
        out["tierckpt copy-first"] = case_tierckpt_copy_first
    if remote:
        out["tierckpt+posix"] = make_case_tierckpt_remote("posix")
    if s3:
        out["tierckpt+s3"] = make_case_tierckpt_remote("s3")
    return out


if __name__ == "__main__":
    import bench

    raise SystemExit(bench.main(doc=__doc__, script=__file__, parts=("limits", "tierckpt")))
