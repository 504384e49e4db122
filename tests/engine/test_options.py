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


def test_options_come_in_groups_that_cover_every_option_once() -> None:
    from tierckpt.options import GROUPS

    names = [f.name for g in GROUPS for f in dataclasses.fields(g)]
    assert sorted(names) == sorted(f.name for f in dataclasses.fields(Options)) and len(set(names)) == len(names)


def test_a_group_passed_whole_sets_its_options_and_reads_back(tmp_path: Path) -> None:
    from tierckpt import DistributedOptions, LocalTierOptions, RemoteTierOptions

    local = LocalTierOptions(keep_local=4, writer_threads=3)
    remote = RemoteTierOptions(keep_remote=7, remote_timeout_s=5.0)
    with CheckpointManager(tmp_path / "c", local_tier=local, remote_tier=remote,
                           distributed=DistributedOptions(collective_timeout_s=60.0), overlap_writes=False) as mgr:
        assert mgr.options.group(LocalTierOptions) == local and mgr.options.group(RemoteTierOptions) == remote
        assert (mgr.options.keep_local, mgr.options.writer_threads, mgr.options.keep_remote) == (4, 3, 7)
        assert mgr.options.collective_timeout_s == 60.0
        assert mgr.options.overlap_writes is False  # a keyword of a group not passed whole still counts


def test_a_group_and_one_of_its_keywords_together_are_refused(tmp_path: Path) -> None:
    from tierckpt import LocalTierOptions, RemoteTierOptions

    with pytest.raises(ValueError, match="keep_local given both"):
        CheckpointManager(tmp_path / "c", local_tier=LocalTierOptions(keep_local=4), keep_local=3)
    with pytest.raises(ValueError, match="keep_local must be an int >= 1"):  # a group is validated like keywords
        CheckpointManager(tmp_path / "d", local_tier=LocalTierOptions(keep_local=0))
    with pytest.raises(ValueError, match="local_tier must be a LocalTierOptions"):
        CheckpointManager(tmp_path / "e", local_tier=RemoteTierOptions())
