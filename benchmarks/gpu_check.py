"""GPU check for a CUDA machine (H100/H200 class): D2H limit, tierckpt's snapshot stall, DCP's stall, correctness.

    python benchmarks/gpu_check.py [--size-gib 4] [--dir SCRATCH] [--budget-s 200] [--out gpu.json]

Needs torch and tierckpt only (the harness imports nothing else here), sized to finish in under four minutes:

1. the limit: pinned device-to-host copy bandwidth, ``pinned.copy_(cuda_tensor, non_blocking=True)`` +
   ``synchronize``, for one flat multi-GiB tensor and for the benchmark state tensor by tensor into one
   preallocated pinned buffer;
2. tierckpt: the stall of ``mgr.save`` (until it returns) of a multi-GiB CUDA state (bf16 parameters, fp32 master
   weights and AdamW moments), first save and steady state, as bandwidth and as a ratio to the limit (target
   >= 0.8), and the time until durable on the local disk;
3. DCP ``async_save``'s stall (default stager; ``DefaultStager`` with pinned memory and non-blocking copies);
4. correctness: (a) the state is changed in place by a kernel launched the instant ``save()`` returns, then restored
   and compared with a copy taken before the save (catches a copy stream that races the training stream); (b) a
   real model + AdamW: ``save()`` then ``optimizer.step()`` at once, restore, compare with the pre-step values of
   every parameter and optimizer tensor.

Prints the JSON summary, writes it to ``--out`` and, when ``OUT`` is set, to ``$OUT/gpu.json``. Without CUDA it
says so and exits 0; a phase that fails is recorded under ``errors`` and the others still run.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness as h
import torch


def timed_runs(fn: Callable[[], Any], repeats: int) -> float | None:
    """The median seconds of ``repeats`` calls of ``fn`` after one warm-up, the device synchronized around each."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return h.median(times[1:])


def measure_d2h(state: dict[str, Any], nbytes: int, repeats: int) -> dict[str, Any]:
    """Pinned D2H bandwidth: one flat tensor of the state's size, then the state tensor by tensor into one pinned
    buffer; and a pageable ``.cpu()`` of every tensor for reference."""
    ts = h.tensors(state)
    t0 = time.perf_counter()
    host = torch.empty(nbytes + 4096 * len(ts), dtype=torch.uint8, pin_memory=True)
    out: dict[str, Any] = {"pinned_alloc_s": time.perf_counter() - t0}
    flat: Any = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    out["flat_s"] = timed_runs(lambda: host[:nbytes].copy_(flat, non_blocking=True), repeats)
    flat = None  # freed before the state's copies
    torch.cuda.empty_cache()
    views, off = [], 0
    for t in ts:
        views.append(host[off : off + t.nbytes].view(t.dtype).view(t.shape))
        off += (t.nbytes + 4095) // 4096 * 4096
    out["per_tensor_s"] = timed_runs(lambda: [v.copy_(t, non_blocking=True) for v, t in zip(views, ts)], repeats)
    t0 = time.perf_counter()
    for t in ts:
        t.cpu()
    out["pageable_cpu_s"] = time.perf_counter() - t0
    out["flat_gbps"], out["per_tensor_gbps"] = nbytes / out["flat_s"] / 1e9, nbytes / out["per_tensor_s"] / 1e9
    out["pageable_gbps"] = nbytes / out["pageable_cpu_s"] / 1e9
    return out


def measure_tierckpt(tc: Any, state: dict[str, Any], nbytes: int, root: Path, saves: int) -> dict[str, Any]:
    """Stall (``save()`` returning) and local durability over ``saves`` saves, each awaited before the next."""
    stalls, durables = [], []
    with tc.CheckpointManager(root, keep_local=1) as mgr:
        for k in range(saves):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = mgr.save(k + 1, state)
            stalls.append(time.perf_counter() - t0)
            handle.persisted.result()
            durables.append(time.perf_counter() - t0)
            mgr.wait()
    steady = stalls[1:] or stalls
    return {"stalls": stalls, "durables": durables, "first_stall_s": stalls[0], "stall_s": h.median(steady),
            "stall_max_s": max(steady), "durable_s": h.median(durables[1:] or durables),
            "snapshot_gbps": nbytes / h.median(steady) / 1e9}


