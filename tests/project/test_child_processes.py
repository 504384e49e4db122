"""The suite's forked children (tests/_support/procs.py) behave as fresh interpreters would where the tests rely on
it: exit status, output streams, ``__main__``, ``sys.argv``, ``sys.path``, environment, working folder, stdin,
exit handlers, non-daemon threads, timeouts and SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests._support.procs import run_python, start_python

_PROBE = """
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("exit handler ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "path0": sys.path[0], "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_a_script_runs_as_main_with_its_argv_env_cwd_and_exit_status(tmp_path: Path, code: int) -> None:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    env = {**os.environ, "PROBE": "yes"}
    proc = run_python([str(script), "a b", str(code)], env=env, cwd=tmp_path, input="from stdin", timeout=60)
    assert proc.returncode == code, proc.stderr
    first, *rest = proc.stdout.splitlines()
    got = json.loads(first)
    assert got == {"name": "__main__", "argv": [str(script), "a b", str(code)], "cwd": str(tmp_path), "env": "yes",
                   "path0": str(tmp_path), "stdin": "from stdin"}
    assert rest == ["thread finished", "exit handler ran"]  # threads joined, then the exit handlers, as at exit
    assert proc.stderr == "to stderr\n"


def test_minus_c_and_minus_m_and_an_uncaught_exception(tmp_path: Path) -> None:
    proc = run_python(["-c", "import sys; print(sys.argv); raise ValueError('boom')", "x"], cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == "['-c', 'x']\n"
    assert "ValueError: boom" in proc.stderr
    proc = run_python(["-m", "tierckpt", "--version"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    proc = run_python(["-m", "tierckpt", "no-such-command"], cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_a_timeout_kills_the_child(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=2)
    assert time.monotonic() - t0 < 30


def test_sigkill_gives_minus_nine_and_the_child_is_its_own_process(tmp_path: Path) -> None:
    child = start_python(["-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                         folder=tmp_path)
    deadline = time.monotonic() + 30
    while not child.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(child.output()) == child.pid != os.getpid()
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
