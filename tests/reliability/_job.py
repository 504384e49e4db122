"""A training job in its own process, for the tests of jobs that share a remote (test_shared_remote.py).

Usage: ``python _job.py SPEC`` where SPEC is JSON: ``local``, ``remote``, ``storage_options``, ``steps`` (saved in
order, each a state whose values encode the step and ``tag``), ``tag``, ``restore`` (restore first), ``options``
(manager keywords). Prints one JSON line: what restore returned, what close() raised (class and message), the
local and remote run identities.
"""

from __future__ import annotations

import json
import sys

import torch

from tierckpt import CheckpointManager


def state(step: int, tag: float) -> dict:
    return {"w": torch.full((4096,), float(step) + tag), "step": step}


def main() -> None:
    spec = json.loads(sys.argv[1])
    out: dict = {"restored": None, "error": None}
    mgr = CheckpointManager(spec["local"], remote=spec["remote"], storage_options=spec.get("storage_options"),
                            **spec.get("options", {}))
    try:
        if spec.get("restore"):
            s = state(-1, 0.0)
            out["restored"] = mgr.restore(s)
            out["restored_w"] = float(s["w"][0])
        for step in spec["steps"]:
            mgr.save(step, state(step, spec["tag"]))
    finally:
        try:
            mgr.close()
        except Exception as exc:
            out["error"] = [type(exc).__name__, str(exc)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
