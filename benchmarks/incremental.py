"""Incremental checkpoints: bytes written and uploaded per save against the bytes that changed, and what it costs.

    python benchmarks/incremental.py [--base-gib 1.0] [--saves 4] [--pretrain-gib 1.0] [--no-s3]

1. A LoRA-style state: a frozen bf16 base (``--base-gib``, 12 layers of GPT shapes) plus rank-16 fp32 adapters on
   every 2-D weight and their AdamW state (about 3% of the base). Before each save the adapters and their optimizer
   state change (everything else stays). Saved ``--saves`` times by a manager with ``incremental=True`` and by one
   without, both with moto's S3 server on loopback as the remote (``--no-s3``: local only), interleaved. Per save:
   the bytes of the new local step folder and of the new remote step folder (what was written and uploaded, the
   manifests included) over the bytes that changed, the stall (``save()`` returning), the time to local
   durability and to remote durability; then the newest step's restore (a fresh manager, into a zeroed state,
   files dropped from the page cache where the harness can).
2. A pretraining state (:func:`harness.gpt_state`, ``--pretrain-gib``): every tensor changes before every save, so
   nothing can be skipped. Local only, ``--saves`` saves each, incremental and full interleaved save by save.
   The first incremental save hashes before it writes (no history yet); the later ones write while they hash, as
   a full save does.

Medians over the saves after the first (the first writes everything in both cases).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import harness as h
import torch

RANK = 16


def lora_state(base_bytes: int) -> dict[str, Any]:
    """The frozen base (bf16) with rank-``RANK`` fp32 adapters on its 2-D weights and AdamW moments for them."""
    gen = torch.Generator().manual_seed(0)
    base: dict[str, torch.Tensor] = {}
    adapters: dict[str, torch.Tensor] = {}
    for name, shape in h.plan_shapes(base_bytes * 7, 12):  # bf16 weights: 2 of the 14 bytes a parameter
        base[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if len(shape) == 2:
            adapters[f"{name}.lora_a"] = torch.randn(RANK, shape[1], generator=gen) * 0.01
            adapters[f"{name}.lora_b"] = torch.zeros(shape[0], RANK)
    opt = {"exp_avg": {k: torch.zeros_like(v) for k, v in adapters.items()},
           "exp_avg_sq": {k: torch.zeros_like(v) for k, v in adapters.items()}}
    return {"model": {"base": base, "adapters": adapters}, "optimizer": opt, "step": 0}


def train_step(state: dict[str, Any], step: int, frozen: bool = True) -> int:
    """Change what a step changes (the adapters and their optimizer state; everything with ``frozen=False``);
    returns those bytes."""
    g = torch.Generator().manual_seed(step)
    changed = [*state["model"]["adapters"].values(), *state["optimizer"]["exp_avg"].values(),
               *state["optimizer"]["exp_avg_sq"].values()] if frozen else h.tensors(state)
    for t in changed:
        t.add_(torch.randn(t.shape, generator=g).to(t.dtype) * 1e-3)
    state["step"] = step
    return sum(t.nbytes for t in changed)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def s3_bytes(s3: h.S3, prefix: str) -> int:
    return sum(s3.fs().du(prefix, total=False).values()) if s3.fs().exists(prefix) else 0


def lora_run(tc: Any, s3: h.S3 | None, scratch: Path, base_bytes: int, saves: int) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    states = {mode: lora_state(base_bytes) for mode in ("incremental", "full")}
    mgrs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        for mode in states:
            d = h.fresh_dir(scratch, f"incr-lora-{mode}")
            kw: dict[str, Any] = {"keep_local": 2, "incremental": mode == "incremental"}
            if s3 is not None:
                kw.update(remote=f"s3://{s3.bucket}/{d.name}", storage_options=s3.storage_options, keep_remote=2)
            mgrs[mode] = stack.enter_context(tc.CheckpointManager(d / "local", **kw))
            runs[mode] = {"dir": d, "saves": []}
        for step in range(1, saves + 1):
            for mode in h.rotate(list(states), step):
                mgr, state, d = mgrs[mode], states[mode], runs[mode]["dir"]
                changed = h.state_bytes(state) if step == 1 else train_step(state, step)
                h.settle()
                t0 = time.perf_counter()
                handle = mgr.save(step, state)
                stall = time.perf_counter() - t0
                durable = handle.persisted.result()
                uploaded = handle.uploaded.result() if s3 is not None else None
                mgr.wait()
                step_dir = d / "local" / f"step-{step:010d}"
                row = {"step": step, "changed": changed, "written": folder_bytes(step_dir), "stall_s": stall,
                       "durable_s": durable, "uploaded_s": uploaded}
                if s3 is not None:
                    row["uploaded"] = s3_bytes(s3, f"{s3.bucket}/{d.name}/step-{step:010d}")
                runs[mode]["saves"].append(row)
                h.log(f"lora {mode} step {step}: {row}")
    for mode, run in runs.items():  # restore the newest step into a zeroed state, fresh manager, cold files
        d = run["dir"]
        target = h.empty_like_state(states[mode])
        h.drop_files(d / "local")
        h.settle()
        with tc.CheckpointManager(d / "local", incremental=mode == "incremental") as mgr:
            t0 = time.perf_counter()
            got = mgr.restore(target)
            run["restore_s"] = time.perf_counter() - t0
        assert got == saves and h.states_equal(target, states[mode]), f"{mode}: restore gave step {got}"
        run["dir"] = str(d)
        h.remove(d)
    return runs


def pretrain_run(tc: Any, scratch: Path, nbytes: int, saves: int) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    mgrs: dict[str, Any] = {}
    state = h.gpt_state(nbytes)
    with contextlib.ExitStack() as stack:
        for mode in ("incremental", "full"):
            d = h.fresh_dir(scratch, f"incr-pretrain-{mode}")
            mgrs[mode] = stack.enter_context(tc.CheckpointManager(d / "local", keep_local=2,
                                                                  incremental=mode == "incremental"))
            runs[mode] = {"dir": d, "saves": []}
        for step in range(1, saves + 1):
            changed = h.state_bytes(state) if step == 1 else train_step(state, step, frozen=False)
            for mode in h.rotate(list(mgrs), step):
                h.settle()
                t0 = time.perf_counter()
                handle = mgrs[mode].save(step, state)
                stall = time.perf_counter() - t0
                durable = handle.persisted.result()
                written = folder_bytes(runs[mode]["dir"] / "local" / f"step-{step:010d}")
                runs[mode]["saves"].append({"step": step, "changed": changed, "written": written, "stall_s": stall,
                                            "durable_s": durable})
                h.log(f"pretrain {mode} step {step}: {runs[mode]['saves'][-1]}")
    for run in runs.values():
        h.remove(run["dir"])
        run["dir"] = str(run["dir"])
    return runs


def summary(runs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, run in runs.items():
        later = run["saves"][1:]
        m: dict[str, Any] = {k: h.median([r[k] for r in later if r.get(k) is not None])
                             for k in ("stall_s", "durable_s", "uploaded_s")}
        m["written_over_changed"] = h.median([r["written"] / r["changed"] for r in later])
        if all("uploaded" in r for r in later):
            m["uploaded_over_changed"] = h.median([r["uploaded"] / r["changed"] for r in later])
        m["restore_s"] = run.get("restore_s")
        out[mode] = m
    return out


def main() -> None:
    cli = h.Cli(__doc__, __file__)
    cli.add_argument("--base-gib", type=float, default=1.0)
    cli.add_argument("--pretrain-gib", type=float, default=1.0)
    cli.add_argument("--saves", type=int, default=4)
    cli.add_argument("--no-s3", action="store_true")
    args = cli.parse()
    tc = h.need_tierckpt("incremental checkpoints")
    scratch = h.scratch_dir(args.dir)
    result: dict[str, Any] = {"machine": h.machine(scratch)}
    with contextlib.ExitStack() as stack:
        s3 = None if args.no_s3 else h.try_s3(stack)
        lora = lora_run(tc, s3, scratch, int(args.base_gib * h.GiB), args.saves)
    pre = pretrain_run(tc, scratch, int(args.pretrain_gib * h.GiB), args.saves)
    result.update(lora=lora, pretrain=pre, lora_summary=summary(lora), pretrain_summary=summary(pre))
    li, lf = result["lora_summary"]["incremental"], result["lora_summary"]["full"]
    pi, pf = result["pretrain_summary"]["incremental"], result["pretrain_summary"]["full"]
    rows = [
        ["LoRA-style", "written / changed", h.fmt(li["written_over_changed"]), h.fmt(lf["written_over_changed"])],
        ["LoRA-style", "uploaded / changed", h.fmt(li.get("uploaded_over_changed")),
         h.fmt(lf.get("uploaded_over_changed"))],
        ["LoRA-style", "stall (s)", h.fmt(li["stall_s"]), h.fmt(lf["stall_s"])],
        ["LoRA-style", "durable (s)", h.fmt(li["durable_s"]), h.fmt(lf["durable_s"])],
        ["LoRA-style", "uploaded (s)", h.fmt(li["uploaded_s"]), h.fmt(lf["uploaded_s"])],
        ["LoRA-style", "restore of the newest step (s)", h.fmt(li["restore_s"]), h.fmt(lf["restore_s"])],
        ["pretraining", "written / changed", h.fmt(pi["written_over_changed"]), h.fmt(pf["written_over_changed"])],
        ["pretraining", "stall (s)", h.fmt(pi["stall_s"]), h.fmt(pf["stall_s"])],
        ["pretraining", "durable (s)", h.fmt(pi["durable_s"]), h.fmt(pf["durable_s"])],
    ]
    table = h.markdown_table(["state", "per save (median after the first)", "incremental=True", "full"], rows)
    print(table)
    h.finish(args, result, table)


if __name__ == "__main__":
    main()
