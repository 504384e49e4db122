"""Shared helpers of the tests: bit-exact comparisons, on-disk layout lookups, the real CLI, a child's environment."""

from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the repo importable, no stray threads fighting over 2 cores."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str | os.PathLike, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tierckpt ARGS`` in a child process and capture its output (not on a terminal: no progress
    bar). The child is forked from a server that imported torch (:mod:`tests._support.procs`)."""
    from tests._support.procs import run_python

    return run_python(["-m", "tierckpt", *[str(a) for a in args]], env=subprocess_env(), cwd=REPO_ROOT,
                      timeout=timeout)


def run_cli_parallel(
    calls: list[tuple[str | os.PathLike, ...]], timeout: float = 180, workers: int = 2
) -> list[subprocess.CompletedProcess[str]]:
    """Run several independent CLI calls, ``workers`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda args: run_cli(*args, timeout=timeout), calls))


def cli_output(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout or "") + (proc.stderr or "")


# ----------------------------------------------------------------------------------------------------------- layout


def save_once(root: Path, state: dict[str, Any], step: int) -> Path:
    """One durable save of ``state`` as ``step`` in ``root`` (small files, two writers: several data files), by a
    manager that is closed again; returns ``root``."""
    import tierckpt

    with tierckpt.CheckpointManager(root, file_size_mb=1, writer_threads=2) as mgr:
        mgr.save(step, state)
        mgr.wait()
    return root


def direct_io_supported(folder: Path) -> bool:
    """Whether the file system under ``folder`` accepts ``O_DIRECT`` (tests that check a direct path assert it only
    there)."""
    from tierckpt.storage.local import open_direct

    try:
        fd, direct = open_direct(str(folder / ".probe"), os.O_WRONLY | os.O_CREAT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / ".probe")
    return direct


def cached_fraction(path: Path, length: int | None = None) -> float:
    """The share of the pages of ``path``'s first ``length`` bytes (default: all) that are in the page cache, from
    ``mincore``; skips the test where that cannot be told."""
    import pytest

    from tierckpt.storage.local import cached_share

    fd = os.open(path, os.O_RDONLY)
    try:
        share = cached_share(fd, 0, length if length is not None else os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if share is None:
        pytest.skip("mincore cannot tell what is cached here")
    return share


def evict_data_files(step_folder: Path) -> list[Path]:
    """Empty the page cache of a step's data files (``fsync`` + ``posix_fadvise(DONTNEED)``), so that a restore
    reads them cold (around the cache, on a disk that accepts ``O_DIRECT``); skips the test where the cache does
    not empty. Returns the files."""
    import pytest

    from tierckpt.storage.local import cached_share

    files = data_files(step_folder)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            share = cached_share(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if share is None or share > 0:
            pytest.skip("cannot empty the page cache of a file here")
    return files


def step_path(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"


def data_files(step_folder: Path) -> list[Path]:
    files = sorted(Path(step_folder).glob("*.safetensors"))
    assert files, f"no data files in {step_folder}: {sorted(p.name for p in Path(step_folder).iterdir())}"
    return files


def rank_manifests(step_folder: Path) -> list[Path]:
    files = sorted(Path(step_folder).glob("r*.manifest.json"))
    assert files, f"no rank manifest in {step_folder}: {sorted(p.name for p in Path(step_folder).iterdir())}"
    return files


def step_manifest(step_folder: Path) -> Path:
    p = Path(step_folder) / "manifest.json"
    assert p.is_file(), f"no manifest.json in {step_folder}"
    return p


def flip_byte(path: Path, offset_from_end: int = 1) -> None:
    """Flip every bit of one byte near the end of the file (inside the tensor data, not the header)."""
    raw = bytearray(path.read_bytes())
    i = len(raw) - offset_from_end
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def truncate_half(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


_CREATED_RE = re.compile(rb'"created"\s*:\s*(-?[0-9][0-9.eE+-]*)')


def edit_manifest_value(path: Path) -> None:
    """Change one value of a JSON manifest (the ``created`` time, one digit) and keep it valid, same-format JSON.

    The manifest's own checksum is left as it was, so only checksum verification can notice the edit.
    """
    raw = path.read_bytes()
    m = _CREATED_RE.search(raw)
    assert m is not None, f"no numeric 'created' field in {path.name}: {raw[:300]!r}"
    num = bytearray(m.group(1))
    # change the first digit of the integer part, which can't be a no-op and keeps the number valid
    for i, c in enumerate(num):
        if chr(c).isdigit():
            num[i] = ord(str((int(chr(c)) % 9) + 1)) if chr(c) != "9" else ord("1")
            break
    assert bytes(num) != m.group(1)
    new = raw[: m.start(1)] + bytes(num) + raw[m.end(1) :]
    path.write_bytes(new)
    import json

    json.loads(new)  # still valid JSON


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith(".tmp-"))


# ------------------------------------------------------------------------------------------------------ comparisons


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def assert_tensor_equal(got: Any, want: torch.Tensor, where: str = "") -> None:
    """Bit-exact: same type, dtype, shape and bytes (so NaN payloads and -0.0 count)."""
    assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert tensor_bytes(got) == tensor_bytes(want), f"{where}: bytes differ"
    if not (want.is_floating_point() and torch.isnan(want).any()):
        assert torch.equal(got, want), where


def assert_array_equal(got: Any, want: np.ndarray, where: str = "") -> None:
    assert isinstance(got, np.ndarray), f"{where}: expected ndarray, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), (
        f"{where}: bytes differ"
    )


def assert_tree_equal(got: Any, want: Any, where: str = "state") -> None:
    """Deep, exact comparison: container types (tuple stays tuple), key types, float bits, tensor bytes."""
    if isinstance(want, torch.Tensor):
        assert_tensor_equal(got, want, where)
    elif isinstance(want, np.ndarray):
        assert_array_equal(got, want, where)
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected dict, got {type(got).__name__}"
        assert list(got.keys()) == list(want.keys()) or set(got.keys()) == set(want.keys()), (
            f"{where}: keys {list(got.keys())!r} != {list(want.keys())!r}"
        )
        for k in want:
            match = [gk for gk in got if gk == k and type(gk) is type(k)]
            assert match, (
                f"{where}: key {k!r} ({type(k).__name__}) missing or changed type; got {list(got)!r}"
            )
            assert_tree_equal(got[match[0]], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{where}: expected {type(want).__name__}, got {type(got).__name__}"
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_tree_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert type(got) is float, f"{where}: expected float, got {type(got).__name__} {got!r}"
        if math.isnan(want):
            assert math.isnan(got), f"{where}: {got!r} != nan"
        else:
            assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), (
                f"{where}: {got!r} != {want!r}"
            )
    else:
        assert type(got) is type(want), (
            f"{where}: expected {type(want).__name__}, got {type(got).__name__} {got!r}"
        )
        assert got == want, f"{where}: {got!r} != {want!r}"


def module_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def clone_tree(obj: Any) -> Any:
    """Deep copy of a plain tree with tensors/arrays cloned (what the values were at one instant)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def zeros_like_tree(obj: Any) -> Any:
    """A tree of dicts shaped like ``obj`` with every tensor replaced by a fresh zero tensor (contiguous, same
    dtype and shape) and every other value kept: a target for a restore to fill."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros(obj.shape, dtype=obj.dtype)
    if isinstance(obj, dict):
        return {k: zeros_like_tree(v) for k, v in obj.items()}
    return obj


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
                input_shape: tuple[int, ...], sched: Any = None) -> None:
    """``steps`` deterministic optimizer steps on random inputs of ``input_shape`` (then ``sched.step()`` if given)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(*input_shape, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def small_mlp_after_one_step(g: torch.Generator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A 6-5-3 MLP and its AdamW after one step on random inputs from ``g`` (so the optimizer has its moments)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6, generator=g)).sum().backward()
    opt.step()
    return model, opt


# ------------------------------------------------------------------------------------------- SIGKILL test states


def kill_state(step: int, seed: int, big: bool) -> dict[str, Any]:
    """Deterministic state for the SIGKILL tests (rebuilt identically in the child and the parent)."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = (4 << 20) if big else 4096  # 16 MiB of float32, or 16 KiB
    return {
        "w": torch.randn(n, generator=g),
        "h": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (1000,), generator=g),
        "meta": {"step": step, "seed": seed, "big": big},
    }


def empty_like_kill_state(big: bool) -> dict[str, Any]:
    n = (4 << 20) if big else 4096
    return {
        "w": torch.zeros(n),
        "h": torch.zeros(64, 33, dtype=torch.bfloat16),
        "ids": torch.zeros(1000, dtype=torch.int64),
        "meta": {"step": -1, "seed": -1, "big": not big},
    }
