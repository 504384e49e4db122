"""Saves steps 1 and 2 through ``dcp.save`` with tierckpt's writer; run with ``TIERCKPT_FAULT=<point>:2`` it is
SIGKILLed in the middle of step 2's commit (tests/integrations/test_dcp.py).

    python tests/integrations/_dcp_kill.py ROOT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp

import tierckpt
import tierckpt.dcp as tdcp


def state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "b": torch.arange(10) + step}


if __name__ == "__main__":
    mgr = tierckpt.CheckpointManager(sys.argv[1], keep_local=5)
    for s in (1, 2):
        dcp.save(state(s), storage_writer=tdcp.StorageWriter(mgr, s))
    mgr.close()
