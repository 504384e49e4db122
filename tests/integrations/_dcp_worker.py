"""One rank of a multi-process DCP job for tests/integrations/test_dcp.py
(``python _dcp_worker.py SCENARIO RANK CONFIG``).

Each rank joins a gloo process group through a FileStore, builds a small FSDP2 model (``fully_shard`` on a CPU
mesh), and saves or loads it through ``torch.distributed.checkpoint`` with tierckpt's writer, stager and reader.
What each rank saw is written to ``<root>/result-<scenario>-r<rank>.json`` (a phase that raises records its traceback).
Compared values are full tensors (``full_tensor()``, the same on every rank), as lists.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from tests.distributed._dist_worker import Recorder  # noqa: E402 - the house recorder of rank results


def build(world: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def train(model, opt, seed: int) -> None:
    torch.manual_seed(1000 + seed)
    x = torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of a (nested) state as a full list; other values as they are (JSON)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        elif isinstance(v, DTensor):
            out[prefix] = v.full_tensor().tolist()
        elif isinstance(v, torch.Tensor):
            out[prefix] = v.tolist()
        else:
            out[prefix] = v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)

    walk("", state)
    return out


def scenario_save(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tierckpt
    import tierckpt.dcp

    mgr = tierckpt.CheckpointManager(cfg["local"], remote=cfg["remote"], keep_local=5, keep_remote=5)
    model, opt = build(world, seed=1)

    def sync_save():
        train(model, opt, 1)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": f"w{world}"}}
        dcp.save(state, storage_writer=tierckpt.dcp.StorageWriter(mgr, 10))
        return full(state)

    def async_saves():
        stager = tierckpt.dcp.Stager(mgr)
        # DCP's save thread runs collectives while this thread trains: it gets its own group (as torchtitan does)
        group = dist.new_group(backend="gloo")
        futures, seen = [], {}
        for step in (20, 30, 40):
            train(model, opt, step)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "extra": {"epoch": step, "tag": f"w{world}"}}
            seen[step] = full(state)
            resp = dcp.async_save(state, storage_writer=tierckpt.dcp.StorageWriter(mgr, step), async_stager=stager,
                                  process_group=group)
            futures.append(getattr(resp, "upload_completion", resp))
        for f in futures:
            f.result()
        stager.close()
        mgr.wait()
        return {str(k): v for k, v in seen.items()}

    t0 = time.monotonic()
    rec.phase("sync_save", sync_save)
    t1 = time.monotonic()
    rec.phase("async_saves", async_saves)
    rec.put("seconds", [t1 - t0, time.monotonic() - t1])
    rec.put("steps", [s.step for s in mgr.steps()])
    dist.barrier()
    mgr.close()


def scenario_load(rank: int, world: int, cfg: dict[str, Any], rec: Recorder) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import tierckpt
    import tierckpt.dcp

    mgr = tierckpt.CheckpointManager(cfg["local"], remote=cfg["remote"], keep_local=5, keep_remote=5)
    model, opt = build(world, seed=7)
    train(model, opt, 99)  # the optimizer has state tensors to load into

    def load(step: int | None):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": -1, "tag": ""}}
        reader = tierckpt.dcp.StorageReader(mgr, step=step)
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        msd, osd = get_state_dict(model, opt)
        return {"step": reader.loaded_step, "state": full({"model": msd, "optim": osd, "extra": state["extra"]})}

    def corrupt_newest():
        # saved rank 1's shard of step 40 damaged in both tiers: every rank must load step 30, the newest step
        # that all ranks found intact (rank 1 % world checks saved rank 1, the others agree through the gather)
        if rank == 0:
            for root in (cfg["local"], cfg["remote"]):
                for path in Path(root, "step-0000000040").glob("r00001-p*.safetensors"):
                    data = bytearray(path.read_bytes())
                    data[-1] ^= 0xFF
                    path.write_bytes(bytes(data))
        dist.barrier()
        return load(None)

    rec.phase("load_newest", lambda: load(None))
    rec.phase("load_10", lambda: load(10))
    rec.phase("load_after_corruption", corrupt_newest)
    dist.barrier()
    mgr.close()


SCENARIOS = {"save": scenario_save, "load": scenario_load}


def main() -> None:
    started = time.monotonic()
    scenario, rank, cfg_path = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    cfg = json.loads(cfg_path.read_text())
    world = cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["store"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    rec = Recorder(Path(cfg["root"]) / f"result-{cfg['name']}-r{rank}.json")
    rec.put("init_s", time.monotonic() - started)  # after the imports and the group's start
    SCENARIOS[scenario](rank, world, cfg, rec)
    rec.put("done", True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
