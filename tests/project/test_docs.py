"""The documentation site: ``mkdocs build --strict`` passes (no broken link or anchor, no docstring the API reference
cannot read, no superseded or unread results file), the performance tables come from the newest results, and the
tuning page states every option of the manager with its default from ``tierckpt.options``.

The site's packages are in the ``test`` extra: these tests fail, never skip, where they are missing.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    return out


def _text(page: Path) -> str:
    return re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    for page in ("index.html", "tuning/index.html", "operations/index.html", "distributed/index.html",
                 "api/tierckpt/index.html", "changelog/index.html"):
        assert (site / page).is_file(), page
    api = _text(site / "api" / "tierckpt" / "index.html")
    assert "tierckpt.CheckpointManager" in api and "keep_local" in api
    assert "Changelog" in _text(site / "changelog" / "index.html")
    assert (site / "examples" / "slurm.sbatch").is_file()  # the pages' links to the examples resolve on the site


def test_the_performance_page_is_generated_from_the_newest_results(site: Path) -> None:
    results = _hook("results")
    found, problems = results.collect(DOCS / "results")
    assert problems == []
    page = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "results:summary" not in page and "results:details" not in page
    plain = html.unescape(re.sub(r"<[^>]+>", "", page))
    for f in found:
        for name, _ in f.run:
            assert f"results/{name}" in page, name
            assert (site / "results" / name).is_file(), name
        for command in f.bench.commands:
            assert command in plain, command


def _write(folder: Path, name: str, doc: dict) -> None:
    (folder / name).write_text(json.dumps(doc))


def test_the_results_hook_flags_superseded_unread_and_mismatched_files(tmp_path: Path) -> None:
    results = _hook("results")
    for path in (DOCS / "results").glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    restart = json.loads((DOCS / "results" / "cpu_2026-12-03a_restart.json").read_text())
    _write(tmp_path, "cpu_2026-12-05a_restart.json", restart)  # a newer run: the committed one is superseded
    _write(tmp_path, "cpu_2026-12-05a_mystery.json", {})
    wrong = json.loads((DOCS / "results" / "cpu_2026-12-04_dcp.json").read_text())
    _write(tmp_path, "cpu_2026-12-05_dcp.json", {**wrong, "size_mib": 64})
    (tmp_path / "cpu_2026-12-04_dcp.json").unlink()
    found, problems = results.collect(tmp_path)
    text = "\n".join(problems)
    assert "cpu_2026-12-03a_restart.json is superseded by the newer run 2026-12-05a" in text, text
    assert "cpu_2026-12-05a_mystery.json is read by no benchmark" in text, text
    assert "cpu_2026-12-05_dcp.json: the command of 'dcp' disagrees" in text and "--size-mib 256" in text, text
    assert len(problems) == 3, text
    assert {f.bench.key: f.tag for f in found}["restart"] == "2026-12-05a"


def test_the_tuning_page_states_every_keyword_with_its_default() -> None:
    from tierckpt.manager import CheckpointManager
    from tierckpt.options import Options

    text = (DOCS / "tuning.md").read_text(encoding="utf-8")
    stated = dict(re.findall(r"^### `(\w+)`\n\n\*\*Default:\*\* `([^`]+)`", text, flags=re.M))
    defaults = {f.name: f.default for f in dataclasses.fields(Options)}
    keywords = [p for p in inspect.signature(CheckpointManager).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert {p.name for p in keywords} - set(stated) == set(), "keywords without a section on the tuning page"
    assert set(stated) - {p.name for p in keywords} == set(), "sections for keywords the manager does not take"
    for p in keywords:
        assert p.default == defaults.get(p.name, p.default), p.name  # the manager takes its defaults from Options
        assert stated[p.name] == repr(p.default), f"{p.name}: the page says {stated[p.name]}, the code {p.default!r}"


def test_the_api_reference_reads_the_code_base_docstring_conventions() -> None:
    ext = _hook("griffe_docstrings")
    text = ("Args:\n    a / b: shared text\n        more of it.\n    c: own.\n    d / e /\n        f: wrapped names.\n"
            "Returns:\n    x / y: untouched.")
    assert ext.split_multi_names(text) == (
        "Args:\n    a: shared text\n        more of it.\n    b: shared text\n        more of it.\n    c: own.\n"
        "    d: wrapped names.\n    e: wrapped names.\n    f: wrapped names.\nReturns:\n    x / y: untouched.")
    assert ext._ROLE.sub(ext._role, ":class:`~tierckpt.CheckpointManager` and :meth:`restore`") == \
        "`CheckpointManager` and `restore`"
