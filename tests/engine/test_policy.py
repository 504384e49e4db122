"""Interval policies, preemption signals and slow-save warnings."""

from __future__ import annotations

import logging
import os
import signal
import textwrap
from pathlib import Path

import pytest
import torch

from tests._support.procs import start_python
from tierckpt import CheckpointManager
from tierckpt.policy import SLOW_SAVE_MIN_S, SLOW_SAVE_WARN_INTERVAL_S, SavePolicy, SlowSaveMonitor


def test_should_save_every_n_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_every_steps=3) as mgr:
        due = [s for s in range(1, 10) if mgr.should_save(s)]
        assert due == [3, 6, 9]
        assert not mgr.preempted


def test_should_save_every_t_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierckpt.policy as policy

    now = [1000.0]
    monkeypatch.setattr(policy.time, "monotonic", lambda: now[0])
    with CheckpointManager(tmp_path, save_every_seconds=60) as mgr:
        assert not mgr.should_save(1)
        now[0] += 61
        assert mgr.should_save(2)
        mgr.save(2, {"t": torch.ones(3)})
        assert not mgr.should_save(3)  # the clock restarts at each save


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3"])
def test_policy_validation(bad: object) -> None:
    with pytest.raises(ValueError, match="save_every_steps"):
        SavePolicy(every_steps=bad)  # type: ignore[arg-type]


def test_slow_save_warning(caplog: pytest.LogCaptureFixture) -> None:
    mon = SlowSaveMonitor(factor=1.5)
    with caplog.at_level(logging.WARNING):
        assert not any(mon.observe(s, 1.0, 10**9, "local") for s in range(5))
        assert mon.observe(6, 2.0, 10**9, "local")
    assert "step 6" in caplog.text and "running median" in caplog.text


def _slow_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tierckpt.policy" and r.levelno == logging.WARNING]


def test_tiny_fast_saves_never_warn_however_they_vary(caplog: pytest.LogCaptureFixture) -> None:
    """Saves of a few milliseconds jitter by several times their median: no warning, for none of them."""
    mon = SlowSaveMonitor()
    times = [0.004, 0.003, 0.005, 0.004, 0.011, 0.004, 0.002, 0.04, 0.004, 0.3, 0.004, 0.9]
    with caplog.at_level(logging.WARNING, logger="tierckpt.policy"):
        assert not any(mon.observe(10 * (i + 1), s, 4096, "local") for i, s in enumerate(times))
    assert _slow_warnings(caplog) == []


def test_a_slow_save_warns_once_a_minute_then_counts_the_others(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    mon = SlowSaveMonitor(clock=lambda: now[0])
    assert mon.min_seconds == SLOW_SAVE_MIN_S == 1.0 and mon.interval_s == SLOW_SAVE_WARN_INTERVAL_S == 60.0
    with caplog.at_level(logging.WARNING, logger="tierckpt.policy"):
        for step in range(1, 6):
            assert not mon.observe(step, 1.0, 10**9, "local")
            now[0] += 5
        assert mon.observe(6, 4.0, 10**9, "local")  # 4x the median, and seconds long: it matters
        for step in (7, 8, 9):  # slow again within the minute: counted, not logged
            now[0] += 10
            assert mon.observe(step, 4.0, 10**9, "local")
        assert len(_slow_warnings(caplog)) == 1
        now[0] += 40  # a minute after the warning
        assert mon.observe(10, 5.0, 10**9, "local")
    warnings = _slow_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "step 6 took 4.000 s to become durable" in warnings[0] and "running median 1.000 s" in warnings[0]
    assert "step 10" in warnings[1] and "3 more slow saves since the last warning" in warnings[1], warnings[1]


@pytest.mark.timeout(120)
def test_sigterm_takes_a_last_checkpoint(tmp_path: Path) -> None:
    """A training loop receives SIGTERM, saves at the next step boundary, and close() makes that save durable."""
    script = tmp_path / "train.py"
    ready = tmp_path / "ready"
    script.write_text(textwrap.dedent(f"""
        import time, torch, sys
        from tierckpt import CheckpointManager
        mgr = CheckpointManager({str(tmp_path / 'ck')!r}, save_every_steps=1000)
        mgr.install_signal_handlers()
        w = torch.zeros(1000)
        step = 0
        while True:
            step += 1
            w += 1
            if step == 5:
                open({str(ready)!r}, "w").close()
            if mgr.should_save(step):
                mgr.save(step, {{"w": w, "step": step}})
                if mgr.preempted:
                    break
            time.sleep(0.01)
        mgr.close()
        print("saved", step)
    """))
    proc = start_python([str(script)], folder=tmp_path)
    for _ in range(600):
        if ready.exists():
            break
        import time

        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    saved_step = int(out.split()[-1])
    state = {"w": torch.empty(1000), "step": 0}
    with CheckpointManager(tmp_path / "ck") as mgr:
        assert mgr.restore(state) == saved_step
    assert state["step"] == saved_step
    assert torch.equal(state["w"], torch.full((1000,), float(saved_step)))
