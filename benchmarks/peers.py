"""The usual peers of a checkpoint library on the same state: ``torch.save``, ``safetensors``, DCP ``save`` on 1 and
2 writer threads, DCP ``async_save`` with its default staging and with ``DefaultStager``; each one's stall, durable
time, extra RSS and (but for ``async_save``) cold and warm load into a preallocated target.

    python benchmarks/peers.py [--size-gib 1] [--repeats 3] [--quick] [--peers a,b] [--out peers.json]

The peers' rows of ``bench.py``'s tables (its options; ``--help`` lists them), with the limits they are measured
against; ``bench.py`` runs them interleaved with tierckpt's cases.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness as h
import torch
from _suite import Case, Ctx, timed_loads
from harness import Metrics

#: the peers, in table order
PEERS = ["torch.save", "safetensors", "dcp.save(t1)", "dcp.save(t2)", "dcp.async_save", "dcp.async_save+DefaultStager"]


# ------------------------------------------------------------------------------------------ peers
def _synchronous(ctx: Ctx, name: str, save: Callable[[Path], Any], load: Callable[[Path], Any]) -> Metrics:
    """A synchronous saver: ``save(folder)`` (which fsyncs) timed as both stall and durable, with its extra RSS;
    then ``load(folder)`` into the target, cold and warm (:func:`_suite.timed_loads`)."""
    out: Metrics = {}
    d = h.fresh_dir(ctx.scratch, name)
    try:
        h.disk_idle(d)
        base = h.rss_bytes()
        with h.RssSampler() as rss, h.timed(out, "stall"):
            save(d)
        out["durable"], out["rss_extra"] = out["stall"], rss.peak - base
        timed_loads(ctx, out, lambda: load(d))
    finally:
        h.remove(d)
    return out


def case_torch_save(ctx: Ctx) -> Metrics:
    """``torch.save`` to one file + fsync; ``torch.load(mmap=False)`` then ``copy_`` into the target."""

    def save(d: Path) -> None:
        with open(d / "ckpt.pt", "wb") as f:
            torch.save(ctx.state, f)
            f.flush()
            os.fsync(f.fileno())
        h.fsync_path(d / "ckpt.pt")

    return _synchronous(ctx, "torchsave", save, lambda d: h.copy_into(
        ctx.dst, torch.load(d / "ckpt.pt", mmap=False, weights_only=True)))


def case_safetensors(ctx: Ctx) -> Metrics:
    """``safetensors.torch.save_file`` of the flat state + fsync; ``load_file`` then ``copy_`` into the target."""
    from safetensors.torch import load_file, save_file

    def save(d: Path) -> None:
        save_file(h.flatten(ctx.state), str(d / "ckpt.safetensors"))
        h.fsync_path(d / "ckpt.safetensors")

    return _synchronous(ctx, "safetensors", save,
                        lambda d: h.copy_into(ctx.dst, load_file(str(d / "ckpt.safetensors"))))


def make_case_dcp_save(thread_count: int) -> Case:
    """DCP ``save`` with ``FileSystemWriter(thread_count=...)`` (it fsyncs its files; the metadata file and the
    folder are fsynced too); DCP ``load`` in place."""

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        def save(d: Path) -> None:
            dcp.save(ctx.state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=thread_count), no_dist=True)
            h.fsync_tree(d)

        return _synchronous(ctx, f"dcp{thread_count}", save,
                            lambda d: dcp.load(ctx.dst, checkpoint_id=str(d), no_dist=True))

    return case


def make_case_dcp_async(stager: bool) -> Case:
    """DCP ``async_save``, with its default (synchronous CPU) staging or with ``DefaultStager``: that one returns
    before the copy is done, and the tensors may change only at ``staging_completion``, so ``stall`` is that and
    ``stall_return`` the bare return. Without CUDA, pinned memory and non-blocking copies are off (it refuses them)."""

    def case(ctx: Ctx) -> Metrics:
        import torch.distributed.checkpoint as dcp

        out: Metrics = {}
        d = h.fresh_dir(ctx.scratch, "dcpasync")
        st = None
        try:
            kwargs: dict[str, Any] = {}
            if stager:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                cuda = torch.cuda.is_available()
                st = kwargs["async_stager"] = DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                    use_non_blocking_copy=cuda))
            h.disk_idle(d)
            base = h.rss_bytes()
            with h.RssSampler() as rss:
                t0 = time.perf_counter()
                resp = dcp.async_save(ctx.state, storage_writer=dcp.FileSystemWriter(str(d), thread_count=1),
                                      no_dist=True, **kwargs)
                out.update(h.dcp_async_times(resp, t0))
                h.fsync_tree(d)
                out["durable"] = time.perf_counter() - t0
            out["rss_extra"] = rss.peak - base
            if ctx.check and ctx.repeat == 0 and ctx.loads:
                ctx.clear_dst()
                dcp.load(ctx.dst, checkpoint_id=str(d), no_dist=True)
                out["load_ok"] = ctx.verify()
        finally:
            if st is not None:
                st.close()
            h.remove(d)
        return out

    return case



def cases(names: list[str] | None = None) -> dict[str, Case]:
    """The peers' cases by display name, in table order: ``names`` (None: all) that this torch has."""
    every: dict[str, Case] = {"torch.save": case_torch_save, "safetensors": case_safetensors,
                              "dcp.save(t1)": make_case_dcp_save(1), "dcp.save(t2)": make_case_dcp_save(2),
                              "dcp.async_save": make_case_dcp_async(stager=False)}
    if h.default_stager_available():
        every["dcp.async_save+DefaultStager"] = make_case_dcp_async(stager=True)
    return {name: every[name] for name in (PEERS if names is None else names) if name in every}


if __name__ == "__main__":
    import bench

    raise SystemExit(bench.main(doc=__doc__, script=__file__, parts=("limits", "peers")))
