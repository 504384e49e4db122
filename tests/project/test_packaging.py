"""What a release ships: one real build of the sdist from the files git would commit, and of the wheel from that
sdist (so the sdist is proven to hold what a build needs). The sdist carries the LICENSE and the C source of the
optional native host copy; the wheel carries the LICENSE in its metadata and the compiled module, never its C
source.

Both are built by ``pip wheel`` and setuptools' own PEP 517 backend (what ``python -m build --sdist`` runs), without
build isolation where this environment's setuptools is as new as ``[build-system] requires`` asks (then the build
fetches nothing), else in an isolated environment that pip sets up.
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def _source_tree(dest: Path) -> Path:
    """A copy of the files git would commit (tracked, and new files not ignored): no build output of this
    checkout (its egg-info, the compiled module) can leak into the build."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():  # a file deleted in the work tree but still in the index is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _setuptools_will_do() -> bool:
    """Whether this environment's setuptools is as new as ``[build-system] requires`` asks."""
    section = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[build-system]", 1)[1].split("\n[", 1)[0]
    needed = re.search(r'"setuptools\s*>=\s*(\d+)', section)
    assert needed is not None, section
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return int(have.split(".")[0]) >= int(needed.group(1))


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("packaging")
    tree = _source_tree(base / "src")
    out = base / "dist"
    out.mkdir()
    if _setuptools_will_do():
        build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
        proc = subprocess.run([sys.executable, "-c", build, str(out)], cwd=tree, capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        sdist = out / proc.stdout.strip().splitlines()[-1]
        isolation = ["--no-build-isolation"]
    else:  # pip's isolated environment builds both (the sdist with `build`, which sets up the same)
        pytest.importorskip("build", reason="an sdist needs setuptools>=77 here, or the `build` package")
        proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(tree)],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        (sdist,) = out.glob("tierckpt-*.tar.gz")
        isolation = []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--no-cache-dir",
                           "--disable-pip-version-check", "-w", str(base / "wheel"), str(sdist)],
                          cwd=base, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (base / "wheel").glob("tierckpt-*.whl")
    return sdist, wheel


def test_the_license_is_the_apache_2_0_text() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for section in ("1. Definitions.", "2. Grant of Copyright License.", "3. Grant of Patent License.",
                    "4. Redistribution.", "5. Submission of Contributions.", "6. Trademarks.",
                    "7. Disclaimer of Warranty.", "8. Limitation of Liability.",
                    "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert section in text, section
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'license = "Apache-2.0"' in pyproject


def test_the_sdist_holds_the_license_and_the_c_source(dists: tuple[Path, Path]) -> None:
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = Parser().parsestr(pkg_info.read().decode())
    for needed in ("LICENSE", "pyproject.toml", "setup.py", "tierckpt/host/_hostcopy.c", "tierckpt/py.typed",
                   "tierckpt/cli/__init__.py"):
        assert needed in names, needed
    assert not [n for n in names if n.endswith((".so", ".pyd", ".pyc"))], names  # no build output of a checkout
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]


def test_the_wheel_ships_the_license_and_the_module_but_not_the_c_source(dists: tuple[Path, Path]) -> None:
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(metadata).decode())
        dist_info = metadata.rsplit("/", 1)[0]
        assert f"{dist_info}/licenses/LICENSE" in names, sorted(names)
        assert zf.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert not [n for n in names if n.endswith((".c", ".h"))], sorted(names)
    assert "tierckpt/py.typed" in names and "tierckpt/cli/__main__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "docs/", "benchmarks/"))]
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    # the native copy is optional (a build without a C compiler still succeeds); with one it is in the wheel
    if sysconfig.get_config_var("CC") and shutil.which(str(sysconfig.get_config_var("CC")).split()[0]):
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        assert f"tierckpt/host/_hostcopy{suffix}" in names, sorted(names)
