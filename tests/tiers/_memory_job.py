"""A training process with ``memory_tier=True`` for the memory-tier tests (run forked from the test's server).

``python _memory_job.py ROOT save STEPS``: saves steps 1..STEPS, waits until each is committed, prints "saved" and
SIGKILLs itself (a crash after the save: nothing closes the manager). ``TIERCKPT_FAULT`` may kill it earlier.
``python _memory_job.py ROOT restore OUT``: restores into an empty state, then ``load()``s the same step, and writes
to OUT (JSON) the step, which tier each came from (the memory tier's record of its restores) and whether both equal
the deterministic state of that step; the restored tensors go to OUT.pt for the test to compare with the disk copy.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import torch

from tests._support.helpers import empty_like_kill_state, kill_state
from tierckpt import CheckpointManager


def main() -> None:
    root, mode, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    mgr = CheckpointManager(root, memory_tier=True, keep_local=3)
    memory = mgr.components.staging.memory
    if mode == "save":
        for step in range(1, int(arg) + 1):
            mgr.save(step, kill_state(step, 7, False))
            mgr.wait()
        print("saved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    state = empty_like_kill_state(False)
    step = mgr.restore(state)
    assert step is not None
    after_restore = list(memory.restored) if memory is not None else None
    loaded = mgr.load()
    want = kill_state(step, 7, False)
    same = all(torch.equal(state[k], want[k]) for k in ("w", "h", "ids")) and state["meta"] == want["meta"]
    loaded_same = all(torch.equal(loaded.state[k], want[k]) for k in ("w", "h", "ids"))
    torch.save({k: state[k] for k in ("w", "h", "ids")}, arg + ".pt")
    with open(arg, "w") as f:
        json.dump({"step": step, "restored_from_memory": after_restore,
                   "loaded_from_memory": list(memory.restored) if memory is not None else None,
                   "equal": same, "loaded_equal": loaded_same, "memory_dir": memory.dir if memory else None}, f)
    os.kill(os.getpid(), signal.SIGKILL)  # crash again: the memory copy stays for the test to look at


if __name__ == "__main__":
    main()
