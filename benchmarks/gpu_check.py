"""GPU check for a CUDA machine (H100/H200 class): D2H limit, tierckpt's snapshot stall, DCP's stall, correctness.

    python benchmarks/gpu_check.py [--size-gib 4] [--dir SCRATCH] [--budget-s 200]

Self-contained (imports nothing from the other benchmark scripts) and sized to finish in under four minutes:

1. the limit: pinned device-to-host copy bandwidth, ``pinned.copy_(cuda_tensor, non_blocking=True)`` +
   ``synchronize``, for one flat multi-GiB tensor and for the benchmark state tensor by tensor into one
   preallocated pinned buffer;
2. tierckpt: stall of ``mgr.save`` (until it returns) of a multi-GiB CUDA state (bf16 parameters + fp32 AdamW
   moments and master weights), first save and steady state, as bandwidth and as a ratio to the limit (target
   >= 0.8), and the time until locally durable;
3. DCP ``async_save`` stall (default stager; ``DefaultStager`` with pinned memory and non-blocking copies);
4. correctness: (a) the multi-GiB state is changed in place by a kernel launched the instant ``save()`` returns,
   then restored and compared with a copy taken before the save (catches a copy stream that races the training
   stream); (b) a real model + AdamW: ``save()`` then ``optimizer.step()`` at once, restore, compare with the
   pre-step values of every parameter and optimizer tensor.

Prints one JSON summary to stdout and writes it to ``$OUT/gpu.json`` when ``OUT`` is set. Without CUDA it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

warnings.filterwarnings("ignore", module=r"torch(\..*)?$")

GiB = 1 << 30


def emit(summary: dict[str, Any]) -> None:
    """Print the JSON summary and write it to $OUT/gpu.json when OUT is set."""
    text = json.dumps(summary, indent=2, default=str)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu.json").write_text(text + "\n")


def log(msg: str) -> None:
    """Progress on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpt_shapes(total_bytes: int, n_layer: int = 12) -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-shaped parameter list whose state (14 bytes/param: bf16 + 3 x fp32) is about ``total_bytes``."""
    params = total_bytes / 14
    vocab0, ctx = 32000, 1024
    a, b = 12 * n_layer, 13 * n_layer + vocab0 + ctx + 2
    d = max(64, int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)) // 64 * 64)
    vocab = max(256, int((params - 12 * n_layer * d * d - (13 * n_layer + ctx + 2) * d) // d))
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, d)), ("wpe", (ctx, d))]
    for i in range(n_layer):
        shapes += [
            (f"h{i}.ln1.w", (d,)), (f"h{i}.ln1.b", (d,)), (f"h{i}.qkv.w", (3 * d, d)), (f"h{i}.qkv.b", (3 * d,)),
            (f"h{i}.proj.w", (d, d)), (f"h{i}.proj.b", (d,)), (f"h{i}.ln2.w", (d,)), (f"h{i}.ln2.b", (d,)),
            (f"h{i}.fc.w", (4 * d, d)), (f"h{i}.fc.b", (4 * d,)), (f"h{i}.fc2.w", (d, 4 * d)), (f"h{i}.fc2.b", (d,)),
        ]  # fmt: skip
    return shapes + [("ln_f.w", (d,)), ("ln_f.b", (d,))]


def cuda_state(total_bytes: int, torch: Any) -> dict[str, Any]:
    """The benchmark state on the GPU: bf16 parameters, fp32 master weights and AdamW moments."""
    g = torch.Generator(device="cuda").manual_seed(0)
    model, master, m1, m2 = {}, {}, {}, {}
    for name, shape in gpt_shapes(total_bytes):
        w = torch.randn(shape, device="cuda", generator=g)
        master[name] = w
        model[name] = w.to(torch.bfloat16)
        m1[name] = torch.randn(shape, device="cuda", generator=g)
        m2[name] = torch.rand(shape, device="cuda", generator=g)
    torch.cuda.synchronize()
    return {"model": model, "optimizer": {"master": master, "exp_avg": m1, "exp_avg_sq": m2}}


def leaves(tree: Any) -> list[Any]:
    """Tensors of a nested dict, in order."""
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    return [tree]


def map_tree(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor of a nested dict."""
    if isinstance(tree, dict):
        return {k: map_tree(v, fn) for k, v in tree.items()}
    return fn(tree)


