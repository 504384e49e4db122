"""One rank of the request-count benchmark (``benchmarks/request_counts.py``):
``python _request_counts_rank.py RANK CONFIG_JSON``.

The rank joins a gloo process group through a FileStore (``file://``, no ports), runs one phase and writes what it
saw to ``<result_dir>/result-r<rank>.json``; it exits non-zero when the phase failed or restored wrong bytes.
SIGUSR1 prints every thread's stack to stderr (the launcher sends it to a rank that outlived its timeout).

- ``save``: a manager on this rank's own local folder (one rank per "node") with the S3 remote saves steps
  1..S of a per-rank state, waiting after each save until it is durable and committed on every tier, then closes;
- ``restart``: a new manager on the same local folder restores into zeros; the bytes must be step S's;
- ``restart-wiped``: the same after deleting the local folder first (every shard comes from the remote).

Every S3 request of this rank carries ``tierckpt-rank/<rank>`` in its User-Agent (botocore's ``user_agent_extra``,
which changes nothing else), so that the counting server can tell the ranks apart.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("save", "restart", "restart-wiped")
#: what the counting server looks for in the User-Agent header
USER_AGENT_TAG = "tierckpt-rank"


def make_state(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    """This rank's state at ``step``: ``numel`` float32 values that differ across ranks and steps."""
    gen = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    return {"w": torch.randn(numel, generator=gen)}


def storage_options(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """The job's storage options plus this rank's User-Agent tag."""
    opts = json.loads(json.dumps(cfg["storage_options"]))
    opts.setdefault("config_kwargs", {})["user_agent_extra"] = f"{USER_AGENT_TAG}/{rank}"
    return opts


def open_manager(cfg: dict[str, Any], rank: int, local: Path) -> Any:
    """A manager with the benchmark's settings (the same on every rank)."""
    import tierckpt

    return tierckpt.CheckpointManager(
        local, remote=cfg["remote"], storage_options=storage_options(cfg, rank), keep_local=2, keep_remote=3,
        collective_timeout_s=cfg["collective_timeout_s"])


def phase_save(cfg: dict[str, Any], rank: int, local: Path) -> dict[str, Any]:
    """Save steps 1..S, each awaited (durable locally, uploaded and committed remotely) before the next. A save
    still not done after ``collective_timeout_s`` fails the phase with the save's state and ``mgr.health()`` (no
    remote request), instead of hanging until the launcher kills the rank."""
    mgr = open_manager(cfg, rank, local)
    limit = cfg["collective_timeout_s"]
    times = []
    try:
        for step in range(1, cfg["steps"] + 1):
            t0 = time.perf_counter()
            handle = mgr.save(step, make_state(rank, step, cfg["numel"]))
            try:
                mgr.wait(timeout=limit)
            except TimeoutError as exc:
                raise RuntimeError(
                    f"rank {rank}: save of step {step} not done after {limit:.0f} s (persisted: "
                    f"{handle.persisted.done()}, uploaded: {handle.uploaded.done()}); health: {mgr.health()}"
                ) from exc
            times.append(time.perf_counter() - t0)
    except BaseException:
        with contextlib.suppress(Exception):  # the save's error is the one to report; the others wait for us
            mgr.close(timeout=5.0)
        raise
    mgr.close(timeout=limit)
    return {"save_s": times}


def phase_restart(cfg: dict[str, Any], rank: int, local: Path, *, wipe: bool) -> dict[str, Any]:
    """Restore the newest step into zeros from a fresh manager (after deleting the local folder if ``wipe``) and
    compare the bytes with step S's."""
    if wipe:
        shutil.rmtree(local, ignore_errors=True)
    state = {"w": torch.zeros(cfg["numel"])}
    mgr = open_manager(cfg, rank, local)
    try:
        t0 = time.perf_counter()
        step = mgr.restore(state)
        restore_s = time.perf_counter() - t0
    finally:
        mgr.close()
    want = make_state(rank, cfg["steps"], cfg["numel"])["w"]
    equal = step == cfg["steps"] and torch.equal(state["w"], want)
    out: dict[str, Any] = {"restored": step, "equal": bool(equal), "restore_s": restore_s}
    if not equal:
        diff = (state["w"] != want).nonzero()
        out["mismatch"] = (f"rank {rank}: restored step {step}, expected {cfg['steps']}; "
                           f"{diff.numel()} of {want.numel()} values differ")
    return out


def main() -> int:
    """Run the configured phase as rank ``argv[1]``; 0 when it succeeded and restored the right bytes."""
    rank, cfg = int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks before it kills
    logging.basicConfig(format=f"%(asctime)s r{rank} %(threadName)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("tierckpt").setLevel(cfg.get("log_level", "WARNING"))
    torch.set_num_threads(1)
    phase = cfg["phase"]
    if phase not in PHASES:
        raise SystemExit(f"unknown phase {phase!r}")
    t_start = time.perf_counter()
    dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank, world_size=cfg["world"],
                            timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"] * 2))
    local = Path(cfg["local_root"]) / f"node{rank:05d}"
    record: dict[str, Any] = {"rank": rank, "phase": phase, "ok": False}
    try:
        dist.barrier()
        record["stage"] = "phase"  # where an error came from: the phase itself, or the barrier after it
        t0 = time.perf_counter()
        if phase == "save":
            record.update(phase_save(cfg, rank, local))
            record["ok"] = True
        else:
            record.update(phase_restart(cfg, rank, local, wipe=phase == "restart-wiped"))
            record["ok"] = record["equal"]
        record["phase_s"] = time.perf_counter() - t0
        record["stage"] = "barrier"
        dist.barrier()
    except Exception as exc:
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    record["process_s"] = time.perf_counter() - t_start
    path = Path(cfg["result_dir"]) / f"result-r{rank:05d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    if record["ok"]:
        dist.destroy_process_group()
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
