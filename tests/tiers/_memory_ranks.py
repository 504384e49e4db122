"""One rank of a two-rank job with ``memory_tier=True, incremental=True`` on one node (one local folder) for the
memory-tier tests (``python _memory_ranks.py MODE RANK ROOT STORE``).

``save``: saves steps 1 and 2 (step 2 references step 1's bytes of the tensor no step changes), waits, and every
rank SIGKILLs itself once all have committed (a crash of the whole job after a save). ``restore``: restores into an
empty state and writes to ``ROOT/result-restore-r<RANK>.json`` the step, the steps its memory tier served and
whether the state equals the one saved.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tierckpt import CheckpointManager


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(rank * 100 + step)
    return {"w": torch.randn(1000 + 17 * rank, generator=g), "frozen": torch.arange(4096.0) + rank,
            "meta": {"rank": rank, "step": step}}


def main() -> None:
    mode, rank, root, store = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mgr = CheckpointManager(root / "node", memory_tier=True, incremental=True, collective_timeout_s=20)
    tier = mgr.components.staging.memory
    if mode == "save":
        for step in (1, 2):
            mgr.save(step, state(rank, step))
        mgr.wait()
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    live = {"w": torch.zeros(1000 + 17 * rank), "frozen": torch.zeros(4096), "meta": {"rank": -1, "step": -1}}
    step = mgr.restore(live)
    assert step is not None
    want = state(rank, step)
    out = {"step": step, "from_memory": list(tier.restored) if tier else None,
           "equal": bool(torch.equal(live["w"], want["w"]) and torch.equal(live["frozen"], want["frozen"]))
           and live["meta"] == want["meta"]}
    (root / f"result-restore-r{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