def measure_dcp(state: dict[str, Any], nbytes: int, root: Path, stager: bool, runs: int) -> dict[str, Any]:
    """DCP ``async_save``'s stall (with ``DefaultStager``: until staging completes), its bare return and its durable
    time; the first run apart. One stager serves every save, as a training loop would use it; where this torch
    cannot stage twice with one (torch 2.11: pytorch/pytorch#183413, its staging closes itself), each save gets a
    fresh stager, which is how DCP runs there, and ``stager_reuse`` says so."""
    import torch.distributed.checkpoint as dcp

    def new_stager() -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(True, False, True, True))

    st = new_stager() if stager else None
    reuse, rs = stager, []

    def one(d: Path) -> dict[str, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True,
                              **({"async_stager": st} if st is not None else {}))
        return h.dcp_async_times(resp, t0)

    try:
        for k in range(runs):
            d = root / f"dcp{k}"
            if st is not None and k > 0 and not reuse:
                st.close()
                st = new_stager()
            try:
                rs.append(one(d))
            except KeyError:
                if not (reuse and k > 0):
                    raise
                h.log("DefaultStager cannot stage a second time on this torch; a fresh one per save")
                reuse = False
                shutil.rmtree(d, ignore_errors=True)
                st.close()  # type: ignore[union-attr]
                st = new_stager()
                rs.append(one(d))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if st is not None:
            st.close()
    steady = rs[1:] or rs
    out = {"first": rs[0], **{f"{k}_s": h.median([r[k] for r in steady]) for k in ("stall_return", "stall", "durable")}}
    out["stall_gbps"] = nbytes / out["stall_s"] / 1e9
    return {**out, "stager_reuse": reuse} if stager else out


def check_race(tc: Any, state: dict[str, Any], root: Path) -> dict[str, Any]:
    """``save()``, then every tensor changed in place at once: the checkpoint must hold the values before the change."""
    ref, mutated = h.empty_like_state(state), h.empty_like_state(state)
    h.copy_into(ref, state)
    torch.cuda.synchronize()
    with tc.CheckpointManager(root, keep_local=1) as mgr:
        mgr.save(1, state)
        for t in h.tensors(state):  # launched on the training stream the instant save() returns
            t.mul_(-2).add_(1)
        h.copy_into(mutated, state)
        mgr.wait()
        step = mgr.restore(state)
    ok, changed = h.states_equal(state, ref), not h.states_equal(mutated, ref)
    return {"restored_step": step, "equal_to_pre_save_values": ok, "mutation_took_effect": changed,
            "ok": ok and changed}


