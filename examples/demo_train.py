"""tierckpt demo: train, checkpoint, crash, restore, finish, and prove the resumed run is bit-identical.

Run with ``scripts/demo.sh`` (or ``python examples/demo_train.py``). Three runs:

1. a training run in a child process that checkpoints every ``--every`` steps to a local tier (and a "remote" folder
   standing in for a parallel file system) and is SIGKILLed mid-run, right after the optimizer step of
   ``--crash-at``;
2. the restarted run: a fresh process restores the newest intact checkpoint and trains to the end;
3. an uninterrupted reference run, in this process, to show that losses and final weights match bit for bit.

Each save prints its stall (the time training waited) and the time until it was durable locally and remotely.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
from torch import nn

import tierckpt


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 128, layers: int = 2, heads: int = 4, ctx: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings stay tied through save/restore
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


class Batches:
    """A seeded data stream whose position is part of the checkpoint (state_dict / load_state_dict)."""

    def __init__(self, seed: int = 1234, batch: int = 16, ctx: int = 32, vocab: int = 128) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.ctx, self.vocab, self.position = batch, ctx, vocab, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=self.gen)
        seq = (start + torch.arange(self.ctx + 1) * 3) % self.vocab  # a learnable pattern
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]
        self.gen.set_state(sd["gen"])


def train(args: argparse.Namespace, role: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    data = Batches()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": data, "rng": torch.get_rng_state(),
             "step": 0}
    losses: dict[int, float] = {}
    use_ckpt = role != "reference"
    mgr = None
    start = 0
    if use_ckpt:
        mgr = tierckpt.CheckpointManager(args.local, remote=args.remote, keep_local=2, keep_remote=3)
        t0 = time.perf_counter()
        restored = mgr.restore(state)
        if restored is not None:
            torch.set_rng_state(state["rng"])
            start = state["step"]
            took = time.perf_counter() - t0
            tier = "local" if any(i.step == restored and i.local for i in mgr.steps()) else "remote"
            print(f"[{role}] restored step {restored} in {took:.3f} s (verified; from the {tier} tier)", flush=True)
        else:
            print(f"[{role}] no checkpoint found, starting from scratch", flush=True)
    for step in range(start + 1, args.steps + 1):
        x, y = data.next()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item()
        if mgr is not None and step % args.every == 0:
            state["rng"], state["step"] = torch.get_rng_state(), step
            h = mgr.save(step, state, metadata={"loss": losses[step]})
            h.persisted.add_done_callback(lambda f, s=step, hh=h: print(
                f"[{role}] step {s:4d}: stall {hh.record().stall_s * 1e3:7.2f} ms | locally durable after "
                f"{f.result() * 1e3:7.1f} ms" if not f.exception()
                else f"[{role}] step {s}: save failed: {f.exception()}",
                flush=True))
            h.uploaded.add_done_callback(lambda f, s=step: print(
                f"[{role}] step {s:4d}: remote copy committed after {f.result() * 1e3:7.1f} ms" if not f.exception()
                else f"[{role}] step {s}: upload failed: {f.exception()}", flush=True))
        if role == "crashing" and step == args.crash_at:
            time.sleep(0.2)  # let a save be half-way through
            print(f"[{role}] step {step}: simulating a node failure (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if mgr is not None:
        mgr.close()
    with open(os.path.join(args.out, f"{role}.json"), "w") as f:
        json.dump({"losses": losses}, f)
    torch.save({k: v for k, v in model.state_dict().items()}, os.path.join(args.out, f"{role}.weights.pt"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="demo_run", help="working folder (wiped at start)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=35)
    p.add_argument("--role", choices=["crashing", "resumed", "reference"], help=argparse.SUPPRESS)
    args = p.parse_args()
    args.local = os.path.join(args.dir, "local_nvme")
    args.remote = os.path.join(args.dir, "remote_pfs")
    args.out = os.path.join(args.dir, "results")
    if args.role:
        train(args, args.role)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.out)
    base = [sys.executable, __file__, "--dir", args.dir, "--steps", str(args.steps), "--every", str(args.every),
            "--crash-at", str(args.crash_at)]
    print(f"== 1. training run, checkpoint every {args.every} steps, killed at step {args.crash_at}")
    rc = subprocess.run(base + ["--role", "crashing"]).returncode
    print(f"   (exit code {rc}: {'killed by SIGKILL' if rc == -signal.SIGKILL else 'unexpected'})")
    print("== 2. after the crash: tierckpt ls / verify on the local tier")
    subprocess.run([sys.executable, "-m", "tierckpt", "ls", args.local])
    subprocess.run([sys.executable, "-m", "tierckpt", "verify", args.local])
    subprocess.run([sys.executable, "-m", "tierckpt", "ls", args.remote])
    print("== 3. restarted run: restore the newest intact checkpoint and finish")
    if subprocess.run(base + ["--role", "resumed"]).returncode != 0:
        return 1
    print("== 4. uninterrupted reference run (in this process)")
    train(args, "reference")
    with open(os.path.join(args.out, "resumed.json")) as f:
        resumed = json.load(f)
    with open(os.path.join(args.out, "reference.json")) as f:
        ref = json.load(f)
    wa = torch.load(os.path.join(args.out, "resumed.weights.pt"))
    wb = torch.load(os.path.join(args.out, "reference.weights.pt"))
    common = sorted(set(resumed["losses"]) & set(ref["losses"]), key=int)
    same_losses = all(resumed["losses"][k] == ref["losses"][k] for k in common)
    same_weights = all(torch.equal(wa[k], wb[k]) for k in wb)
    print(f"== result: resumed steps {common[0]}..{common[-1]}: losses bit-identical to the reference: {same_losses}; "
          f"final weights bit-identical: {same_weights}; final loss {ref['losses'][common[-1]]:.4f}")
    return 0 if same_losses and same_weights else 1


if __name__ == "__main__":
    sys.exit(main())
