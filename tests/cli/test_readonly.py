"""The operators' CLI (`python -m tierckpt`): ls, verify exit codes 0/1/2 and --json, inspect."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests._support.helpers import cli_output, data_files, flip_byte, run_cli_parallel, step_path
from tierckpt import CheckpointManager

pytestmark = pytest.mark.timeout(240)

LEFTOVER = ".tmp-step-0000000050-deadbeef"


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    base = tmp_path_factory.mktemp("cli")
    good = base / "good"
    with CheckpointManager(good, keep_local=5) as mgr:
        mgr.save(
            17,
            {"weights": torch.ones(3, 5, dtype=torch.float16), "step": 17},
            metadata={"note": "hello-meta"},
        )
        mgr.save(
            42,
            {
                "weights": torch.zeros(3, 5, dtype=torch.float16),
                "emb": torch.arange(12).reshape(4, 3),
                "step": 42,
            },
            metadata={"note": "answer-meta", "lr": 0.5},
        )
        mgr.wait()
    # a crash leftover next to the committed steps (a save that never got its manifest)
    (good / LEFTOVER).mkdir()
    (good / LEFTOVER / "r00000-p0000-deadbeef.safetensors").write_bytes(b"\x00" * 100)

    bad = base / "bad"
    with CheckpointManager(bad, keep_local=5) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.ones(1000)})
        mgr.wait()
    bad_file = data_files(step_path(bad, 2))[0]
    flip_byte(bad_file, offset_from_end=10)

    empty = base / "empty"
    empty.mkdir()
    missing = base / "missing"

    calls: dict[str, tuple[Path, tuple]] = {
        "ls": (good, ("ls", good)),
        "verify_good": (good, ("verify", good)),
        "verify_step_absent": (good, ("verify", good, "--step", "43")),
        "verify_folder": (good, ("verify", step_path(good, 17))),
        "verify_bad_json": (bad_file, ("verify", bad, "--json")),
        "verify_missing": (missing, ("verify", missing)),
        "verify_empty": (empty, ("verify", empty)),
        "verify_bad_usage": (good, ("verify", good, "--no-such-flag")),
        "inspect": (good, ("inspect", good, "--step", "42")),
    }
    procs = run_cli_parallel([args for _, args in calls.values()])
    return {name: (path, proc) for (name, (path, _)), proc in zip(calls.items(), procs, strict=True)}


def _get(cli, name: str) -> tuple[Path, subprocess.CompletedProcess[str], str]:
    path, proc = cli[name]
    return path, proc, cli_output(proc)


def test_ls_lists_steps_and_marks_leftovers(cli) -> None:
    _, proc, out = _get(cli, "ls")
    assert proc.returncode == 0, out
    lines = out.splitlines()
    for step in (17, 42):
        assert any(re.search(rf"(?<!\d)0*{step}(?!\d)", ln) for ln in lines), (
            f"step {step} not listed:\n{out}"
        )
    leftover_lines = [ln for ln in lines if "50" in ln or LEFTOVER in ln]
    assert leftover_lines, f"leftover not listed:\n{out}"
    assert any(re.search(r"incomplete|leftover|partial|tmp", ln, re.I) for ln in leftover_lines), out


def test_verify_intact_root_exit_0_reports_leftover(cli) -> None:
    _, proc, out = _get(cli, "verify_good")
    assert proc.returncode == 0, out
    assert "17" in out and "42" in out, out
    assert LEFTOVER in out or re.search(r"incomplete|leftover", out, re.I), f"leftover not reported:\n{out}"


def test_verify_json_on_corruption_exit_1_names_file(cli) -> None:
    bad_file, proc, out = _get(cli, "verify_bad_json")
    assert proc.returncode == 1, out
    doc = json.loads(proc.stdout)
    assert bad_file.name in json.dumps(doc), f"{bad_file.name} not in {doc}"


def test_verify_one_step(cli) -> None:
    _, proc, out = _get(cli, "verify_folder")
    assert proc.returncode == 0, out
    assert "17" in out, out


def test_verify_absent_step_exit_2(cli) -> None:
    _, proc, out = _get(cli, "verify_step_absent")
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{out}"


@pytest.mark.parametrize("name", ["verify_missing", "verify_empty", "verify_bad_usage"])
def test_verify_usage_errors_exit_2(cli, name: str) -> None:
    _, proc, out = _get(cli, name)
    assert proc.returncode == 2, f"{name}: exit {proc.returncode}:\n{out}"
    assert "Traceback" not in out, out


def test_inspect_prints_tensors_and_metadata(cli) -> None:
    _, proc, out = _get(cli, "inspect")
    assert proc.returncode == 0, out
    assert "weights" in out and "emb" in out, out
    assert re.search(r"float16|F16|half", out), f"dtype of weights not printed:\n{out}"
    assert re.search(r"int64|I64|long", out), f"dtype of emb not printed:\n{out}"
    assert re.search(r"3\s*[,x×]\s*5", out), f"shape (3, 5) not printed:\n{out}"
    assert re.search(r"4\s*[,x×]\s*3", out), f"shape (4, 3) not printed:\n{out}"
    assert re.search(r"(?<!\d)30(?!\d)", out) and re.search(r"(?<!\d)96(?!\d)", out), (
        f"bytes not printed:\n{out}"
    )
    assert "answer-meta" in out, f"metadata not printed:\n{out}"
    assert "hello-meta" not in out, "inspect --step 42 printed step 17's metadata"
