"""Trainer plug-ins side by side: the step-time overhead per checkpoint of each framework's own checkpointing and
of tierckpt's plug-in, in one run.

    python benchmarks/trainers.py [--steps 20] [--every 5] [--mlp-width 2048] [--mlp-layers 3]
                                  [--gpt-layers 2] [--gpt-embd 768] [--repeats 1] [--out trainers.json]

- Lightning: an MLP (``--mlp-layers`` square ``Linear(width, width)``, Adam) trained with ``L.Trainer``: ``none``
  (``enable_checkpointing=False``), ``default`` (``ModelCheckpoint(every_n_train_steps=K)`` with Lightning's
  ``TorchCheckpointIO``: a synchronous ``torch.save``) and ``tierckpt`` (the same ``ModelCheckpoint`` with the
  ``TieredCheckpointIO`` plug-in, local tier only).
- HF: a GPT-2 (``GPT2Config(n_layer, n_embd, vocab_size=1024)``, AdamW) trained with ``transformers.Trainer``:
  ``none`` (``save_strategy="no"``), ``default`` (``save_strategy="steps", save_steps=K``: safetensors weights,
  ``optimizer.pt``, scheduler, RNG, trainer state, synchronously) and ``tierckpt`` (``save_strategy="no"`` and
  ``TieredCheckpointCallback(save_steps=K)``, local tier only).

Timed: the wall time of ``--steps`` N training steps after 2 warm-up steps, from the start of the first measured
step to the start of step N+1, which holds every checkpoint taken at steps K, 2K, ..., N. Overhead per checkpoint
= (that time - the same framework's ``none`` time) / (N/K). On a shared VM the speed drifts between the runs that
formula compares, so a within-run estimate is given too: the mean, over the steps that take a checkpoint, of their
duration minus the median duration of the same run's other steps (it misses what background writes cost the other
steps). In neither: the drain after the loop (tierckpt's ``close()`` waiting for the last writes: ``drain_s``). The
default checkpoints land in the page cache (no fsync), tierckpt's are fsynced in the background; tierckpt's first
save also allocates its staging buffer (the plug-ins do not call ``reserve_staging()``). All on the CPU.
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import harness as h
import torch

WARMUP = 2


def state_mb(model: torch.nn.Module, optimizer_slots: int = 2) -> float:
    """Model + Adam state (two fp32 slots per parameter) in MB."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) * (1 + optimizer_slots) / 1e6


def loop_times(starts: dict[int, float], args: argparse.Namespace) -> dict[str, Any]:
    """The measured window, each step's duration (step g -> g+1 holds the checkpoint of step g+1 when one is due)
    and the within-run estimate: the mean over the checkpointing steps of (duration - the median of the others)."""
    first, last = WARMUP, WARMUP + args.steps
    steps = {g: starts[g + 1] - starts[g] for g in range(first, last)}
    base = h.median([d for g, d in steps.items() if (g + 1) % args.every])
    ckpt = [d - base for g, d in steps.items() if (g + 1) % args.every == 0]
    return {"loop_s": starts[last] - starts[first], "step_s": list(steps.values()), "other_step_median_s": base,
            "ckpt_step_extra_s": sum(ckpt) / len(ckpt)}


def lightning_run(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tierckpt.lightning import TieredCheckpointIO

    width, layers = args.mlp_width, args.mlp_layers
    starts: dict[int, float] = {}

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(args.batch * (args.steps + WARMUP + 1), width),
                                               batch_size=args.batch)

    class Timer(Callback):
        def on_train_batch_start(self, trainer: Any, *rest: Any) -> None:
            starts[trainer.global_step] = time.perf_counter()

    callbacks: list[Any] = [Timer()]
    if system != "none":
        callbacks.append(ModelCheckpoint(dirpath=str(work / "lightning"), every_n_train_steps=args.every))
    plugins = [TieredCheckpointIO(work / "tier", keep_local=2)] if system == "tierckpt" else []
    torch.manual_seed(0)
    model = MLP()
    trainer = L.Trainer(max_steps=args.steps + WARMUP + 1, accelerator="cpu", devices=1, plugins=plugins,
                        callbacks=callbacks, enable_checkpointing=system != "none", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    t0 = time.perf_counter()
    trainer.fit(model)
    end = time.perf_counter()
    return {**loop_times(starts, args), "fit_s": end - t0, "drain_s": end - starts[WARMUP + args.steps],
            "state_mb": state_mb(model)}


def hf_run(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from tierckpt.hf import TieredCheckpointCallback

    starts: dict[int, float] = {}
    closed: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            starts[state.global_step] = time.perf_counter()

    ids = torch.randint(0, 1024, (args.hf_batch * (args.steps + WARMUP + 1), args.seq),
                        generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.gpt_layers, n_embd=args.gpt_embd, n_head=args.gpt_embd // 64,
                                       vocab_size=1024, n_positions=args.seq))
    callbacks: list[Any] = [Timer()]
    if system == "tierckpt":
        cb = TieredCheckpointCallback(work / "tier", save_steps=args.every, keep_local=2)
        close = cb.close

        def timed_close() -> None:  # the drain: on_train_end closes the manager (waits for the last save)
            t = time.perf_counter()
            close()
            closed.append(time.perf_counter() - t)

        cb.close = timed_close  # type: ignore[method-assign]
        callbacks.append(cb)
    targs = TrainingArguments(output_dir=str(work / "hf"), max_steps=args.steps + WARMUP + 1,
                              per_device_train_batch_size=args.hf_batch, report_to=[], logging_steps=10_000,
                              save_strategy="steps" if system == "default" else "no", save_steps=args.every,
                              save_total_limit=1, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                              learning_rate=1e-4, seed=0)
    t0 = time.perf_counter()
    Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks).train()
    end = time.perf_counter()
    return {**loop_times(starts, args), "fit_s": end - t0, "drain_s": closed[0] if closed else 0.0,
            "state_mb": state_mb(model)}


