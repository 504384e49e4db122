"""``format.tensors``: the version-2 tensor table. Its fast path (``table_records``) must accept exactly the tables
whose every record passes the field-by-field checks (``manifest._checked_tensors``) and give the same records; on
any bad field it declines, and the manifest parser then names the record and field."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import manifest, tensors
from tierckpt.format.manifest import FileRecord, RankManifest
from tierckpt.format.tensors import COLUMNS, TensorRecord, encode_table, table_items, table_records

FILES = (FileRecord("f0", 4096 + 4000, "00" * 16, 4096), FileRecord("f1", 8192 + 640, "11" * 16, 8192))


def _records(seed: int) -> tuple[TensorRecord, ...]:
    """Records that tile both files: mixed dtypes, 0-d and empty tensors, both kinds."""
    rng = random.Random(seed)
    out, i = [], 0
    for f, rec in enumerate(FILES):
        pos = rec.data_start
        while pos < rec.size:
            dtype, size = rng.choice([("F32", 4), ("BF16", 2), ("U8", 1), ("I64", 8)])
            left = (rec.size - pos) // size
            shape = rng.choice([(), (0,), (min(left, 3), 1), (min(left, 7),)]) if left else (0,)
            numel = 1
            for d in shape:
                numel *= d
            if pos + numel * size > rec.size or (numel == 0 and rec.size - pos < 8):
                shape, dtype, numel, size = (rec.size - pos,), "U8", rec.size - pos, 1
            out.append(TensorRecord(i, f"t{i}", f"state['t{i}']", dtype, shape, f, pos, numel * size, f"{i:032x}",
                                    rng.choice(["torch", "numpy"])))
            pos += numel * size
            i += 1
    return tuple(out)


def _cols(recs: tuple[TensorRecord, ...]) -> list[list[Any]]:
    """The table's columns as a manifest's JSON gives them back (shapes as lists)."""
    table = encode_table(recs)
    assert list(table) == list(COLUMNS)
    table = json.loads(json.dumps(table))
    return [table[c] for c in COLUMNS]


def _fast(cols: list[list[Any]]) -> list[TensorRecord] | None:
    return table_records(cols, [f.data_start for f in FILES], [f.size for f in FILES])


@pytest.mark.parametrize("seed", range(4))
def test_table_round_trip_and_agreement_with_the_field_by_field_checks(seed: int) -> None:
    recs = _records(seed)
    cols = _cols(recs)
    assert _fast(cols) == list(recs)
    assert manifest._checked_tensors(table_items(cols), list(FILES), None, None) == list(recs)
    assert all(type(r.shape) is tuple for r in _fast(cols))
    assert _fast(_cols(())) == [] and encode_table(()) == {c: [] for c in COLUMNS}


def _set(field: str, value: Any, i: int = 0):
    def edit(cols: list[list[Any]]) -> None:
        cols[COLUMNS.index(field)][i] = value
    return edit


BAD = {
    "offset_in_header": _set("offset", 100),
    "past_file_end": _set("offset", FILES[0].size),
    "nbytes_not_shape": lambda c: c[COLUMNS.index("nbytes")].__setitem__(0, c[COLUMNS.index("nbytes")][0] + 1),
    "dtype_unknown": _set("dtype", "F128"),
    "dtype_not_str": _set("dtype", 4),
    "kind_unknown": _set("kind", "pickle"),
    "dim_negative": _set("shape", [-1]),
    "dim_float": _set("shape", [1.0]),
    "dim_huge": _set("shape", [1 << 48]),
    "shape_not_list": _set("shape", 4),
    "too_many_dims": _set("shape", [1] * 65),
    "file_outside": _set("file", 2),
    "file_negative": _set("file", -1),
    "file_bool": _set("file", False),
    "offset_float": _set("offset", 4096.0),
    "offset_u64": _set("offset", 2**64),
    "name_not_str": _set("name", None),
    "path_not_str": _set("path", ["x"]),
    "checksum_not_str": _set("checksum", 0),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_field_is_declined_and_then_named(case: str) -> None:
    recs = _records(0)
    cols = _cols(recs)
    BAD[case](cols)
    assert _fast(cols) is None
    with pytest.raises(CorruptCheckpointError, match=r"tensors\[0\]|bad shape"):
        manifest._checked_tensors(table_items(cols), list(FILES), None, None)


def test_shards_take_the_field_by_field_checks() -> None:
    recs = list(_records(1))
    recs[0] = recs[0]._replace(shape=(3, 1), dtype="U8", nbytes=3, shard={"global_shape": [6, 1], "offset": [3, 0]})
    recs[1:] = []
    cols = _cols(tuple(recs))
    assert _fast(cols) is None  # declined: a shard's description is checked record by record
    assert manifest._checked_tensors(table_items(cols), list(FILES), None, None)[0].shard == recs[0].shard


def test_a_rank_manifest_names_the_bad_record_of_its_table() -> None:
    recs = _records(2)
    rm = RankManifest(step=1, rank=0, world_size=1, save_id="abcd", files=FILES, tensors=recs, tree=None)
    assert RankManifest.from_bytes(rm.to_bytes()).tensors == recs
    bad = dataclasses.replace(rm, tensors=recs[:3] + (recs[3]._replace(dtype="F128"),) + recs[4:])
    with pytest.raises(CorruptCheckpointError, match=r"tensors\[3\]: unknown dtype 'F128'"):
        RankManifest.from_bytes(bad.to_bytes())
    assert tensors.TENSOR_KINDS == manifest.TENSOR_KINDS
