"""The files ``tierckpt export`` writes into its output folder: temporaries created exclusively under random names
(a link planted at any name is never followed, whatever it points at), final names given by rename only, and
modes that follow the umask (0600 under 077, 0644 under 022). Real files and links, the real CLI in-process."""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests._support.helpers import subprocess_env
from tests._support.procs import run_python
from tierckpt import CheckpointManager
from tierckpt.cli import main
from tierckpt.export import INDEX_FILE, SINGLE_FILE, export_weights

pytestmark = pytest.mark.timeout(120)

VICTIM_TEXT = "precious data outside the export folder\n"


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"wte": torch.randn(64, 16, generator=g), "ln.weight": torch.randn(16, generator=g),
            "head.weight": torch.randn(16, 64, generator=g)}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(5, {"model": _model(), "step": 5})
    return root


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def _check_export(out: Path) -> None:
    want = _model()
    names = sorted(p.name for p in out.iterdir())
    files = [out / SINGLE_FILE] if SINGLE_FILE in names else sorted(out.glob("model-*-of-*.safetensors"))
    got = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            got.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118 - safe_open has no __iter__
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not [n for n in names if n.endswith(".tmp") or ".tmp-" in n], f"temporaries left behind: {names}"


@pytest.mark.parametrize("shards", [False, True])
def test_links_planted_at_the_old_temporary_names_are_not_followed(ckpt: Path, tmp_path: Path, victim: Path,
                                                                    shards: bool) -> None:
    """The names a temporary once had (``<file>.tmp-<pid>``) hold links to a file outside: nothing writes there."""
    out = tmp_path / "out"
    out.mkdir()
    finals = [SINGLE_FILE] if not shards else [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [INDEX_FILE]
    for name in finals:
        (out / f"{name}.tmp-{os.getpid()}").symlink_to(victim)
    export_weights(ckpt, out, max_shard_bytes=4100 if shards else "5GB")
    assert victim.read_text() == VICTIM_TEXT
    for name in finals:
        assert (out / f"{name}.tmp-{os.getpid()}").is_symlink()
        os.unlink(out / f"{name}.tmp-{os.getpid()}")
    _check_export(out)


def test_a_link_at_a_final_name_is_replaced_not_followed(ckpt: Path, tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / SINGLE_FILE).symlink_to(victim)
    assert main(["export", str(ckpt), str(out)]) == 2  # an export seems to be there: refused without --overwrite
    assert main(["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert victim.read_text() == VICTIM_TEXT
    assert not (out / SINGLE_FILE).is_symlink()
    _check_export(out)


def test_no_temporary_is_left_when_a_write_fails(ckpt: Path, tmp_path: Path) -> None:
    """A file size limit (``RLIMIT_FSIZE``) makes the first data file's write fail half-way (EFBIG), in a child."""
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import errno, resource, signal, sys
        from tierckpt.export import export_weights
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            export_weights({str(ckpt)!r}, {str(out)!r})
        except OSError as exc:
            sys.exit(0 if exc.errno == errno.EFBIG else 1)
        sys.exit(2)
    """)
    proc = run_python(["-c", code], env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("umask", [0o077, 0o022])
@pytest.mark.parametrize("shards", [False, True])
def test_export_modes_follow_the_umask(ckpt: Path, tmp_path: Path, umask: int, shards: bool) -> None:
    out = tmp_path / "new" / "out"
    old = os.umask(umask)
    try:
        result = export_weights(ckpt, out, max_shard_bytes=4100 if shards else "5GB")
    finally:
        os.umask(old)
    assert len(result.files) == (4 if shards else 1)
    for path in result.files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask & 0o644, f"{path} under umask {umask:03o}"
    for folder in (out, out.parent):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask
    _check_export(out)
