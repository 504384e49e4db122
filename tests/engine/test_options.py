"""One source of defaults: every option of :class:`tierckpt.options.Options` is a keyword of
``CheckpointManager`` with the same default, reaches ``mgr.options`` as given, and is validated there."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from tierckpt import CheckpointManager
from tierckpt.options import Options
from tierckpt.storage.fsspec_store import DEFAULT_PART_SIZE
from tierckpt.tiers.uploader import DEFAULT_CHUNK, replicate_step


def test_every_option_is_a_keyword_with_the_options_default() -> None:
    params = inspect.signature(CheckpointManager).parameters
    for f in dataclasses.fields(Options):
        assert f.name in params, f"Options.{f.name} is not a CheckpointManager keyword"
        p = params[f.name]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert p.default == f.default, f"{f.name}: manager default {p.default!r}, Options default {f.default!r}"


def test_given_values_reach_the_options(tmp_path: Path) -> None:
    given = {"keep_local": 5, "upload_part_mb": 32, "remote_timeout_s": 7.5, "huge_pages": False,
             "max_upload_backlog": 0, "create_bucket": True}
    with CheckpointManager(tmp_path / "c", **given) as mgr:
        assert {k: getattr(mgr.options, k) for k in given} == given


def test_the_upload_part_size_is_one_default_on_every_path() -> None:
    """The manager's uploads, ``tierckpt sync`` (``replicate_step``) and the fsspec store cut parts of one size."""
    assert Options.upload_part_mb << 20 == DEFAULT_PART_SIZE == DEFAULT_CHUNK
    assert inspect.signature(replicate_step).parameters["part_size"].default == DEFAULT_PART_SIZE


@pytest.mark.parametrize("bad", [{"keep_local": 0}, {"upload_part_mb": 4}, {"remote_timeout_s": -1},
                                 {"huge_pages": "yes"}])
def test_bad_values_are_refused_naming_the_option(tmp_path: Path, bad: dict) -> None:
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        CheckpointManager(tmp_path / "c", **bad)
