"""The CUDA path: pinned staging buffers, a copy stream ordered after the training stream. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierckpt import CheckpointManager

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()


def test_staging_is_pinned(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(1 << 20, device="cuda")})
        mgr.wait()
        slot = mgr.components.staging.slots[0]
        assert slot.buffer is not None and slot.buffer.is_pinned()


def test_cuda_state_round_trips_and_mutation_after_save_is_not_captured(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expected_m = {i: s["exp_avg"].cpu().clone() for i, s in enumerate(opt.state.values())}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": model, "opt": opt})
        # the optimizer step right after save() returns must not leak into the checkpoint
        model(torch.randn(32, 256, device="cuda")).square().mean().backward()
        opt.step()
        mgr.wait()
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore({"model": fresh, "opt": fresh_opt}) == 3
    for k, v in fresh.state_dict().items():
        assert v.is_cuda
        assert torch.equal(v.cpu(), expected[k]), k
    for i, s in enumerate(fresh_opt.state.values()):
        assert torch.equal(s["exp_avg"].cpu(), expected_m[i])


def test_copy_stream_waits_for_queued_kernels(tmp_path: Path) -> None:
    """Work queued on the training stream before save() must be in the snapshot (the copy stream waits for it)."""
    x = torch.zeros(64 << 20, device="cuda")  # 256 MiB
    for _ in range(20):
        x.add_(1.0)  # queued asynchronously on the current stream
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": x})
        x.add_(100.0)  # after save() returned: not in the checkpoint
        mgr.wait()
    out = {"x": torch.empty(64 << 20, device="cuda")}
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(out)
    assert torch.equal(out["x"], torch.full_like(out["x"], 20.0))
