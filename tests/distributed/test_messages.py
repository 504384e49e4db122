"""What ranks hand each other through the c10d store: JSON of a fixed set of types, never pickle. Every kind of
message the agreements send round-trips; anything this code did not write (a pickle, an unknown tag, a class name,
a field the dataclass lacks) is refused without running anything; a rank whose input cannot be sent fails the
agreement for everyone instead of leaving them waiting."""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tierckpt.distributed import _CODEC, Coordinator
from tierckpt.engine.messages import ERRORS, Codec, MessageError
from tierckpt.errors import CheckpointError, StorageError
from tierckpt.format.manifest import RankRef, StepManifest
from tierckpt.tiers.listing import TierListings


def _manifest() -> StepManifest:
    ranks = (RankRef(0, "rank-0.json", 812, "ab" * 8, (("mesh-a", (0, 1)),)), RankRef(1, "rank-1.json", 790, "cd" * 8))
    return StepManifest(step=7, world_size=2, save_id="5eed", ranks=ranks, total_bytes=1 << 20,
                        metadata={"loss": 1.25, "tags": ["a", "b"], "epoch": None}, holds_ranks=(0, 1))


@pytest.mark.parametrize("obj", [
    None, 3, -1.5, "x", True, [1, [2, "3"]], (1, (2,)), {1, 2}, {3: [1, 2], "s": (0,), (1, 2): None},
    {"ref": (0, "rank-0.json", 812, "ab", (("m", (0, 1)),)), "bytes": 10, "node": (0, 1), "created": 1.5,
     "metadata": {"k": [1, {"n": None}]}},
    [(["host", "/nvme/ckpt"], "run-id")],
], ids=repr)
def test_plain_values_round_trip_with_their_types(obj: Any) -> None:
    back = _CODEC.decode(_CODEC.encode(obj))
    assert back == obj and repr(back) == repr(obj)  # a tuple stays a tuple, an int key an int


def test_a_step_manifest_round_trips() -> None:
    m = _manifest()
    assert _CODEC.decode(_CODEC.encode(m)) == m
    assert _CODEC.decode(_CODEC.encode([None, m])) == [None, m]  # a scatter of the manifest to its readers


@pytest.mark.parametrize("cls", sorted(ERRORS.values(), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_a_tier_listing_round_trips_with_each_error_class(cls: type[StorageError]) -> None:
    err = cls("cannot list", step=4, tier="remote", path="s3://b/run", transient=True)
    listing = TierListings({"local": {1, 2, 3}}, {"remote": err})
    back = _CODEC.decode(_CODEC.encode(listing))
    assert back.steps == listing.steps
    got = back.failed["remote"]
    assert type(got) is cls and str(got) == str(err) and got.transient is True
    assert (got.step, got.tier, got.path, got.detail) == (4, "remote", "s3://b/run", "cannot list")


def test_a_pickle_in_the_store_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # what the unpickler of earlier versions accepted: a name inside tierckpt's modules, resolved to os.system
    raw = b"\x80\x04\x8c\x14tierckpt.distributed\x8c\tos.system\x93" + pickle.dumps((f"touch {marker}",))[2:-1] + b"R."
    with pytest.raises(MessageError):
        _CODEC.decode(raw)
    with pytest.raises(MessageError):
        _CODEC.decode(pickle.dumps({"a": 1}))
    assert not marker.exists()


@pytest.mark.parametrize("value", [
    b'{"Topology": [["rank", 0]]}',  # a dataclass the codec was not built with
    b'{"os.system": ["touch x"]}',
    b'{"error": ["OSError", "m", null, null, null, null]}',  # not one of tierckpt's storage errors
    b'{"error": ["StorageError", "m", "7", null, null, null]}',
    b'{"error": ["StorageError", "m"]}',
    b'{"RankRef": [["rank", 0], ["name", "n"], ["size", 1], ["checksum", "c"], ["__class__", 1]]}',
    b'{"RankRef": [["rank", 0], ["rank", 1]]}',
    b'{"RankRef": [["rank", 0]]}',  # a required field missing
    b'{"tuple": [1], "set": [2]}',
    b'{"dict": [[[1], 2]]}',  # an unhashable key
    b'{"dict": [[1, 2, 3]]}',
    b'{"set": 1}',
    b'{"k": 1}',
    b"[1, 2",
    b"\xff",
], ids=lambda v: v.decode("latin-1")[:40])
def test_a_value_this_code_did_not_write_is_refused(value: bytes) -> None:
    with pytest.raises(MessageError):
        _CODEC.decode(value)


def test_encoding_refuses_what_no_message_carries() -> None:
    with pytest.raises(TypeError, match="cannot carry a object"):
        _CODEC.encode({"x": object()})
    with pytest.raises(TypeError, match="ValueError"):
        _CODEC.encode(ValueError("only tierckpt's storage errors travel"))


def test_a_codec_takes_dataclasses_once_and_no_tag_names() -> None:
    with pytest.raises(TypeError):
        Codec((dict,))
    with pytest.raises(TypeError):
        Codec((RankRef, RankRef))


# --------------------------------------------------------------------------------------- through a real c10d store
@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    """A one-rank job's coordinator over a real gloo process group's store."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield Coordinator(os.fspath(tmp_path), timeout_s=5)
    finally:
        dist.destroy_process_group()


def test_agreements_carry_manifests_and_listings_through_the_store(coordinator: Coordinator) -> None:
    m = _manifest()
    assert coordinator.scatter([m], coordinator.main_lane, what="the manifest") == m
    listing = TierListings({"local": {5}}, {"remote": ERRORS["StorageTimeoutError"]("slow", transient=True)})
    got = coordinator.broadcast(listing, coordinator.main_lane, what="listing the remote")
    assert got.steps == {"local": {5}} and type(got.failed["remote"]).__name__ == "StorageTimeoutError"


def test_an_input_that_cannot_be_sent_fails_the_agreement_for_every_rank(coordinator: Coordinator) -> None:
    with pytest.raises(CheckpointError, match=r"could not agree \(odd input\): rank 0: .*cannot carry a object"):
        coordinator.reduce(object(), coordinator.main_lane, lambda objs: objs[0], what="odd input")
    # the lane goes on: the next agreement is numbered and answered as on every other rank
    assert coordinator.reduce(3, coordinator.main_lane, sum, what="a sum") == 3


def test_an_answer_that_cannot_be_sent_is_an_error_not_a_hang(coordinator: Coordinator) -> None:
    with pytest.raises(CheckpointError, match=r"rank 0 failed: TypeError: .*cannot carry a object"):
        coordinator.reduce(1, coordinator.main_lane, lambda objs: object(), what="odd answer")
