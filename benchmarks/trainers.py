"""Trainer plug-ins side by side: step-time overhead per checkpoint of each framework's own checkpointing and of
tierckpt's plug-in, in one run.

    python benchmarks/trainers.py [--steps 20] [--every 5] [--mlp-width 2048] [--mlp-layers 3]
                                  [--gpt-layers 2] [--gpt-embd 768] [--repeats 1] [--out trainers.json]

- Lightning: an MLP (``--mlp-layers`` square ``Linear(width, width)``, Adam) trained with ``L.Trainer``:
  ``none`` (``enable_checkpointing=False``), ``default`` (``ModelCheckpoint(every_n_train_steps=K)`` with
  Lightning's ``TorchCheckpointIO``: a synchronous ``torch.save``) and ``tierckpt`` (the same ``ModelCheckpoint``
  with the ``TieredCheckpointIO`` plug-in, local tier only).
- HF: a GPT-2 (``GPT2Config(n_layer, n_embd, vocab_size=1024)``, AdamW) trained with ``transformers.Trainer``:
  ``none`` (``save_strategy="no"``), ``default`` (``save_strategy="steps", save_steps=K``: safetensors weights,
  ``optimizer.pt``, scheduler, RNG, trainer state, synchronously) and ``tierckpt`` (``save_strategy="no"`` and
  ``TieredCheckpointCallback(save_steps=K)``, local tier only).

What is timed: the wall time of ``--steps`` N training steps after 2 warm-up steps, from the start of the first
measured step to the start of step N+1, which includes every checkpoint taken at steps K, 2K, ..., N (taken between
a step's end and the next one's start in both frameworks). Overhead per checkpoint = (that time - the same
framework's ``none`` time) / N/K. On a shared VM the speed drifts between the runs that formula compares, so a
second, within-run estimate is printed too: the mean, over the steps that take a checkpoint, of their duration minus
the median duration of the same run's other steps (it misses what background writes cost the other steps). Not in
either: the drain after the loop (tierckpt's ``close()`` waiting for the last writes, reported as ``drain_s``; the
defaults have nothing left to drain). The default checkpoints land in the page cache (no fsync), tierckpt's are
fsynced in the background; tierckpt's first save also allocates its staging buffer (the plug-ins do not call
``reserve_staging()``). All on the CPU; the state sizes are printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

WARMUP = 2


def state_mb(model: torch.nn.Module, optimizer_slots: int = 2) -> float:
    """Model + Adam state (two fp32 slots per parameter) in MB."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (1 + optimizer_slots) / 1e6


def loop_times(starts: dict[int, float], args: argparse.Namespace) -> dict[str, Any]:
    """The measured window, each step's duration (step g -> g+1 holds the checkpoint of step g+1 when one is
    due) and the within-run estimate: mean over the checkpointing steps of (duration - median duration of the
    same run's other steps)."""
    first, last = WARMUP, WARMUP + args.steps
    steps = [starts[g + 1] - starts[g] for g in range(first, last)]
    ckpt = [d for g, d in zip(range(first, last), steps) if (g + 1) % args.every == 0]
    other = [d for g, d in zip(range(first, last), steps) if (g + 1) % args.every != 0]
    base = statistics.median(other)
    return {"loop_s": starts[last] - starts[first], "step_s": steps, "other_step_median_s": base,
            "ckpt_step_extra_s": statistics.mean(d - base for d in ckpt)}


# ---------------------------------------------------------------------------------------------------- Lightning
def lightning_run(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tierckpt.lightning import TieredCheckpointIO

    width, layers = args.mlp_width, args.mlp_layers

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(args.batch * (args.steps + WARMUP + 1), width),
                                               batch_size=args.batch)

    starts: dict[int, float] = {}

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            starts[trainer.global_step] = time.perf_counter()

    plugins: list[Any] = []
    callbacks: list[Any] = [Timer()]
    if system != "none":
        callbacks.append(ModelCheckpoint(dirpath=str(work / "lightning"), every_n_train_steps=args.every))
    if system == "tierckpt":
        plugins.append(TieredCheckpointIO(work / "tier", keep_local=2))
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


