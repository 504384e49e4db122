"""Every script in examples/ runs, with small settings, as a user would run it: a fresh run and a resume, each in a
subprocess whose working folder is an empty temporary folder, writing only under the folder it is given.

``torchrun_train.py`` runs on 2 gloo ranks under ``python -m torch.distributed.run --standalone`` (a free port);
``slurm.sbatch`` needs Slurm and is only checked against the script's options. ``prometheus_example.py`` prints its
metrics (``--print``) rather than serve them on a port.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests._support.procs import run_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TESTED = {"demo_train.py", "hf_example.py", "lightning_example.py", "prometheus_example.py", "torchrun_train.py",
          "slurm.sbatch"}


def _run(args: list[str], cwd: Path, timeout: float = 240, **env_vars: str) -> str:
    """Run ``python ARGS`` with a clean, quiet environment; fail with its output unless it exits 0. The process is
    forked from a server that has imported torch (:mod:`tests._support.procs`) and runs the script as a fresh
    interpreter would; the processes the example starts itself are fresh interpreters."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    env.pop("TIERCKPT_EXAMPLE_DIR", None)
    env.update(env_vars)
    proc = run_python(args, cwd=cwd, env=env, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"python {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    """An empty working folder: an example must write nothing here, only under the folder it is given."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    return folder


def _python(script: str, *args: str) -> list[str]:
    return [str(EXAMPLES / script), *args]


def test_every_example_has_a_test() -> None:
    assert {p.name for p in EXAMPLES.iterdir() if p.is_file()} == TESTED


def test_demo_train_crashes_resumes_and_matches_an_uninterrupted_run(tmp_path: Path, cwd: Path) -> None:
    run = tmp_path / "demo"
    out = _run(_python("demo_train.py", "--dir", str(run), "--steps", "12", "--every", "4", "--crash-at", "9"), cwd)
    assert "killed by SIGKILL" in out, out
    assert "[resumed] restored step 8" in out, out
    assert "losses bit-identical to the reference: True; final weights bit-identical: True" in out, out
    assert list(cwd.iterdir()) == []


def test_hf_example_crashes_resumes_and_matches_an_uninterrupted_run(tmp_path: Path, cwd: Path) -> None:
    run = tmp_path / "hf"  # given as the environment's default folder (the other examples take --dir)
    out = _run(_python("hf_example.py", "--steps", "6", "--every", "2", "--crash-at", "5"), cwd,
               TIERCKPT_EXAMPLE_DIR=str(run))
    assert f"== working folder: {run}" in out, out
    assert "(SIGKILL)" in out, out
    assert "[resumed] started from step 4" in out, out
    assert re.search(r"steps 5-6 after the resume: largest loss difference 0\b.*final weights identical", out), out
    assert list(cwd.iterdir()) == []  # nothing in the working folder (it used to leave hf_demo_run/ there)
    assert (run / "local_nvme").is_dir() and (run / "remote").is_dir()


def test_lightning_example_trains_then_resumes_from_last(tmp_path: Path, cwd: Path) -> None:
    run = tmp_path / "lightning"
    out = _run(_python("lightning_example.py", "--dir", str(run)), cwd)
    assert "trained to step 20" in out and "trained to step 40" in out, out
    assert "steps in the local tier: ['step-0000000035', 'step-0000000040']" in out, out
    assert list(cwd.iterdir()) == []


def test_prometheus_example_fresh_then_resumed(tmp_path: Path, cwd: Path) -> None:
    run = tmp_path / "metrics"
    args = _python("prometheus_example.py", "--print", "--dir", str(run), "--steps", "5")  # saves every 5 steps
    first = _run(args, cwd)
    assert "no checkpoint found" in first and 'tierckpt_last_committed_step{tier="remote"} 5.0' in first, first
    assert "tierckpt_saves_total 1.0" in first and "tierckpt_upload_failures_total 0.0" in first, first
    second = _run(args, cwd)
    assert "restored step 5" in second and 'tierckpt_last_committed_step{tier="remote"} 10.0' in second, second
    assert list(cwd.iterdir()) == []


def test_torchrun_train_on_two_ranks_fresh_then_resumed_with_tensor_parallelism(tmp_path: Path, cwd: Path) -> None:
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              str(EXAMPLES / "torchrun_train.py"), "--local-dir", str(tmp_path / "nvme"),
              "--remote-url", str(tmp_path / "pfs"), "--every", "5"]
    first = _run([*launch, "--steps", "10"], cwd)
    assert "world 2 (tp 1): starting at step 0" in first, first
    assert "done: [(5, 'local+remote'), (10, 'local+remote')]" in first, first
    # a restarted job, now with 2-way tensor parallelism under FSDP2: restores the FSDP step 10 into its 2-D
    # layout and trains on to 15
    second = _run([*launch, "--steps", "15", "--tp", "2"], cwd)
    assert "world 2 (tp 2): starting at step 10" in second, second
    assert "done: [(5, 'remote'), (10, 'local+remote'), (15, 'local+remote')]" in second, second  # keep_local=2
    assert list(cwd.iterdir()) == []


def test_slurm_sbatch_runs_torchrun_train_with_options_it_has() -> None:
    """slurm.sbatch cannot run here: its srun line must name the script and only options the script takes."""
    sbatch = (EXAMPLES / "slurm.sbatch").read_text()
    line = next(ln for ln in sbatch.splitlines() if ln.startswith("srun "))
    assert "examples/torchrun_train.py" in line
    used = set(re.findall(r"\s(--[a-z][a-z-]*)", line.split("torchrun_train.py", 1)[1]))
    script = (EXAMPLES / "torchrun_train.py").read_text()
    accepted = set(re.findall(r'add_argument\("(--[a-z-]+)"', script))
    assert used and used <= accepted, (used, accepted)
    assert "--signal=USR1@" in sbatch and "install_signal_handlers()" in script  # the signal the script handles
    assert "SLURM_PROCID" in script  # plain srun (no torchrun) sets the ranks from Slurm's variables
