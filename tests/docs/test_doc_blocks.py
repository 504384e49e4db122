"""Every ``python`` block of README.md and docs/*.md runs, in order, as written (Sybil parses and evaluates them).

The blocks of one page share one namespace, so a later block continues an earlier one, as a reader would run them.
A block that cannot run alone is given its setup by a ``<!-- invisible-code-block: python ... -->`` comment just
before it (Sybil runs it; the site does not show it). A block that cannot run here (torchrun, GPUs, Slurm, a fixed
port, a package the tests do not install) is marked ``<!-- skip: next "why" -->``, and the reason is required.

Each page runs in a fresh temporary folder (the blocks write only relative paths). A page whose blocks name an
``s3://`` URL gets the tests' S3 server (moto on loopback, ``s3_server``) with a bucket named ``bucket`` and
``AWS_ENDPOINT_URL`` pointing at it, as a user's environment would. What a page leaves running (managers, a process
group, signal handlers, Prometheus metrics) is closed or restored after it.
"""

from __future__ import annotations

import random
import re
import signal
import unittest
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

import tierckpt

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], patterns=["*.md"], path=str(ROOT))
BUCKET = "bucket"  # the name the pages use; each test process has its own S3 server


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _is_skip(example) -> bool:
    return isinstance(example.region.evaluator, Skipper)


def _is_setup(example) -> bool:
    """A ``<!-- invisible-code-block: python`` comment: setup the site does not show."""
    return example.document.text.startswith("<!--", example.start)


def _source(example) -> str:
    return "" if _is_skip(example) else str(example.parsed)


@pytest.fixture
def s3_endpoint(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The session's S3 server with an empty bucket ``bucket``, reached through ``AWS_ENDPOINT_URL``."""
    server = request.getfixturevalue("s3_server")
    admin = request.getfixturevalue("s3_admin")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    if admin.exists(BUCKET):
        admin.rm(BUCKET, recursive=True)
    admin.mkdir(BUCKET)
    try:
        yield server.endpoint_url
    finally:
        try:
            admin.rm(BUCKET, recursive=True)
        except Exception:
            pass


@pytest.fixture
def managers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Every CheckpointManager a page creates, closed after it (a page may leave one open for the next block)."""
    made: list = []
    init = tierckpt.CheckpointManager.__init__

    def tracked(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(tierckpt.CheckpointManager, "__init__", tracked)
    yield made
    for mgr in made:
        try:
            mgr.close(timeout=60)
        except Exception:
            pass


@pytest.fixture
def process_state() -> Iterator[None]:
    """Global state a page may change: RNGs, signal handlers, threads, the default process group, metrics."""
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    safe_globals = torch.serialization.get_safe_globals()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only contend with the other tests' processes
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(safe_globals)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])


@pytest.mark.parametrize("page", [p for p in PAGES if any(_source(e) for e in SYBIL.parse(p))], ids=_name)
def test_python_blocks_run_as_written(page: Path, request: pytest.FixtureRequest, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, process_state: None, managers: list) -> None:
    document = SYBIL.parse(page)
    examples = list(document)
    assert not _absolute_paths(SYBIL.parse(page)), "a block would write outside its temporary folder"
    if any("s3://" in _source(e) for e in examples):
        request.getfixturevalue("s3_endpoint")
    monkeypatch.syspath_prepend(str(ROOT))  # the hidden setup blocks import tests.docs.doc_setup
    monkeypatch.chdir(tmp_path)  # whatever a block writes goes here
    ran, not_run = 0, []
    try:
        for example in examples:
            try:
                example.evaluate()
            except unittest.SkipTest as skip:
                not_run.append(f"line {example.line}: {skip}")
                continue
            except BaseException as exc:
                exc.add_note(f"in the block at {_name(page)}, line {example.line}")
                raise
            if not _is_skip(example) and not _is_setup(example):
                ran += 1
    finally:
        from tierckpt.metrics import PrometheusMetrics

        for value in list(document.namespace.values()):
            if isinstance(value, PrometheusMetrics):
                value.unregister()
    print(f"{_name(page)}: {ran} blocks run; not run: {not_run or 'none'}")


_ABSOLUTE = re.compile(r"""(?<![\w:/])["']/(?!/)[^"'\n]*["']""")


def _absolute_paths(document) -> list[str]:
    """Quoted absolute paths in the blocks that run (blocks marked not run may show the real paths)."""
    found, next_only, in_range = [], False, False
    for example in document:
        if _is_skip(example):
            action = example.parsed[0]
            next_only, in_range = action == "next", action == "start" or (in_range and action != "end")
            continue
        if not (next_only or in_range):
            found += [f"line {example.line}: {p}" for p in _ABSOLUTE.findall(_source(example))]
        next_only = False
    return found


def test_blocks_write_only_under_the_working_folder() -> None:
    """The pages run in a temporary folder: a block that names an absolute path would write outside it."""
    for page in PAGES:
        assert not _absolute_paths(SYBIL.parse(page)), f"{_name(page)}: use relative paths"


def test_every_block_is_python_or_marked_not_run_with_a_reason() -> None:
    """A ``py``/``python3``/``pycon`` fence, or a ``python`` fence with attributes, would escape the parser above;
    a ``skip`` without a reason would skip silently."""
    fences = FencedCodeBlockLexer(language=r"[^\n]*")
    total, skipped = 0, []
    for page in PAGES:
        document = SYBIL.parse(page)
        for region in fences(document):
            language = region.lexemes["language"].strip()
            if language.lower().startswith(("py", "ipython")):
                assert language == "python", f"{_name(page)}: a ```{language} block is not run; use ```python"
        for example in document:
            if _is_skip(example):
                action, reason = example.parsed
                if action in ("next", "start"):
                    assert reason and reason.strip().strip("\"'"), f"{_name(page)}:{example.line}: say why"
                    skipped.append(f"{_name(page)}:{example.line} {reason}")
            elif not _is_setup(example):
                total += 1
    assert total >= 30, total
    print(f"{total} python blocks, {len(skipped)} not run:", *skipped, sep="\n  ")
