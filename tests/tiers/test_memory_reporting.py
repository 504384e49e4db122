"""What a load or restore served from the memory tier reports: ``LoadResult.tier`` and the log lines say
``memory``, and ``local`` again once the memory copy fails verification and the disk serves the step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests._support.helpers import empty_like_kill_state, kill_state
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(60)


def test_a_load_and_a_restore_from_memory_say_memory(tmp_path: Path, shm: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tierckpt")
    with CheckpointManager(tmp_path / "ckpt", memory_tier=True) as mgr:
        mgr.save(1, kill_state(1, 7, False))
        mgr.wait()
        out = mgr.load()
        assert (out.step, out.tier) == (1, "memory")
        assert torch.equal(out.state["w"], kill_state(1, 7, False)["w"])
        assert "load: step 1 from tier memory" in caplog.text
        assert "load: step 1 from tier local" not in caplog.text
        state = empty_like_kill_state(False)
        assert mgr.restore(state) == 1
        assert "restore: step 1 from tier memory" in caplog.text
        assert "restore: step 1 from tier local" not in caplog.text
        tier = mgr.components.staging.memory
        assert tier is not None and tier.restored == [1, 1]

        (copy,) = tier.copies().values()  # one bit of the copy's last data byte: the disk serves the step
        last = copy.files[-1]
        with open(copy.path, "r+b") as f:
            f.seek(last.offset + last.size - 1)
            b = f.read(1)[0]
            f.seek(last.offset + last.size - 1)
            f.write(bytes([b ^ 1]))
        caplog.clear()
        out = mgr.load()
        assert (out.step, out.tier) == (1, "local")
        assert torch.equal(out.state["w"], kill_state(1, 7, False)["w"])
        assert "load: step 1 in tier memory" in caplog.text and "is corrupt" in caplog.text
        assert "load: step 1 from tier local" in caplog.text
