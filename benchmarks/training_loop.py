"""Inside a training loop: the step-time overhead of checkpointing every N steps, against no checkpointing.

    python benchmarks/training_loop.py [--steps 30] [--every 5] [--repeats 2] [--out loop.json]

A small GPT-like transformer (token embedding tied to the output head, pre-LN encoder layers with a causal mask)
trains on random tokens with AdamW on the CPU. Each system checkpoints model and optimizer every ``--every`` steps,
right after ``optimizer.step()``:

- ``none``: no checkpoint (the baseline);
- ``tierckpt``: ``mgr.save(step, {"model": model, "optim": opt})``; the background write overlaps the next steps;
- ``tierckpt-lazy``: where the library has a lazy-snapshot option and ``mgr.snapshot_barrier()``: the copy runs
  during the next forward/backward, and the loop calls the barrier before each ``optimizer.step()``;
- ``torch.save``: a synchronous ``torch.save`` of both state dicts + fsync;
- ``dcp.async_save``: DCP with its default stager, waiting for the previous save's future before the next;
- ``dcp.async_save+DefaultStager``: staging in the background; the loop waits for ``staging_completion`` before the
  next ``optimizer.step()`` (DCP's own overlap pattern).

Reported per system (medians over the repeats, run interleaved): the mean step time (warm-up excluded; steps
during which other processes kept more than 0.25 cores busy left out), its overhead against ``none``, the mean time
of the steps that save, the stall per checkpoint (blocked in ``save()`` plus every barrier until the next save;
median) and its ratio to a plain ``copy_`` of the same state (memcpy, in the same run), and the final drain.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness as h
import torch
from torch import nn

#: a step counts (is "clean") when other processes kept fewer cores than this busy during it
CLEAN_STEP_FOREIGN_CORES = 0.25


class TinyGPT(nn.Module):
    """Token + position embeddings, ``layers`` pre-LN transformer blocks with a causal mask, tied output head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        return self.ln_f(self.blocks(x, mask=self.mask[:t, :t], is_causal=True)) @ self.wte.weight.T


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


class Saver:
    """One way of checkpointing inside the loop (this one: none): ``save`` after the optimizer step,
    ``before_step`` right before every optimizer step, ``drain`` (wait until the last checkpoint is durable)."""

    name = "none"

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None: ...

    def before_step(self) -> None: ...

    def drain(self) -> None: ...

    def close(self) -> None:
        self.drain()


