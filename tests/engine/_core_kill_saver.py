"""Child process for the SIGKILL tests: saves real checkpoints and gets killed by the parent mid-save.

usage: python _core_kill_saver.py MODE ROOT SEED
  MODE=fresh:   save step 1 (small), wait, print READY, save step 2 (big), wait, print DONE, sleep
  MODE=replace: (step 5 exists on disk) open a manager, print READY, save step 5 (big) again, wait, print DONE, sleep
"""

from __future__ import annotations

import sys
import time

from tests._support.helpers import kill_state
from tierckpt import CheckpointManager


def main() -> None:
    mode, root, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mgr = CheckpointManager(root, keep_local=3)
    if mode == "fresh":
        s1, s2 = kill_state(1, seed, big=False), kill_state(2, seed, big=True)
        mgr.save(1, s1)
        mgr.wait()
        print("READY", flush=True)
        mgr.save(2, s2)
        mgr.wait()
    elif mode == "replace":
        s5 = kill_state(5, seed + 1, big=True)
        print("READY", flush=True)
        mgr.save(5, s5)
        mgr.wait()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("DONE", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