def trees_equal(a: Any, b: Any, torch: Any) -> bool:
    """Bit equality of two nested dicts of tensors."""
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y.to(x.device)) for x, y in zip(la, lb, strict=True))


def med(xs: list[float]) -> float | None:
    """Median or None."""
    return statistics.median(xs) if xs else None


def measure_d2h(state: dict[str, Any], nbytes: int, torch: Any, repeats: int) -> dict[str, Any]:
    """Pinned D2H bandwidth: one flat tensor of the state's size, then the state tensor by tensor."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    host = torch.empty(nbytes + 4096 * len(leaves(state)), dtype=torch.uint8, pin_memory=True)
    out["pinned_alloc_s"] = time.perf_counter() - t0
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat.fill_(1)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host[:nbytes].copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["flat_s"] = med(times[1:])
    out["flat_gbps"] = nbytes / out["flat_s"] / 1e9
    del flat
    torch.cuda.empty_cache()
    views, off = [], 0
    for t in leaves(state):
        views.append(host[off : off + t.nbytes].view(t.dtype).view(t.shape))
        off += (t.nbytes + 4095) // 4096 * 4096
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for v, t in zip(views, leaves(state), strict=True):
            v.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["per_tensor_s"] = med(times[1:])
    out["per_tensor_gbps"] = nbytes / out["per_tensor_s"] / 1e9
    # pageable for reference (what a naive .cpu() gets)
    t0 = time.perf_counter()
    for t in leaves(state)[:]:
        t.cpu()
    out["pageable_cpu_s"] = time.perf_counter() - t0
    out["pageable_gbps"] = nbytes / out["pageable_cpu_s"] / 1e9
    del views, host
    return out


def measure_tierckpt(
    tc: Any, state: dict[str, Any], nbytes: int, root: Path, saves: int, torch: Any
) -> dict[str, Any]:
    """Stall (save() returning) and local durability over ``saves`` saves, each awaited before the next."""
    out: dict[str, Any] = {"stalls": [], "durables": []}
    mgr = tc.CheckpointManager(root, keep_local=1)
    try:
        for k in range(saves):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = mgr.save(k + 1, state)
            out["stalls"].append(time.perf_counter() - t0)
            h.persisted.result()
            out["durables"].append(time.perf_counter() - t0)
            mgr.wait()
    finally:
        mgr.close()
    out["first_stall_s"] = out["stalls"][0]
    out["stall_s"] = med(out["stalls"][1:] or out["stalls"])
    out["stall_max_s"] = max(out["stalls"][1:] or out["stalls"])
    out["durable_s"] = med(out["durables"][1:] or out["durables"])
    out["snapshot_gbps"] = nbytes / out["stall_s"] / 1e9
    return out


def measure_dcp(
    state: dict[str, Any], nbytes: int, root: Path, stager: bool, runs: int, torch: Any
) -> dict[str, Any]:
    """DCP async_save stall (and staging time with DefaultStager), durable time; first run is reported apart.

    With ``stager`` one ``DefaultStager`` serves every save, as a training loop would use it. Where this torch
    cannot stage twice with one (torch 2.11: pytorch/pytorch#183413, its staging closes itself), each save gets a
    fresh stager, which is how DCP runs there, and ``stager_reuse`` says so."""
    import torch.distributed.checkpoint as dcp

    def new_stager() -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(True, False, True, True))

    st = new_stager() if stager else None
    reuse = stager
    rs: list[dict[str, float]] = []

    def one(d: Path) -> dict[str, float]:
        kwargs: dict[str, Any] = {"async_stager": st} if st is not None else {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True, **kwargs)
        r = {"stall_return": time.perf_counter() - t0}
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
            r["stall"] = time.perf_counter() - t0
            fut = resp.upload_completion
        else:
            r["stall"] = r["stall_return"]
            fut = resp
        fut.result()
        r["durable"] = time.perf_counter() - t0
        return r

    try:
        for k in range(runs):
            d = root / f"dcp{k}"
            if st is not None and k > 0 and not reuse:
                st.close()
                st = new_stager()
            try:
                rs.append(one(d))
            except KeyError:
                if not (stager and reuse and k > 0):
                    raise
                log("DefaultStager cannot stage a second time on this torch; a fresh one per save")
                reuse = False
                shutil.rmtree(d, ignore_errors=True)
                st.close()
                st = new_stager()
                rs.append(one(d))
            shutil.rmtree(d, ignore_errors=True)
    finally:
        if st is not None:
            st.close()
    steady = rs[1:] or rs
    out: dict[str, Any] = {
        "first": rs[0],
        "stall_return_s": med([r["stall_return"] for r in steady]),
        "stall_s": med([r["stall"] for r in steady]),
        "durable_s": med([r["durable"] for r in steady]),
        "stall_gbps": nbytes / med([r["stall"] for r in steady]) / 1e9,
    }
    if stager:
        out["stager_reuse"] = reuse
    return out


def check_race(tc: Any, state: dict[str, Any], root: Path, torch: Any) -> dict[str, Any]:
    """save(), then change every tensor in place at once; the checkpoint must hold the values before the change."""
    ref = map_tree(state, lambda t: t.clone())
    torch.cuda.synchronize()
    mgr = tc.CheckpointManager(root, keep_local=1)
    try:
        mgr.save(1, state)
        for t in leaves(state):  # launched on the training stream the instant save() returns
            t.mul_(-2).add_(1)
        mutated = map_tree(state, lambda t: t.clone())
        mgr.wait()
        step = mgr.restore(state)
    finally:
        mgr.close()
    ok = trees_equal(state, ref, torch)
    changed = not trees_equal(mutated, ref, torch)
    del ref, mutated
    return {
        "restored_step": step,
        "equal_to_pre_save_values": ok,
        "mutation_took_effect": changed,
        "ok": ok and changed,
    }


def check_optimizer_roundtrip(tc: Any, root: Path, torch: Any) -> dict[str, Any]:
    """A real model + AdamW on CUDA: save then optimizer.step() at once; restore gives the pre-step values."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 2048, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    ref_model = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
               for i, s in enumerate(opt.state.values())}  # fmt: skip
    mgr = tc.CheckpointManager(root, keep_local=1)
    try:
        mgr.save(4, {"model": model, "optim": opt})
        opt.step()  # right after save() returns
        stepped = not all(torch.equal(v, ref_model[k]) for k, v in model.state_dict().items())
        mgr.wait()
        for p in model.parameters():
            p.data.zero_()
        step = mgr.restore({"model": model, "optim": opt})
    finally:
        mgr.close()
    model_ok = all(torch.equal(v, ref_model[k]) for k, v in model.state_dict().items())
    opt_ok = all(
        torch.equal(v, ref_opt[i][k]) if torch.is_tensor(v) else v == ref_opt[i][k]
        for i, s in enumerate(opt.state.values())
        for k, v in s.items()
    )
    devices_ok = all(p.device.type == "cuda" for p in model.parameters())
    return {"restored_step": step, "optimizer_step_changed_params": stepped, "model_equal": model_ok,
            "optimizer_equal": opt_ok, "params_still_on_cuda": devices_ok,
            "ok": bool(stepped and model_ok and opt_ok and devices_ok)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Entry point: always exits 0 with a JSON summary (errors are recorded in it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=4.0, help="CUDA state size (default 4)")
    p.add_argument("--saves", type=int, default=3, help="tierckpt saves (default 3: first + 2 steady)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of the D2H limit (default 3)")
    p.add_argument("--dir", help="scratch folder (default REPO/.bench/gpu)")
    p.add_argument(
        "--budget-s", type=float, default=200.0, help="skip later phases once this much time is spent"
    )
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "errors": {}, "skipped": []}
    try:
        import torch
    except ImportError:
        summary["cuda"] = False
        summary["message"] = "torch is not installed: nothing to check"
        emit(summary)
        return 0
    summary["torch"] = torch.__version__
    if not torch.cuda.is_available():
        summary["cuda"] = False
        summary["message"] = (
            "no CUDA device: the GPU check needs one; nothing was measured (this is not a failure)"
        )
        emit(summary)
        return 0
    summary["cuda"] = True
    summary["device"] = torch.cuda.get_device_name(0)
    summary["cuda_version"] = torch.version.cuda
    summary["cpu_count"] = os.cpu_count()
    try:
        import tierckpt

        tc: Any = tierckpt if hasattr(tierckpt, "CheckpointManager") else None
    except Exception as exc:
        tc = None
        summary["errors"]["import_tierckpt"] = f"{type(exc).__name__}: {exc}"
    summary["tierckpt_version"] = getattr(tc, "__version__", None)

    root = Path(a.dir) if a.dir else REPO_ROOT / ".bench" / "gpu"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    summary["scratch"] = str(root)

    def over_budget(phase: str) -> bool:
        if time.perf_counter() - t_start > a.budget_s:
            summary["skipped"].append(f"{phase} (time budget)")
            return True
        return False

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if over_budget(name):
            return None
        log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as exc:
            summary["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            res = None
        log(f"{name} done in {time.perf_counter() - t0:.1f}s")
        return res

    state = cuda_state(int(a.size_gib * GiB), torch)
    nbytes = sum(t.nbytes for t in leaves(state))
    summary["state"] = {"bytes": nbytes, "gib": nbytes / GiB, "tensors": len(leaves(state))}
    d2h = phase("d2h_limit", lambda: measure_d2h(state, nbytes, torch, a.repeats))
    summary["d2h_limit"] = d2h
    if tc is not None:
        tk = phase(
            "tierckpt_snapshot", lambda: measure_tierckpt(tc, state, nbytes, root / "tk", a.saves, torch)
        )
        summary["tierckpt"] = tk
        if tk and d2h:
            summary["tierckpt"]["snapshot_vs_pinned_per_tensor"] = (
                tk["snapshot_gbps"] / d2h["per_tensor_gbps"]
            )
            summary["tierckpt"]["snapshot_vs_pinned_flat"] = tk["snapshot_gbps"] / d2h["flat_gbps"]
            summary["tierckpt"]["meets_0.8x_target"] = tk["snapshot_gbps"] >= 0.8 * d2h["flat_gbps"]
        shutil.rmtree(root / "tk", ignore_errors=True)
    else:
        summary["skipped"].append("tierckpt (not importable)")
    summary["dcp_async_save"] = phase(
        "dcp_async_default", lambda: measure_dcp(state, nbytes, root, False, 2, torch)
    )
    try:
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401

        summary["dcp_async_save_DefaultStager"] = phase(
            "dcp_async_DefaultStager", lambda: measure_dcp(state, nbytes, root, True, 2, torch)
        )
    except ImportError:
        summary["skipped"].append("DefaultStager (not in this torch)")
    if tc is not None:
        summary["check_race"] = phase("check_race", lambda: check_race(tc, state, root / "race", torch))
        del state
        torch.cuda.empty_cache()
        summary["check_optimizer"] = phase(
            "check_optimizer", lambda: check_optimizer_roundtrip(tc, root / "opt", torch)
        )
    checks = [summary.get("check_race"), summary.get("check_optimizer")]
    summary["correct"] = all(c and c.get("ok") for c in checks) if tc is not None else None
    shutil.rmtree(root, ignore_errors=True)
    summary["wall_s"] = time.perf_counter() - t_start
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
