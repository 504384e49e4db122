"""Training-loop view: step-time overhead of checkpointing every N steps, against no checkpointing.

    python benchmarks/training_loop.py [--steps 30] [--every 5] [--repeats 2] [--out loop.json]

A small GPT-like transformer (token embedding tied to the output head, pre-LN encoder layers with a causal mask)
trains on random tokens with AdamW on the CPU. Each system checkpoints the model and optimizer every ``--every``
steps, right after ``optimizer.step()``:

- ``none``: no checkpoint (the baseline);
- ``tierckpt``: ``mgr.save(step, {"model": model, "optim": opt})``; the background write overlaps the next steps;
- ``tierckpt-lazy``: only when the library has a lazy-snapshot option and ``mgr.snapshot_barrier()``: the copy
  runs during the next forward/backward and the loop calls the barrier before ``optimizer.step()``;
- ``torch.save``: synchronous ``torch.save`` of both state dicts + fsync;
- ``dcp.async_save``: DCP with its default stager, waiting for the previous save's future before the next one;
- ``dcp.async_save+DefaultStager``: staging in the background; the loop waits for ``staging_completion`` before
  the next ``optimizer.step()`` (DCP's own overlap pattern).

Reported per system (medians over repeats, run interleaved): mean step time over the measured steps (warm-up
excluded), overhead against ``none``, mean time of the steps that checkpoint, the **stall** per checkpoint (the time
the loop is blocked inside the checkpointing calls: ``save`` plus every ``before_step`` barrier until the next save;
median over the checkpoints) and its ratio to a plain ``copy_`` of the same state into preallocated tensors (memcpy,
measured in the same run), and the final drain (waiting for the last checkpoint to be durable after the loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    add_output_args,
    cpu_snapshot,
    foreign_cpu,
    fresh_dir,
    import_tierckpt,
    machine_description,
    markdown_table,
    median,
    ratio,
    remove,
    scratch_dir,
    settle,
    table,
    tierckpt_version,
    wait_for_quiet,
    write_json,
)
from torch import nn

#: A step counts as clean (kept for the mean) when other processes kept fewer cores than this busy during it.
CLEAN_STEP_FOREIGN_CORES = 0.25


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` pre-LN transformer blocks with a causal mask, tied output head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.ln_f(x) @ self.wte.weight.T


@dataclasses.dataclass
class LoopConfig:
    """Model and loop sizes."""

    vocab: int = 16384
    d: int = 384
    layers: int = 4
    heads: int = 6
    seq: int = 32
    batch: int = 2
    steps: int = 30
    every: int = 5
    warmup: int = 3
    seed: int = 0


def make_training(cfg: LoopConfig) -> tuple[TinyGPT, torch.optim.Optimizer, Callable[[int], torch.Tensor]]:
    """A fresh model, AdamW and a deterministic batch source (same for every system)."""
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.vocab, cfg.d, cfg.layers, cfg.heads, cfg.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = torch.randint(0, cfg.vocab, (8, cfg.batch, cfg.seq + 1), generator=gen)

    def batch(step: int) -> torch.Tensor:
        return data[step % data.shape[0]]

    return model, opt, batch


def optim_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and AdamW state keyed by parameter name (tensor-only, string keys: what DCP stores without a PG)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "model": model.state_dict(),
        "optim": {names[id(p)]: dict(s) for p, s in opt.state.items()},
    }


class Saver:
    """One checkpointing system inside the loop: ``save`` after the optimizer step, ``before_step``, ``drain``."""

    name = "none"

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """Checkpoint after ``optimizer.step()`` of ``step``."""

    def before_step(self) -> None:
        """Called right before every ``optimizer.step()`` (barrier for background staging)."""

    def drain(self) -> None:
        """Wait until the last checkpoint is durable."""

    def close(self) -> None:
        """Release resources."""


class TierckptSaver(Saver):
    def __init__(self, tc: Any, root: Path, lazy_kwargs: dict[str, Any] | None) -> None:
        self.name = "tierckpt-lazy" if lazy_kwargs else "tierckpt"
        self.mgr = tc.CheckpointManager(root, **(lazy_kwargs or {}))
        self.lazy = bool(lazy_kwargs)

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.mgr.save(step, {"model": model, "optim": opt})

    def before_step(self) -> None:
        if self.lazy:
            self.mgr.snapshot_barrier()

    def drain(self) -> None:
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()


class TorchSaveSaver(Saver):
    name = "torch.save"

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        path = self.root / f"step{step}.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())


class DcpAsyncSaver(Saver):
    def __init__(self, root: Path, stager: bool) -> None:
        self.root = root
        self.name = "dcp.async_save+DefaultStager" if stager else "dcp.async_save"
        self.stager = None
        if stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        self.pending: Any = None
        self.staging: Any = None

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp

        self.drain()
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        writer = dcp.FileSystemWriter(str(self.root / f"step{step}"))
        resp = dcp.async_save(optim_tensors(model, opt), storage_writer=writer, no_dist=True, **kwargs)
        if hasattr(resp, "staging_completion"):
            self.staging, self.pending = resp.staging_completion, resp.upload_completion
        else:
            self.pending = resp

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_step()
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


def run_loop(cfg: LoopConfig, saver: Saver) -> dict[str, Any]:
    """Train ``cfg.steps`` steps with ``saver``; per-step wall times, save-step times, drain time."""
    model, opt, batch = make_training(cfg)
    loss_fn = nn.CrossEntropyLoss()
    times: list[float] = []
    save_steps: list[tuple[float, bool]] = []
    stalls: list[float] = []  # per checkpoint: time blocked in save() + the barriers that follow it
    clean: list[bool] = []  # no other process used the CPU during the step (the machine may be shared)
    t_start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        snap = cpu_snapshot()
        t0 = time.perf_counter()
        b = batch(step)
        logits = model(b[:, :-1])
        loss = loss_fn(logits.reshape(-1, cfg.vocab), b[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tb = time.perf_counter()
        saver.before_step()
        blocked = time.perf_counter() - tb
        if stalls and step > cfg.warmup:
            stalls[-1] += blocked
        opt.step()
        saving = step % cfg.every == 0
        if saving:
            ts = time.perf_counter()
            saver.save(step, model, opt)
            if step > cfg.warmup:
                stalls.append(time.perf_counter() - ts)
        dt = time.perf_counter() - t0
        if step > cfg.warmup:
            times.append(dt)
            clean.append(foreign_cpu(snap) < CLEAN_STEP_FOREIGN_CORES)
            if saving:
                save_steps.append((dt, clean[-1]))
    t_loop = time.perf_counter() - t_start
    t0 = time.perf_counter()
    saver.drain()
    drain = time.perf_counter() - t0
    saver.close()
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) + sum(
        v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    clean_times = [t for t, c in zip(times, clean, strict=True) if c]
    tensors = [t for t in model.state_dict().values()] + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    twins = [torch.empty_like(t) for t in tensors]
    copies = []
    for _ in range(5):  # memcpy of the same state into preallocated tensors: the floor for any snapshot
        tc0 = time.perf_counter()
        with torch.no_grad():
            for d, src in zip(twins, tensors):
                d.copy_(src)
        copies.append(time.perf_counter() - tc0)
    del twins
    return {
        "mean_step_all": statistics.fmean(times),
        "mean_step": statistics.fmean(clean_times) if clean_times else None,
        "clean_steps": len(clean_times),
        "steps_measured": len(times),
        "median_step": statistics.median(clean_times) if clean_times else None,
        "mean_save_step": statistics.fmean(t for t, c in save_steps if c)
        if any(c for _, c in save_steps)
        else None,
        "save_steps_clean": sum(c for _, c in save_steps),
        "loop": t_loop,
        "drain": drain,
        "final_loss": loss.item(),
        "stall": statistics.median(stalls) if stalls else None,
        "stall_max": max(stalls) if stalls else None,
        "memcpy": statistics.median(copies),
        "state_bytes": state_bytes,
    }


def lazy_kwargs(tc: Any) -> dict[str, Any] | None:
    """The constructor keyword that turns on lazy snapshots, if this tierckpt has one (and a barrier)."""
    try:
        from tierckpt.options import Options
    except ImportError:
        return None
    if not hasattr(tc.CheckpointManager, "snapshot_barrier"):
        return None
    for f in dataclasses.fields(Options):
        if "lazy" in f.name:
            return {f.name: True}
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--d", type=int, default=384, help="model width (default 384)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument(
        "--quiet-wait", type=float, default=30.0, help="wait up to this long for a quiet machine per run"
    )
    p.add_argument("--systems", help="comma list (default: all available)")
    add_output_args(p)
    a = p.parse_args(argv)
    cfg = LoopConfig(
        vocab=a.vocab,
        d=a.d,
        layers=a.layers,
        heads=a.heads,
        seq=a.seq,
        batch=a.batch,
        steps=a.steps,
        every=a.every,
    )
    scratch = scratch_dir(a.dir)
    tc, why = import_tierckpt()
    lazy = lazy_kwargs(tc) if tc is not None else None

    makers: dict[str, Callable[[Path], Saver]] = {"none": lambda d: Saver()}
    if tc is not None:
        makers["tierckpt"] = lambda d: TierckptSaver(tc, d, None)
        if lazy:
            makers["tierckpt-lazy"] = lambda d: TierckptSaver(tc, d, lazy)
    makers["torch.save"] = TorchSaveSaver
    makers["dcp.async_save"] = lambda d: DcpAsyncSaver(d, stager=False)
    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401

        makers["dcp.async_save+DefaultStager"] = lambda d: DcpAsyncSaver(d, stager=True)
    except ImportError:
        pass
    if a.systems:
        keep = {s.strip() for s in a.systems.split(",")} | {"none"}
        makers = {k: v for k, v in makers.items() if k in keep}

    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}
    names = list(makers)
    for r in range(a.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            settle()
            d = fresh_dir(scratch, "loop")
            if a.quiet_wait > 0:
                wait_for_quiet(a.quiet_wait)
            snap = cpu_snapshot()
            try:
                runs[name].append(run_loop(cfg, makers[name](d)))
                runs[name][-1]["foreign_cores"] = foreign_cpu(snap)
            except Exception as exc:  # reported, the other systems still run
                runs[name].append({"error": f"{type(exc).__name__}: {exc}"})
            finally:
                remove(d)
            print(
                f"[{time.strftime('%H:%M:%S')}] {name} repeat {r + 1}/{a.repeats}",
                file=sys.stderr,
                flush=True,
            )

    def med(name: str, key: str) -> float | None:
        return median([m[key] for m in runs[name] if m.get(key) is not None])

    base = med("none", "mean_step")
    heads = ["system", "mean step s", "overhead", "mean save-step s", "save-step / step", "stall per save s",
             "stall / memcpy", "final drain s", "clean steps"]  # fmt: skip
    memcpy = median([m["memcpy"] for r in runs.values() for m in r if m.get("memcpy")])
    rows = []
    summary: dict[str, Any] = {}
    for name in names:
        errs = [m["error"] for m in runs[name] if "error" in m]
        if errs:
            rows.append([name, "ERROR: " + errs[0][:70]] + [""] * (len(heads) - 2))
            summary[name] = {"error": errs[0]}
            continue
        ms = med(name, "mean_step")
        ov = ratio(ms, base)
        summary[name] = {
            "mean_step": ms,
            "overhead": None if ov is None else ov - 1,
            "mean_save_step": med(name, "mean_save_step"),
            "stall": med(name, "stall") if name != "none" else None,
            "stall_vs_memcpy": ratio(med(name, "stall"), memcpy) if name != "none" else None,
            "drain": med(name, "drain"),
        }
        rows.append([name, ms, f"{100 * (ov - 1):+.1f}%" if ov else "-", summary[name]["mean_save_step"],
                     ratio(summary[name]["mean_save_step"], base), summary[name]["stall"],
                     summary[name]["stall_vs_memcpy"], summary[name]["drain"],
                     f"{sum(m['clean_steps'] for m in runs[name])}/"
                     f"{sum(m['steps_measured'] for m in runs[name])}"])  # fmt: skip
    sb = runs["none"][0].get("state_bytes", 0)
    title = (f"Training loop: {sb / 2**20:.0f} MiB of model+AdamW state, checkpoint every {cfg.every} steps, "
             f"{cfg.steps} steps ({cfg.warmup} warm-up excluded), medians of {a.repeats}; "
             "steps during which other processes used the CPU are left out")  # fmt: skip
    print(f"\n== {title} ==\n" + table(heads, rows))
    if tc is None:
        print(f"note: tierckpt not measured: {why}")
    elif not lazy:
        print(
            "note: this tierckpt has no lazy-snapshot mode (option + snapshot_barrier); tierckpt-lazy skipped"
        )
    md = f"#### {title}\n\n{markdown_table(heads, rows)}\n"
    result = {
        "kind": "training_loop",
        "config": dataclasses.asdict(cfg),
        "machine": machine_description(scratch),
        "tierckpt_version": tierckpt_version(tc),
        "state_bytes": sb,
        "memcpy": memcpy,
        "summary": summary,
        "runs": runs,
        "markdown": md,
    }
    if a.out:
        write_json(a.out, result)
    if a.markdown:
        Path(a.markdown).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