class TierckptSaver(Saver):
    def __init__(self, tc: Any, root: Path, lazy: dict[str, Any] | None) -> None:
        self.name, self.lazy = ("tierckpt-lazy" if lazy else "tierckpt"), bool(lazy)
        self.mgr = tc.CheckpointManager(root, **(lazy or {}))

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
        with open(self.root / f"step{step}.pt", "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())


class DcpAsyncSaver(Saver):
    def __init__(self, root: Path, stager: bool) -> None:
        self.root, self.name = root, "dcp.async_save+DefaultStager" if stager else "dcp.async_save"
        self.stager, self.pending, self.staging = None, None, None
        if stager:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))

    def save(self, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp

        self.drain()
        names = {id(p): n for n, p in model.named_parameters()}  # tensors only, string keys: DCP without a group
        state = {"model": model.state_dict(), "optim": {names[id(p)]: dict(s) for p, s in opt.state.items()}}
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(self.root / f"step{step}")),
                              no_dist=True, **kwargs)
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
    """``cfg.steps`` training steps with ``saver``: step times, the saving steps' times, stalls, the drain, and a
    ``copy_`` of the same state into preallocated tensors (the floor of any snapshot)."""
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.vocab, cfg.d, cfg.layers, cfg.heads, cfg.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    data = torch.randint(0, cfg.vocab, (8, cfg.batch, cfg.seq + 1), generator=gen)
    loss_fn = nn.CrossEntropyLoss()
    times: list[float] = []
    save_steps: list[tuple[float, bool]] = []
    stalls: list[float] = []  # per checkpoint: blocked in save() and in the barriers that follow it
    clean: list[bool] = []  # no other process used the CPU during the step (the machine may be shared)
    t_start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        snap, t0 = h.cpu_snapshot(), time.perf_counter()
        b = data[step % data.shape[0]]
        loss = loss_fn(model(b[:, :-1]).reshape(-1, cfg.vocab), b[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tb = time.perf_counter()
        saver.before_step()
        if stalls and step > cfg.warmup:
            stalls[-1] += time.perf_counter() - tb
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
            clean.append(h.foreign_cpu(snap) < CLEAN_STEP_FOREIGN_CORES)
            if saving:
                save_steps.append((dt, clean[-1]))
    t_loop = time.perf_counter() - t_start
    t0 = time.perf_counter()
    saver.drain()
    drain = time.perf_counter() - t0
    saver.close()
    ts = [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
    twins, copies = [torch.empty_like(t) for t in ts], []
    for _ in range(5):
        tc0 = time.perf_counter()
        with torch.no_grad():
            for d, src in zip(twins, ts):
                d.copy_(src)
        copies.append(time.perf_counter() - tc0)
    kept = [t for t, c in zip(times, clean, strict=True) if c]
    kept_saves = [t for t, c in save_steps if c]
    return {"mean_step_all": statistics.fmean(times), "mean_step": statistics.fmean(kept) if kept else None,
            "clean_steps": len(kept), "steps_measured": len(times), "median_step": h.median(kept),
            "mean_save_step": statistics.fmean(kept_saves) if kept_saves else None,
            "save_steps_clean": len(kept_saves), "loop": t_loop, "drain": drain, "final_loss": loss.item(),
            "stall": h.median(stalls), "stall_max": max(stalls, default=None), "memcpy": statistics.median(copies),
            "state_bytes": sum(t.nbytes for t in ts)}


def lazy_kwargs(tc: Any) -> dict[str, Any] | None:
    """The manager keyword that turns lazy snapshots on, where this tierckpt has one (and a barrier)."""
    try:
        from tierckpt.options import Options
    except ImportError:
        return None
    if not hasattr(tc.CheckpointManager, "snapshot_barrier"):
        return None
    return next(({f.name: True} for f in dataclasses.fields(Options) if "lazy" in f.name), None)


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--d", type=int, default=384, help="model width (default 384)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--quiet-wait", type=float, default=30.0, help="wait up to this long for a quiet machine per run")
    p.add_argument("--systems", help="comma list (default: all available)")
    a = p.parse(argv)
    cfg = LoopConfig(vocab=a.vocab, d=a.d, layers=a.layers, heads=a.heads, seq=a.seq, batch=a.batch, steps=a.steps,
                     every=a.every)
    scratch = h.scratch_dir(a.dir)
    tc, why = h.import_tierckpt()
    lazy = lazy_kwargs(tc) if tc is not None else None
    makers: dict[str, Callable[[Path], Saver]] = {"none": lambda d: Saver()}
    if tc is not None:
        makers["tierckpt"] = lambda d: TierckptSaver(tc, d, None)
        if lazy:
            makers["tierckpt-lazy"] = lambda d: TierckptSaver(tc, d, lazy)
    makers["torch.save"] = TorchSaveSaver
    makers["dcp.async_save"] = lambda d: DcpAsyncSaver(d, stager=False)
    if h.default_stager_available():
        makers["dcp.async_save+DefaultStager"] = lambda d: DcpAsyncSaver(d, stager=True)
    if a.systems:
        keep = {s.strip() for s in a.systems.split(",")} | {"none"}
        makers = {k: v for k, v in makers.items() if k in keep}

    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}
    for r in range(a.repeats):
        for name in h.rotate(list(makers), r):
            h.settle()
            d = h.fresh_dir(scratch, "loop")
            if a.quiet_wait > 0:
                h.wait_for_quiet(a.quiet_wait)
            snap = h.cpu_snapshot()
            try:
                runs[name].append({**run_loop(cfg, makers[name](d)), "foreign_cores": h.foreign_cpu(snap)})
            except Exception as exc:  # reported; the other systems still run
                runs[name].append({"error": f"{type(exc).__name__}: {exc}"})
            finally:
                h.remove(d)
            h.log(f"{name} repeat {r + 1}/{a.repeats}")

    def med(name: str, key: str) -> float | None:
        return h.median([m.get(key) for m in runs[name]])

    base = med("none", "mean_step")
    memcpy = h.median([m.get("memcpy") for r in runs.values() for m in r])
    heads = ["system", "mean step s", "overhead", "mean save-step s", "save-step / step", "stall per save s",
             "stall / memcpy", "final drain s", "clean steps"]
    rows, summary = [], {}
    for name in makers:
        errs = [m["error"] for m in runs[name] if "error" in m]
        if errs:
            rows.append([name, "ERROR: " + errs[0][:70]] + [""] * (len(heads) - 2))
            summary[name] = {"error": errs[0]}
            continue
        ov = h.ratio(med(name, "mean_step"), base)
        stall = med(name, "stall") if name != "none" else None
        s = summary[name] = {"mean_step": med(name, "mean_step"), "overhead": None if ov is None else ov - 1,
                             "mean_save_step": med(name, "mean_save_step"), "stall": stall,
                             "stall_vs_memcpy": h.ratio(stall, memcpy), "drain": med(name, "drain")}
        rows.append([name, s["mean_step"], f"{100 * (ov - 1):+.1f}%" if ov else "-", s["mean_save_step"],
                     h.ratio(s["mean_save_step"], base), stall, s["stall_vs_memcpy"], s["drain"],
                     f"{sum(m['clean_steps'] for m in runs[name])}/{sum(m['steps_measured'] for m in runs[name])}"])
    sb = runs["none"][0].get("state_bytes", 0)
    title = (f"Training loop: {sb / 2**20:.0f} MiB of model+AdamW state, checkpoint every {cfg.every} steps, "
             f"{cfg.steps} steps ({cfg.warmup} warm-up excluded), medians of {a.repeats}; "
             "steps during which other processes used the CPU are left out")
    md = h.sections([(title, heads, rows)])
    print(md)
    if tc is None:
        print(f"note: tierckpt not measured: {why}")
    elif not lazy:
        print("note: this tierckpt has no lazy-snapshot mode (option + snapshot_barrier); tierckpt-lazy skipped")
    h.finish(a, {"kind": "training_loop", "config": dataclasses.asdict(cfg), "machine": h.machine(scratch),
                 "tierckpt_version": getattr(tc, "__version__", None), "state_bytes": sb, "memcpy": memcpy,
                 "summary": summary, "runs": runs, "markdown": md}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
