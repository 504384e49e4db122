"""A training run resumed from a checkpoint is bit-identical to an uninterrupted one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests._support.helpers import assert_tensor_equal
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(180)

N_STEPS = 12
SAVE_AT = 5


class TinyBlock(nn.Module):
    """A one-layer transformer-ish block with dropout (uses the global torch RNG) and tied in/out embeddings."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, dim))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        h = self.norm(h + a)
        h = h + self.mlp(h)
        return self.out(h)


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = TinyBlock()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    data_gen = torch.Generator().manual_seed(seed + 1)
    return {"model": model, "opt": opt, "sched": sched, "data_gen": data_gen}


def train(objs: dict[str, Any], start: int, stop: int, losses: list[float]) -> None:
    model, opt, sched, gen = objs["model"], objs["opt"], objs["sched"], objs["data_gen"]
    model.train()
    for _ in range(start, stop):
        x = torch.randint(0, 32, (4, 8), generator=gen)
        y = torch.roll(x, 1, dims=1)
        noise = np.random.rand()  # numpy RNG is part of the run
        jitter = random.random()  # and so is python's
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 32), y.reshape(-1)) * (
            1.0 + 0.01 * (noise + jitter)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())


def checkpoint_state(objs: dict[str, Any], step: int, losses: list[float]) -> dict[str, Any]:
    return {
        "model": objs["model"],
        "opt": objs["opt"],
        "sched": objs["sched"],
        "data_rng": objs["data_gen"].get_state(),
        "torch_rng": torch.get_rng_state(),
        "np_rng": np.random.get_state(),
        "py_rng": random.getstate(),
        "step": step,
        "losses": list(losses),
    }


def seed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_resumed_training_is_bit_identical(tmp_path: Path) -> None:
    # uninterrupted reference
    ref = build(0)
    seed_globals(100)
    ref_losses: list[float] = []
    train(ref, 0, N_STEPS, ref_losses)
    ref_weights = {k: v.clone() for k, v in ref["model"].state_dict().items()}

    # run K steps and checkpoint; keep training a bit afterwards (as a real run would) before "crashing"
    run = build(0)
    seed_globals(100)
    losses: list[float] = []
    train(run, 0, SAVE_AT, losses)
    assert losses == ref_losses[:SAVE_AT]
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(SAVE_AT, checkpoint_state(run, SAVE_AT, losses), metadata={"run": "resume-test"})
        train(run, SAVE_AT, SAVE_AT + 2, losses)  # changes everything in place while the save is written
        mgr.wait()
    del run

    # a new "process": fresh objects built with another seed, globals scrambled, new manager
    fresh = build(12345)
    seed_globals(777)
    state = checkpoint_state(fresh, 0, [])
    with CheckpointManager(tmp_path / "ckpt") as mgr2:
        assert mgr2.restore(state) == SAVE_AT
    assert state["step"] == SAVE_AT
    assert state["losses"] == ref_losses[:SAVE_AT]
    assert fresh["model"].out.weight is fresh["model"].emb.weight, "tied embedding came back untied"
    fresh["data_gen"].set_state(state["data_rng"])
    torch.set_rng_state(state["torch_rng"])
    np.random.set_state(state["np_rng"])
    random.setstate(state["py_rng"])

    resumed_losses = list(state["losses"])
    train(fresh, SAVE_AT, N_STEPS, resumed_losses)

    assert resumed_losses == ref_losses, f"losses diverge: {resumed_losses} vs {ref_losses}"
    for k, v in ref_weights.items():
        assert_tensor_equal(fresh["model"].state_dict()[k], v, f"model.{k}")
    assert fresh["sched"].get_last_lr() == ref["sched"].get_last_lr()
    for (k1, s1), (k2, s2) in zip(
        fresh["opt"].state_dict()["state"].items(), ref["opt"].state_dict()["state"].items(), strict=True
    ):
        assert k1 == k2
        for name in s2:
            assert_tensor_equal(s1[name], s2[name], f"opt.state[{k1}][{name}]")