def check_optimizer_roundtrip(tc: Any, root: Path) -> dict[str, Any]:
    """A real model + AdamW on CUDA: save, then ``optimizer.step()`` at once; the restore gives the pre-step values."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 2048, device="cuda")
    for k in range(4):  # three steps, then the gradients of a fourth
        opt.zero_grad()
        model(x).square().mean().backward()
        if k < 3:
            opt.step()
    ref_model = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]

    def same() -> tuple[bool, bool]:
        return (all(torch.equal(v, ref_model[k]) for k, v in model.state_dict().items()),
                all(torch.equal(v, r[k]) if torch.is_tensor(v) else v == r[k]
                    for s, r in zip(opt.state.values(), ref_opt) for k, v in s.items()))

    with tc.CheckpointManager(root, keep_local=1) as mgr:
        mgr.save(4, {"model": model, "optim": opt})
        opt.step()  # right after save() returns
        stepped = not same()[0]
        mgr.wait()
        for p in model.parameters():
            p.data.zero_()
        step = mgr.restore({"model": model, "optim": opt})
    model_ok, opt_ok = same()
    on_cuda = all(p.device.type == "cuda" for p in model.parameters())
    return {"restored_step": step, "optimizer_step_changed_params": stepped, "model_equal": model_ok,
            "optimizer_equal": opt_ok, "params_still_on_cuda": on_cuda,
            "ok": bool(stepped and model_ok and opt_ok and on_cuda)}


def main(argv: list[str] | None = None) -> int:
    """Always exits 0 with the JSON summary (errors are recorded in it)."""
    p = h.Cli(__doc__, __file__, markdown=False)
    p.add_argument("--size-gib", type=float, default=4.0, help="CUDA state size (default 4)")
    p.add_argument("--saves", type=int, default=3, help="tierckpt saves (default 3: first + 2 steady)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the D2H limit (default 3)")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip later phases once this much time is spent")
    a = p.parse(argv)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "errors": {}, "skipped": [],
                               "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not summary["cuda"]:
        summary["message"] = "no CUDA device: the GPU check needs one; nothing was measured (this is not a failure)"
        return emit(a, summary)
    summary.update(device=torch.cuda.get_device_name(0), cuda_version=torch.version.cuda, cpu_count=os.cpu_count())
    tc, why = h.import_tierckpt()
    if tc is None:
        summary["errors"]["import_tierckpt"] = why
    summary["tierckpt_version"] = getattr(tc, "__version__", None)
    root = Path(a.dir) if a.dir else h.BENCH_DIR / "gpu"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    summary["scratch"] = str(root)

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if time.perf_counter() - t_start > a.budget_s:
            summary["skipped"].append(f"{name} (time budget)")
            return None
        h.log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:
            summary["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None
        finally:
            h.log(f"{name} done in {time.perf_counter() - t0:.1f}s")

    state = h.gpt_state(int(a.size_gib * h.GiB), device="cuda")
    torch.cuda.synchronize()
    nbytes = h.state_bytes(state)
    summary["state"] = {"bytes": nbytes, "gib": nbytes / h.GiB, "tensors": len(h.tensors(state))}
    d2h = summary["d2h_limit"] = phase("d2h_limit", lambda: measure_d2h(state, nbytes, a.repeats))
    if tc is not None:
        tk = summary["tierckpt"] = phase("tierckpt_snapshot",
                                         lambda: measure_tierckpt(tc, state, nbytes, root / "tk", a.saves))
        if tk and d2h:
            tk["snapshot_vs_pinned_per_tensor"] = tk["snapshot_gbps"] / d2h["per_tensor_gbps"]
            tk["snapshot_vs_pinned_flat"] = tk["snapshot_gbps"] / d2h["flat_gbps"]
            tk["meets_0.8x_target"] = tk["snapshot_gbps"] >= 0.8 * d2h["flat_gbps"]
        shutil.rmtree(root / "tk", ignore_errors=True)
    else:
        summary["skipped"].append("tierckpt (not importable)")
    summary["dcp_async_save"] = phase("dcp_async_default", lambda: measure_dcp(state, nbytes, root, False, 2))
    if h.default_stager_available():
        summary["dcp_async_save_DefaultStager"] = phase("dcp_async_DefaultStager",
                                                        lambda: measure_dcp(state, nbytes, root, True, 2))
    else:
        summary["skipped"].append("DefaultStager (not in this torch)")
    if tc is not None:
        summary["check_race"] = phase("check_race", lambda: check_race(tc, state, root / "race"))
        del state
        torch.cuda.empty_cache()
        summary["check_optimizer"] = phase("check_optimizer", lambda: check_optimizer_roundtrip(tc, root / "opt"))
    checks = [summary.get("check_race"), summary.get("check_optimizer")]
    summary["correct"] = all(c and c.get("ok") for c in checks) if tc is not None else None
    shutil.rmtree(root, ignore_errors=True)
    summary["wall_s"] = time.perf_counter() - t_start
    return emit(a, summary)


def emit(args: Any, summary: dict[str, Any]) -> int:
    """Print the summary, write it to ``$OUT/gpu.json`` when ``OUT`` is set, and finish the run."""
    text = json.dumps(summary, indent=2, default=str)
    print(text, flush=True)
    if out := os.environ.get("OUT"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu.json").write_text(text + "\n")
    h.finish(args, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
