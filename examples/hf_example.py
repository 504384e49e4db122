"""Hugging Face Trainer + tierckpt: asynchronous checkpoints, a crash, and a resume that matches an unbroken run.

Run with ``python examples/hf_example.py [--dir FOLDER]`` (a few seconds on CPU; needs ``transformers`` and
``accelerate``). Everything it writes goes into ``--dir`` (default: ``tierckpt-hf-example`` in the system's temporary
folder, or ``$TIERCKPT_EXAMPLE_DIR``), which it wipes first. Three runs train a tiny GPT-2 built from a config
(nothing is downloaded):

1. a run in a child process that checkpoints every ``--every`` steps through ``TieredCheckpointCallback`` (a local
   tier, and a "remote" folder standing in for object storage) and is SIGKILLed right after step ``--crash-at``;
2. the restarted run, in a fresh process: ``tierckpt.hf.train(trainer)`` resumes from the newest intact step in any
   tier;
3. an uninterrupted reference run in this process, to compare the per-step losses and the final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import tierckpt.hf


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (a stand-in for a tokenized corpus)."""

    def __init__(self, n: int = 256, length: int = 32) -> None:
        self.ids = torch.randint(0, 101, (n, length), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Report(TrainerCallback):
    """Records each step's loss; the crashing role kills its own process after ``crash_at``."""

    def __init__(self, role: str, crash_at: int) -> None:
        self.role, self.crash_at, self.losses = role, crash_at, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
        if self.role == "crashing" and state.global_step == self.crash_at:
            print(f"[{self.role}] step {state.global_step}: simulating a node failure (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def train(args: argparse.Namespace, role: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights in every role (the resumed run replaces them anyway)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32))
    training_args = TrainingArguments(
        output_dir=os.path.join(args.dir, "hf_output"), max_steps=args.steps, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_steps=1, seed=0, use_cpu=True, report_to=[], disable_tqdm=True,
        save_strategy="no",   # HF's own synchronous checkpoints off: tierckpt takes them
    )
    report = Report(role, args.crash_at)
    callbacks: list[TrainerCallback] = [report]
    if role != "reference":
        ckpt = tierckpt.hf.TieredCheckpointCallback(
            os.path.join(args.dir, "local_nvme"), remote=os.path.join(args.dir, "remote"),
            save_steps=args.every, keep_local=2, keep_remote=3,
        )
        callbacks.insert(0, ckpt)
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # quieter: no per-step log lines
    if role == "reference":
        trainer.train()
    else:
        tierckpt.hf.train(trainer)      # resumes from the newest intact step in any tier, or starts fresh
        where = f"step {ckpt.resumed_step} ({ckpt.resumed_tier} tier)" if ckpt.resumed_step else "scratch"
        print(f"[{role}] started from {where}", flush=True)
    with open(os.path.join(args.dir, f"{role}.json"), "w") as f:
        json.dump({"losses": report.losses,
                   "weights_sum": sum(float(p.detach().double().sum()) for p in model.parameters()),
                   "weights": {k: v.tolist() for k, v in model.state_dict().items() if k == "lm_head.weight"}}, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.environ.get("TIERCKPT_EXAMPLE_DIR")
                   or os.path.join(tempfile.gettempdir(), "tierckpt-hf-example"),
                   help="working folder, wiped at start (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--crash-at", type=int, default=17)
    p.add_argument("--role", choices=["crashing", "resumed", "reference"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        train(args, args.role)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(f"== working folder: {args.dir}")
    base = [sys.executable, __file__, "--dir", args.dir, "--steps", str(args.steps), "--every", str(args.every),
            "--crash-at", str(args.crash_at)]
    print(f"== 1. Trainer with TieredCheckpointCallback(save_steps={args.every}), killed after step {args.crash_at}")
    rc = subprocess.run(base + ["--role", "crashing"]).returncode
    print(f"   exit code {rc}" + (" (SIGKILL)" if rc == -signal.SIGKILL else ""))
    print("== 2. a fresh process: tierckpt.hf.train(trainer)")
    subprocess.run(base + ["--role", "resumed"], check=True)
    print("== 3. the same run without interruption, in this process")
    train(args, "reference")
    with open(os.path.join(args.dir, "resumed.json")) as f:
        resumed = json.load(f)
    with open(os.path.join(args.dir, "reference.json")) as f:
        reference = json.load(f)
    steps = sorted(resumed["losses"], key=int)
    diff = max(abs(resumed["losses"][s] - reference["losses"][s]) for s in steps)
    same_weights = resumed["weights"] == reference["weights"] and resumed["weights_sum"] == reference["weights_sum"]
    print(f"steps {steps[0]}-{steps[-1]} after the resume: largest loss difference {diff:.3g}; "
          f"final weights {'identical' if same_weights else 'DIFFERENT'}")
    return 0 if diff < 1e-5 and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