def main(argv: list[str] | None = None) -> int:
    p = h.Cli(__doc__, __file__, markdown=False)
    p.add_argument("--steps", type=int, default=20, help="measured steps N (a multiple of --every)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    p.add_argument("--batch", type=int, default=8, help="Lightning: samples per step")
    p.add_argument("--hf-batch", type=int, default=2, help="HF: samples per step")
    p.add_argument("--seq", type=int, default=32, help="HF: tokens per sample")
    p.add_argument("--mlp-width", type=int, default=2048)
    p.add_argument("--mlp-layers", type=int, default=3)
    p.add_argument("--gpt-layers", type=int, default=2)
    p.add_argument("--gpt-embd", type=int, default=768)
    p.add_argument("--repeats", type=int, default=1, help="runs of each (framework, system); the median is used")
    p.add_argument("--frameworks", default="lightning,hf")
    args = p.parse(argv)
    if args.steps % args.every:
        p.error("--steps must be a multiple of --every")
    h.need_tierckpt("trainers benchmark")
    checkpoints = args.steps // args.every
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "transformers", "tierckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    runners = {"lightning": lightning_run, "hf": hf_run}
    scratch = h.scratch_dir(args.dir)
    results: dict[str, Any] = {}
    rows = []
    for fw in (f for f in args.frameworks.split(",") if f):
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in ("none", "default", "tierckpt")}
        for r in range(args.repeats):
            for system in runs:  # interleaved: none, default, tierckpt, none, ...
                work = h.fresh_dir(scratch, f"{fw}-{system}-{r}")
                try:
                    runs[system].append(runners[fw](system, args, work))
                finally:
                    h.remove(work)
        med = {s: h.median([x["loop_s"] for x in v]) for s, v in runs.items()}
        out = results[fw] = {"state_mb": runs["none"][0]["state_mb"], "runs": runs, "loop_s": med}
        for s in ("default", "tierckpt"):
            out[f"{s}_overhead_per_ckpt_s"] = (med[s] - med["none"]) / checkpoints
            out[f"{s}_ckpt_step_extra_s"] = h.median([x["ckpt_step_extra_s"] for x in runs[s]])
        d = out["default_overhead_per_ckpt_s"]
        out["ratio_tierckpt_to_default"] = out["tierckpt_overhead_per_ckpt_s"] / d if d > 0 else None
        d = out["default_ckpt_step_extra_s"]
        out["ratio_within_run"] = out["tierckpt_ckpt_step_extra_s"] / d if d > 0 else None
        rows.append([fw, out["state_mb"], med["none"], med["default"], med["tierckpt"],
                     out["default_overhead_per_ckpt_s"], out["tierckpt_overhead_per_ckpt_s"],
                     out["ratio_tierckpt_to_default"], out["default_ckpt_step_extra_s"],
                     out["tierckpt_ckpt_step_extra_s"], out["ratio_within_run"],
                     h.median([x["drain_s"] for x in runs["tierckpt"]])])
    title = (f"{args.steps} steps, a checkpoint every {args.every} ({checkpoints} checkpoints), median of "
             f"{args.repeats} run(s), CPU; per ckpt: (loop - none loop) / checkpoints; in-run: checkpointing step - "
             "median of the run's other steps")
    print(h.sections([(title, ["framework", "state MB", "none s", "default s", "tierckpt s", "default/ckpt",
                               "tierckpt/ckpt", "ratio", "default in-run", "tierckpt in-run", "ratio", "drain s"],
                       rows)]))
    h.finish(args, {"benchmark": "trainers", "steps": args.steps, "every": args.every, "checkpoints": checkpoints,
                    "repeats": args.repeats, "torch": torch.__version__, "python": platform.python_version(),
                    "machine": h.machine(scratch), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