# ---------------------------------------------------------------------------------------------------- HF
def hf_run(system: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from tierckpt.hf import TieredCheckpointCallback

    starts: dict[int, float] = {}
    closed: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            starts[state.global_step] = time.perf_counter()

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 1024, (args.hf_batch * (args.steps + WARMUP + 1), args.seq),
                                     generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.gpt_layers, n_embd=args.gpt_embd, n_head=args.gpt_embd // 64,
                                       vocab_size=1024, n_positions=args.seq))
    callbacks: list[Any] = [Timer()]
    if system == "tierckpt":
        cb = TieredCheckpointCallback(work / "tier", save_steps=args.every, keep_local=2)
        orig_close = cb.close

        def close() -> None:  # the drain: on_train_end closes the manager (waits until the last save is durable)
            t = time.perf_counter()
            orig_close()
            closed.append(time.perf_counter() - t)

        cb.close = close  # type: ignore[method-assign]
        callbacks.append(cb)
    targs = TrainingArguments(output_dir=str(work / "hf"), max_steps=args.steps + WARMUP + 1,
                              per_device_train_batch_size=args.hf_batch, report_to=[], logging_steps=10_000,
                              save_strategy="steps" if system == "default" else "no", save_steps=args.every,
                              save_total_limit=1, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                              learning_rate=1e-4, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=Data(), callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    return {**loop_times(starts, args), "fit_s": end - t0, "drain_s": closed[0] if closed else 0.0,
            "state_mb": state_mb(model)}


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.steps % args.every:
        p.error("--steps must be a multiple of --every")
    checkpoints = args.steps // args.every
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "transformers", "tierckpt"):
        logging.getLogger(name).setLevel(logging.ERROR)
    runners = {"lightning": lightning_run, "hf": hf_run}
    frameworks = [f for f in args.frameworks.split(",") if f]
    results: dict[str, Any] = {}
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tierckpt-trainers-"))
    try:
        for fw in frameworks:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in ("none", "default", "tierckpt")}
            for r in range(args.repeats):
                for system in runs:  # interleaved: none, default, tierckpt, none, ...
                    work = base / f"{fw}-{system}-{r}"
                    runs[system].append(runners[fw](system, args, work))
                    shutil.rmtree(work, ignore_errors=True)
            med = {s: statistics.median(x["loop_s"] for x in v) for s, v in runs.items()}
            fw_out: dict[str, Any] = {"state_mb": runs["none"][0]["state_mb"], "runs": runs, "loop_s": med}
            for s in ("default", "tierckpt"):
                fw_out[f"{s}_overhead_per_ckpt_s"] = (med[s] - med["none"]) / checkpoints
            for s in ("default", "tierckpt"):
                fw_out[f"{s}_ckpt_step_extra_s"] = statistics.median(x["ckpt_step_extra_s"] for x in runs[s])
            d = fw_out["default_overhead_per_ckpt_s"]
            fw_out["ratio_tierckpt_to_default"] = fw_out["tierckpt_overhead_per_ckpt_s"] / d if d > 0 else None
            d = fw_out["default_ckpt_step_extra_s"]
            fw_out["ratio_within_run"] = fw_out["tierckpt_ckpt_step_extra_s"] / d if d > 0 else None
            results[fw] = fw_out
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    out = {"benchmark": "trainers", "argv": sys.argv[1:], "steps": args.steps, "every": args.every,
           "checkpoints": checkpoints, "repeats": args.repeats, "torch": torch.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
           "results": results}
    print(f"{args.steps} steps, a checkpoint every {args.every} ({checkpoints} checkpoints), median of "
          f"{args.repeats} run(s), CPU")
    print("per ckpt: (loop - none loop) / checkpoints; in-run: checkpointing step - median of the run's other steps")
    print(f"{'framework':<10} {'state MB':>9} {'none s':>8} {'default s':>10} {'tierckpt s':>11} "
          f"{'default/ckpt':>13} {'tierckpt/ckpt':>14} {'ratio':>7} {'default in-run':>15} "
          f"{'tierckpt in-run':>16} {'ratio':>7} {'drain s':>8}")

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for fw, r in results.items():
        drain = statistics.median(x["drain_s"] for x in r["runs"]["tierckpt"])
        print(f"{fw:<10} {r['state_mb']:>9.0f} {r['loop_s']['none']:>8.2f} {r['loop_s']['default']:>10.2f} "
              f"{r['loop_s']['tierckpt']:>11.2f} {r['default_overhead_per_ckpt_s']:>13.3f} "
              f"{r['tierckpt_overhead_per_ckpt_s']:>14.3f} {fmt(r['ratio_tierckpt_to_default']):>7} "
              f"{r['default_ckpt_step_extra_s']:>15.3f} {r['tierckpt_ckpt_step_extra_s']:>16.3f} "
              f"{fmt(r['ratio_within_run']):>7} {drain:>8.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
