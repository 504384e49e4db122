"""The golden checkpoints: one small state saved by each format version this code reads, in the local layout and
as a zstd-compressed remote copy, committed under ``tests/format/golden/v<N>/``; ``tests/format/test_golden.py``
loads and verifies every one, so a format change can never silently stop old checkpoints from loading.

To add the copies of a new format version, run this file with the tierckpt that writes it importable:

    PYTHONPATH=<that checkout> .venv/bin/python tests/format/golden/make_golden.py tests/format/golden/v<N>

(version 1 was written by commit 1461f09's parent; version 2 by the code that introduced it; version 3, an
incremental step ``STEP`` that references step ``STEP - 1``, by the code that introduced references). The state must not
change: the test compares what each copy holds with :func:`golden_state`.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import numpy as np
import torch

STEP = 7
METADATA = {"note": "golden"}


def golden_state() -> dict[str, Any]:
    """The saved state: a module, tensors of several dtypes (bfloat16, int64, bool, a 0-dim one), a numpy array and
    plain values, from a fixed generator."""
    g = torch.Generator().manual_seed(20261204)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3, 4, generator=g))
        lin.bias.copy_(torch.randn(3, generator=g))
    return {
        "model": lin,
        "extra": {"bf16": torch.randn(5, generator=g).to(torch.bfloat16), "i64": torch.arange(6).reshape(2, 3),
                  "flags": torch.tensor([True, False, True]), "scalar": torch.tensor(3.5)},
        "arr": np.arange(4, dtype=np.int32),
        "step": STEP, "lr": 0.001, "name": "golden", "betas": (0.9, 0.95), "none": None,
    }


def main(out: str) -> None:
    import tierckpt

    shutil.rmtree(out, ignore_errors=True)
    incremental = os.path.basename(os.path.normpath(out)) >= "v3"  # version 3: references to an earlier step
    mgr = tierckpt.CheckpointManager(os.path.join(out, "local"), remote=os.path.join(out, "remote"),
                                     remote_compression="zstd", log_records=False,
                                     **({"incremental": True} if incremental else {}))
    if incremental:  # step STEP - 1 differs in one tensor: step STEP writes that one and references the rest
        earlier = golden_state()
        earlier["extra"]["i64"] = torch.zeros(2, 3, dtype=torch.int64)
        mgr.save(STEP - 1, earlier, metadata=METADATA)
        mgr.wait()
    mgr.save(STEP, golden_state(), metadata=METADATA)
    mgr.close()
    for name in os.listdir(os.path.join(out, "local")):
        if name.startswith(".lock"):
            os.remove(os.path.join(out, "local", name))


if __name__ == "__main__":
    main(sys.argv[1])
