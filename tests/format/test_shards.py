"""The mesh index's box arithmetic (tierckpt.format.shards) against DTensor's own, and the index in a manifest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.format._strategies import placed
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format.manifest import RankRef, StepManifest
from tierckpt.format.shards import UnknownPlacement, mesh_index, mesh_key, overlaps, saved_box, saved_runs

dt_utils = pytest.importorskip("torch.distributed.tensor._utils")
placement_types = pytest.importorskip("torch.distributed.tensor")


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], list[str], list[int], list[int]]:
    shape, places, mesh = draw(placed())
    coord = [draw(st.integers(0, n - 1)) for n in mesh]
    return shape, places, mesh, coord


def _torch_placement(p: str, dim: int | None = None) -> object:
    """DTensor's placement for one of the strategy's strings (on tensor dimension ``dim`` if given)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if p == "R":
        return placement_types.Replicate()
    d, _, f = p.strip("_S()").partition(", ")
    d = d if dim is None else str(dim)
    return _StridedShard(int(d), split_factor=int(f)) if f else placement_types.Shard(int(d))


def _dtensor_runs(shape: list[int], places: list[str], mesh: list[int], coord: list[int]) -> list[list[int]]:
    """Per tensor dimension, the global indices a rank holds, as DTensor's own placements cut them (each
    placement's ``_split_tensor``, mesh dimension by mesh dimension, on a tensor of indices)."""
    import torch

    held = [torch.arange(n) for n in shape]
    for p, n, c in zip(places, mesh, coord):
        if p != "R":
            d = int(p.strip("_S()").partition(",")[0])
            pieces, _ = _torch_placement(p, 0)._split_tensor(held[d], n, with_padding=False)
            held[d] = pieces[c]
    return [h.tolist() for h in held]


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_saved_runs_and_box_match_dtensor(layout: tuple[list[int], list[str], list[int], list[int]]) -> None:
    shape, places, mesh, coord = layout
    runs = saved_runs(shape, places, mesh, coord)
    if not all(c == 0 for c, p in zip(coord, places) if p == "R"):
        assert runs is None and saved_box(shape, places, mesh, coord) is None
        return
    assert runs is not None
    held = _dtensor_runs(shape, places, mesh, coord)
    assert [[i for s, e in r for i in range(s, e)] for r in runs] == held
    local, offset = dt_utils._compute_local_shape_and_global_offset(
        shape, mesh, coord, [_torch_placement(p) for p in places])
    if any(len(r) > 1 for r in runs):  # a strided shard no later Shard narrows: not one box
        with pytest.raises(UnknownPlacement, match="not one box"):
            saved_box(shape, places, mesh, coord)
        return
    box = saved_box(shape, places, mesh, coord)
    assert box is not None and box[1] == tuple(local)
    if all(n > 0 for n in local):  # an empty shard's offset is immaterial: it overlaps nothing
        assert box[0] == tuple(offset)


def test_fsdp_over_tensor_parallel_is_one_box_per_rank() -> None:
    # FSDP2 over a column-wise tensor-parallel weight: 12 rows, mesh (dp=2, tp=2); rank (i, j) holds rows of
    # tensor-parallel piece j, FSDP piece i: (0,0) 0-2, (0,1) 6-8, (1,0) 3-5, (1,1) 9-11
    places = ["_S(0, 2)", "S(0)"]
    got = {c: saved_box([12, 8], places, [2, 2], c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {(0, 0): ((0, 0), (3, 8)), (0, 1): ((6, 0), (3, 8)), (1, 0): ((3, 0), (3, 8)),
                   (1, 1): ((9, 0), (3, 8))}
    assert saved_box([12], ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], [2, 2], [1, 0]) == ((3,), (3,))
    assert saved_runs([12], ["_S(0, 2)"], [2], [1]) == (((3, 6), (9, 12)),)  # alone: two stretches
    with pytest.raises(UnknownPlacement, match="not one box"):
        saved_box([12], ["_S(0, 2)"], [2], [1])


def test_both_spellings_of_placements_and_unknown_ones() -> None:
    assert saved_box([8, 3], ["Shard(dim=0)"], [4], [2]) == saved_box([8, 3], ["S(0)"], [4], [2]) == ((4, 0), (2, 3))
    assert saved_box([8], ["Replicate()"], [2], [1]) is None
    for bad in (["_S(0)"], ["_S(0, 0)"], ["P"], ["S(3)"], ["_S(1, 2)"]):
        with pytest.raises(UnknownPlacement):
            saved_box([8], bad, [2], [0])
    with pytest.raises(UnknownPlacement):
        saved_box([8], ["S(0)"], [2, 2], [0, 0])


def test_overlaps() -> None:
    assert overlaps(((0, 0), (4, 3)), ((3, 2), (1, 1)))
    assert not overlaps(((0, 0), (4, 3)), ((4, 0), (4, 3)))
    assert not overlaps(((0,), (0,)), ((0,), (5,)))  # an empty box overlaps nothing


def test_mesh_index_of_records_and_in_a_step_manifest() -> None:
    shards = [None, {"mesh_shape": [2, 2], "mesh_dims": ["dp", "tp"], "coordinate": [1, 0]},
              {"mesh_shape": [4], "coordinate": [3]}, {"mesh": "[[0, 1], [2, 3]]"}]  # the last: an older record
    index = mesh_index(shards)
    assert index == (("2x2:dp,tp", (1, 0)), ("4", (3,)))
    assert mesh_key([2, 2], ["dp", "tp"]) == "2x2:dp,tp"
    ref = RankRef(0, "r00000-abcd.manifest.json", 10, "0" * 32, index)
    m = StepManifest(step=1, world_size=1, save_id="abcd", ranks=(ref,), total_bytes=10)
    assert StepManifest.from_bytes(m.to_bytes()).ranks == (ref,)
    plain = StepManifest(step=1, world_size=1, save_id="abcd", ranks=(RankRef(0, ref.name, 10, "0" * 32),),
                         total_bytes=10)
    assert b'"mesh"' not in plain.to_bytes()  # no index without distributed tensors


def test_a_malformed_mesh_index_is_corrupt() -> None:
    import json

    from tierckpt.format import hashing

    m = StepManifest(step=1, world_size=1, save_id="abcd",
                     ranks=(RankRef(0, "r00000-abcd.manifest.json", 10, "0" * 32, (("4", (1,)),)),), total_bytes=10)
    d = json.loads(m.to_bytes())
    d["ranks"][0]["mesh"] = {"4": [-1]}
    d.pop("checksum")
    raw = b'{"checksum":"' + hashing.digest(hashing.canonical_json(d)).hex().encode() + b'",' \
        + hashing.canonical_json(d)[1:]
    with pytest.raises(CorruptCheckpointError, match="mesh index"):
        StepManifest.from_bytes(raw)
