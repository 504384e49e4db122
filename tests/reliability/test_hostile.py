"""Hostile checkpoints: hand-crafted manifests and data files that try to escape the folder, make the reader
allocate absurd sizes, confuse the parsers, or run code. Each must end in a CheckpointError (CorruptCheckpointError)
before any large allocation, read nothing outside the checkpoint's folder, and execute nothing.

Manifests are sealed with a checksum of their canonical JSON, so every hostile manifest here is RE-SEALED exactly as
the library seals (``format.manifest._seal``) and, for a rank manifest, manifest.json's reference to it is updated
and re-sealed too: otherwise only the checksum would be tested, not the parsers behind it.

Plus a hypothesis fuzzer over ``RankManifest.from_bytes``, ``StepManifest.from_bytes``,
``format.safetensors.parse_header`` and the state-tree decoder (``plan_restore`` + apply): only CheckpointError
subclasses (or TypeError for a bad user state) may escape. 200 examples in the suite, many more with TIERCKPT_LONG=1.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests._support.helpers import data_files, rank_manifests, step_path
from tierckpt import CheckpointError, CheckpointManager, CorruptCheckpointError, cli
from tierckpt.format import hashing
from tierckpt.format.manifest import MAX_MANIFEST_BYTES, RankManifest, StepManifest, TensorRecord, _seal
from tierckpt.format.safetensors import parse_header, parse_header_length
from tierckpt.snapshot.load import plan_restore
from tierckpt.snapshot.loaded import tensor_view_factory

LONG = os.environ.get("TIERCKPT_LONG") == "1"
pytestmark = pytest.mark.timeout(600 if LONG else 120)
FUZZ = settings(max_examples=3000 if LONG else 50, deadline=None, derandomize=not LONG, database=None,
                suppress_health_check=list(HealthCheck))
#: More than this requested from the staging pool (or traced in Python) counts as a large allocation.
BIG = 32 << 20


def _state(seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1000, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16), "k": [1, 2.5]}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.bfloat16), "k": [0, 0.0]}


class Marker:
    """Unpickling this creates ``path``: the proof that something executed a pickle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, _state())
        mgr.wait()
    return root


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())


def _write_step_manifest(root: Path, d: dict[str, Any], step: int = 1) -> None:
    (step_path(root, step) / "manifest.json").write_bytes(_seal(dict(d)))


def _write_rank_manifest(root: Path, raw: bytes, step: int = 1) -> None:
    """Install ``raw`` as the rank manifest and re-seal manifest.json so that it points at these exact bytes."""
    folder = step_path(root, step)
    rpath = rank_manifests(folder)[0]
    rpath.write_bytes(raw)
    sm = _load(folder / "manifest.json")
    sm["ranks"][0]["size"] = len(raw)
    sm["ranks"][0]["checksum"] = hashing.digest(raw).hex()
    _write_step_manifest(root, sm, step)


def _edit_rank(root: Path, edit) -> None:
    d = _load(rank_manifests(step_path(root, 1))[0])
    edit(d)
    _write_rank_manifest(root, _seal(d))


class Spy:
    """Records every path opened and every staging-pool request while a restore runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mgr: CheckpointManager) -> None:
        self.paths: list[str] = []
        self.requests: list[int] = []
        real_os_open, real_open, real_acquire = os.open, builtins.open, mgr.components.staging.acquire

        def os_open(path, *a, **k):
            self.paths.append(os.fspath(path))
            return real_os_open(path, *a, **k)

        def b_open(file, *a, **k):
            if isinstance(file, (str, bytes, os.PathLike)):
                self.paths.append(os.fsdecode(file))
            return real_open(file, *a, **k)

        def acquire(n, *a, **k):
            self.requests.append(n)
            return real_acquire(n, *a, **k)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(builtins, "open", b_open)
        monkeypatch.setattr(mgr.components.staging, "acquire", acquire)


def _restore_hostile(root: Path, monkeypatch: pytest.MonkeyPatch, marker: Path | None = None, *,
                     state_factory=_empty, strict: bool = True, verify_bad: bool = True,
                     expect: type[CheckpointError] = CorruptCheckpointError) -> CheckpointError:
    """Restore step 1 explicitly and with fallback; both must fail cleanly and stay small and inside the folder."""
    with CheckpointManager(root) as mgr:
        spy = Spy(monkeypatch, mgr)
        tracemalloc.start()
        try:
            state = state_factory()
            with pytest.raises(expect) as ei:
                mgr.restore(state, step=1, strict=strict)
            with pytest.raises(expect):  # the only step is bad: nothing to fall back to
                mgr.restore(state_factory(), strict=strict)
            _cur, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            monkeypatch.undo()
    untouched = state_factory()
    for k, v in untouched.items():
        same = torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v
        assert same, f"state[{k!r}] was modified by a refused restore"
    # every manifest read transiently allocates MAX_MANIFEST_BYTES (the bug in test_small_manifest_read_is_small);
    # beyond that fixed cap, a hostile checkpoint must not make the reader allocate anything large
    assert peak < MAX_MANIFEST_BYTES + BIG, f"restore of a hostile checkpoint allocated {peak} bytes (Python heap)"
    assert all(n < BIG for n in spy.requests), f"large staging buffer requested: {spy.requests}"
    real_root = os.path.realpath(root)
    outside = [p for p in spy.paths if not os.path.realpath(p).startswith(real_root)]
    assert not outside, f"restore opened paths outside the checkpoint folder: {outside}"
    if marker is not None:
        assert not marker.exists(), "a pickle was executed"
    if verify_bad:
        rc = cli.main(["verify", str(root)])
        assert rc == 1, f"verify exit {rc} on a hostile checkpoint"
    return ei.value


def test_small_manifest_read_is_small(ckpt: Path) -> None:
    from tierckpt.storage.local import LocalStore

    store = LocalStore(ckpt)
    tracemalloc.start()
    try:
        store.read_bytes("step-0000000001/manifest.json", max_size=MAX_MANIFEST_BYTES)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BIG, f"reading a {len((ckpt / 'step-0000000001' / 'manifest.json').read_bytes())}-byte manifest " \
        f"allocated {peak} bytes"


# ------------------------------------------------------------------------------------------- hostile rank manifests
def _name(v: str):
    return lambda d: d["files"][0].__setitem__("name", v)


def _tensor(field: str, v: Any):
    """Set the first tensor record's ``field`` in either layout (version 1: a list of records; 2: a table)."""
    def edit(d: dict[str, Any]) -> None:
        if isinstance(d["tensors"], dict):
            d["tensors"][field][0] = v
        else:
            d["tensors"][0][field] = v
    return edit


def _as_v1(d: dict[str, Any]) -> None:
    """Rewrite a rank manifest in format version 1 (one object per tensor record, with its index)."""
    cols = d["tensors"]
    d["tensors"] = [{"index": i, **dict(zip(cols, row))} for i, row in enumerate(zip(*cols.values()))]
    d["format_version"] = 1


def _table(edit):
    def apply(d: dict[str, Any]) -> None:
        edit(d["tensors"])
    return apply


def _file(field: str, v: Any):
    return lambda d: d["files"][0].__setitem__(field, v)


def _huge_consistent(d: dict[str, Any]) -> None:
    """A self-consistent manifest claiming a 512 GiB tensor: only the real file size can expose it."""
    _as_v1(d)  # edited record by record, then written back in the layout it came in
    f, t = d["files"][0], d["tensors"][0]
    idx = [i for i, x in enumerate(d["tensors"]) if x["file"] == 0]
    for i in idx:
        d["tensors"][i]["nbytes"] = 0
        d["tensors"][i]["shape"] = [0]
        d["tensors"][i]["offset"] = f["data_start"]
    t["dtype"], t["shape"], t["nbytes"], t["offset"] = "F32", [1 << 37], 1 << 39, f["data_start"]
    f["size"] = f["data_start"] + (1 << 39)


def _huge_consistent_table(d: dict[str, Any]) -> None:
    _huge_consistent(d)
    recs = d["tensors"]
    d["tensors"] = {c: [r[c] for r in recs] for c in TensorRecord._fields[1:]}
    d["format_version"] = 2


def _deep(levels: int) -> Any:
    node: Any = 1
    for _ in range(levels):
        node = [node]
    return node


#: hostile nodes for the non-tensor key "k" of an otherwise valid tree (the tensors w and b are fine)
TREE_NODES: dict[str, Any] = {
    "tensor_ref_outside": {"$tensor": 99},
    "ndarray_ref_to_torch": {"$ndarray": 0},
    "unknown_tag": {"$pickle": "gASVAAAA"},
    "import_tag": {"$stateful": {"$dict": []}, "type": "os.system"},
    "dtype_attr": {"$dtype": "load"},
    "device_bad": {"$device": "evil:0"},
    "bytes_bad": {"$bytes": "!!!not base64"},
    "float_bad": {"$float": "0xZZ"},
    "dict_unhashable_key": {"$dict": [[[1, 2], 3]]},
    "deep_500": _deep(500),
}


RANK_EDITS = {
    "name_dotdot": _name("../x"),
    "name_absolute": _name("/etc/passwd"),
    "name_subdir": _name("a/b"),
    "name_dotfile": _name(".lock-rank00000"),
    "size_u64_max": _file("size", 2**64 - 1),
    "size_negative": _file("size", -1),
    "data_start_past_end": _file("data_start", 10**12),
    "shape_absurd": _tensor("shape", [1 << 62]),
    "shape_many_dims": _tensor("shape", [1] * 1000),
    "shape_negative": _tensor("shape", [-4]),
    "shape_float": _tensor("shape", [4.0]),
    "offset_u64_max": _tensor("offset", 2**64 - 1),
    "offset_outside": _tensor("offset", 10**9),
    "nbytes_lies": _tensor("nbytes", 8),
    "file_index_outside": _tensor("file", 5),
    "dtype_unknown": _tensor("dtype", "F128"),
    "dtype_object": _tensor("dtype", "object"),
    "kind_pickle": _tensor("kind", "pickle"),
    "compression_unknown": _file("compression", "pickle"),
    "files_not_list": lambda d: d.__setitem__("files", {"0": 1}),
    "rank_outside_world": lambda d: d.__setitem__("rank", 7),
    "checksum_not_str": _tensor("checksum", 7),
    "index_bool_file": _tensor("file", True),
}

#: version-2 tensor tables that are not tables
TABLE_EDITS = {
    "table_column_missing": _table(lambda t: t.pop("shape")),
    "table_column_extra": _table(lambda t: t.__setitem__("index", list(range(len(t["name"]))))),
    "table_column_short": _table(lambda t: t["offset"].pop()),
    "table_column_not_list": _table(lambda t: t.__setitem__("dtype", "F32")),
    "table_is_list": lambda d: d.__setitem__("tensors", list(d["tensors"].values())),
    "table_in_version_1": lambda d: d.__setitem__("format_version", 1),
    "records_in_version_2": lambda d: (_as_v1(d), d.__setitem__("format_version", 2)),
    "shard_bad_in_table": _tensor("shard", {"global_shape": [1], "offset": [5]}),
}


@pytest.mark.parametrize("layout", ["v2", "v1"])
@pytest.mark.parametrize("case", list(RANK_EDITS))
def test_hostile_rank_manifest(ckpt: Path, monkeypatch: pytest.MonkeyPatch, case: str, layout: str) -> None:
    """Every edit, in the tensor table this version writes and in the version-1 records it still reads."""
    _edit_rank(ckpt, lambda d: (_as_v1(d) if layout == "v1" else None, RANK_EDITS[case](d)))
    err = _restore_hostile(ckpt, monkeypatch)
    assert err.step == 1


@pytest.mark.parametrize("case", list(TABLE_EDITS))
def test_hostile_tensor_table(ckpt: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    _edit_rank(ckpt, TABLE_EDITS[case])
    err = _restore_hostile(ckpt, monkeypatch)
    assert err.step == 1 and "tensors" in str(err)


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_huge_but_consistent_manifest(ckpt: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """Claims a 512 GiB tensor under a key the state lacks (strict=False loads it): the real file size must stop the
    reader before it allocates."""
    _edit_rank(ckpt, _huge_consistent if layout == "v1" else _huge_consistent_table)
    _restore_hostile(ckpt, monkeypatch, state_factory=lambda: {"k": [0, 0.0]}, strict=False)


def test_version_1_checkpoints_still_restore_and_verify(ckpt: Path) -> None:
    """A checkpoint written by a version-1 tierckpt (one JSON object per tensor record) restores bit for bit and
    verifies; the records parse to exactly those of the version-2 table."""
    rpath = rank_manifests(step_path(ckpt, 1))[0]
    v2 = RankManifest.from_bytes(rpath.read_bytes())
    _edit_rank(ckpt, _as_v1)
    raw = rpath.read_bytes()
    assert json.loads(raw)["format_version"] == 1 and isinstance(json.loads(raw)["tensors"], list)
    v1 = RankManifest.from_bytes(raw)
    assert v1.tensors == v2.tensors and v1.tree == v2.tree and v1.format_version == 1
    assert json.loads(v1.to_bytes())["format_version"] == 2  # re-encoded (a cached copy): the current format
    assert RankManifest.from_bytes(v1.to_bytes()).tensors == v2.tensors
    got = _empty()
    with CheckpointManager(ckpt) as mgr:
        assert mgr.restore(got) == 1
    want = _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["k"] == want["k"]
    assert cli.main(["verify", str(ckpt)]) == 0


def _set_tree_k(node: Any):
    def edit(d: dict[str, Any]) -> None:
        pairs = d["tree"]["$dict"]
        for p in pairs:
            if p[0] == "k":
                p[1] = node
    return edit



@pytest.mark.parametrize("case", list(TREE_NODES))
def test_hostile_tree(ckpt: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """verify checks files, not the tree, so only restore can refuse these (and must leave the state untouched).
    ``$stateful`` against a list is a StateMismatchError: still a CheckpointError, nothing imported."""
    _edit_rank(ckpt, _set_tree_k(TREE_NODES[case]))
    _restore_hostile(ckpt, monkeypatch, verify_bad=False,
                     expect=CheckpointError if case == "import_tag" else CorruptCheckpointError)


def test_deep_json_100k_levels(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """100k nested lists: the JSON parser itself must be stopped (not a RecursionError or a crash)."""
    raw = b'{"format":"tierckpt.rank","format_version":1,"hash_algorithm":"' + hashing.ALGORITHM.encode() + \
        b'","tree":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _write_rank_manifest(ckpt, raw)
    _restore_hostile(ckpt, monkeypatch)
    (step_path(ckpt, 1) / "manifest.json").write_bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    _restore_hostile(ckpt, monkeypatch)
    with pytest.raises(CorruptCheckpointError):
        parse_header(b"[" * 100_000 + b"]" * 100_000, 0)


def test_non_utf8_manifests(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_rank_manifest(ckpt, b'{"format":"tierckpt.rank","x":"\xff\xfe"}')
    _restore_hostile(ckpt, monkeypatch)
    (step_path(ckpt, 1) / "manifest.json").write_bytes(b"\xff\xfe\x00{}")
    _restore_hostile(ckpt, monkeypatch)


# ------------------------------------------------------------------------------------------- hostile step manifests
STEP_EDITS = {
    "rank_name_escape": lambda d: d["ranks"][0].__setitem__("name", "../../etc/passwd"),
    "rank_name_absolute": lambda d: d["ranks"][0].__setitem__("name", "/etc/passwd"),
    "rank_size_u64_max": lambda d: d["ranks"][0].__setitem__("size", 2**64 - 1),
    "rank_size_huge": lambda d: d["ranks"][0].__setitem__("size", 1 << 40),
    "world_zero": lambda d: d.__setitem__("world_size", 0),
    "world_huge": lambda d: d.__setitem__("world_size", 1 << 40),
    "ranks_duplicated": lambda d: d.__setitem__("ranks", d["ranks"] * 2),
    "ranks_empty": lambda d: d.__setitem__("ranks", []),
    "step_other": lambda d: d.__setitem__("step", 2),
    "version_future": lambda d: d.__setitem__("format_version", 99),
    "hash_unknown": lambda d: d.__setitem__("hash_algorithm", "md5"),
    "format_other": lambda d: d.__setitem__("format", "tierckpt.rank"),
}


@pytest.mark.parametrize("case", list(STEP_EDITS))
def test_hostile_step_manifest(ckpt: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    d = _load(step_path(ckpt, 1) / "manifest.json")
    STEP_EDITS[case](d)
    _write_step_manifest(ckpt, d)
    _restore_hostile(ckpt, monkeypatch)


def _with_duplicate_key(raw: bytes, key: str, value: Any) -> bytes:
    """The same JSON with ``"key": value`` inserted FIRST: json.loads keeps the last, so the seal still matches."""
    return b"{" + json.dumps(key).encode() + b":" + json.dumps(value).encode() + b"," + raw[1:]


def test_duplicate_keys_in_manifest_rejected(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = step_path(ckpt, 1) / "manifest.json"
    path.write_bytes(_with_duplicate_key(path.read_bytes(), "step", 999))
    _restore_hostile(ckpt, monkeypatch)


def test_duplicate_keys_in_safetensors_header_rejected() -> None:
    body = b'{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'
    try:
        entries, _ = parse_header(body, 4)
    except CorruptCheckpointError:
        return
    # accepted: then both readings must be the same tensor (no ambiguity about which bytes it names)
    assert list(entries) == ["t"]


# ------------------------------------------------------------------------------------------------ hostile data files
def test_data_file_replaced_by_pickle(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    target = data_files(step_path(ckpt, 1))[0]
    size = target.stat().st_size
    payload = pickle.dumps({"w": Marker(str(marker))}, protocol=2)
    target.write_bytes(payload)  # a different size
    _restore_hostile(ckpt, monkeypatch, marker)
    target.write_bytes(payload + b"\0" * (size - len(payload)))  # the exact size: only the checksum can tell
    _restore_hostile(ckpt, monkeypatch, marker)


def test_data_file_replaced_by_torch_save(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    target = data_files(step_path(ckpt, 1))[0]
    torch.save({"w": torch.zeros(3), "evil": Marker(str(marker))}, target)
    _restore_hostile(ckpt, monkeypatch, marker)


def test_manifest_replaced_by_pickle(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    (step_path(ckpt, 1) / "manifest.json").write_bytes(pickle.dumps(Marker(str(marker))))
    _restore_hostile(ckpt, monkeypatch, marker)


def test_rank_manifest_replaced_by_pickle(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "PWNED"
    _write_rank_manifest(ckpt, pickle.dumps(Marker(str(marker))))
    _restore_hostile(ckpt, monkeypatch, marker)


def test_pt_file_next_to_checkpoint_is_ignored(ckpt: Path, tmp_path: Path) -> None:
    """A stray model.pt in a step folder is reported as an extra file and never loaded."""
    marker = tmp_path / "PWNED"
    torch.save({"evil": Marker(str(marker))}, step_path(ckpt, 1) / "model.pt")
    with CheckpointManager(ckpt) as mgr:
        state = _empty()
        assert mgr.restore(state) == 1
    assert torch.equal(state["w"], _state()["w"])
    assert not marker.exists()


@pytest.mark.parametrize("prefix", [2**64 - 1, 2**63, 10**9, 0])
def test_header_length_prefix(ckpt: Path, monkeypatch: pytest.MonkeyPatch, prefix: int) -> None:
    target = data_files(step_path(ckpt, 1))[0]
    raw = bytearray(target.read_bytes())
    raw[:8] = struct.pack("<Q", prefix)
    target.write_bytes(bytes(raw))
    _restore_hostile(ckpt, monkeypatch)
    if prefix > len(raw):
        with pytest.raises(CorruptCheckpointError):
            parse_header_length(bytes(raw[:8]), len(raw))


HEADERS = {
    "dtype_unknown": {"t": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
    "shape_absurd": {"t": {"dtype": "U8", "shape": [1 << 62], "data_offsets": [0, 4]}},
    "offsets_u64": {"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 2**64 - 1]}},
    "offsets_reversed": {"t": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}},
    "offsets_overlap": {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                        "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},
    "gap": {"t": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}},
    "extra_field": {"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], "exec": "rm -rf /"}},
    "metadata_not_str": {"__metadata__": {"a": 1}},
    "not_object": [1, 2],
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_hostile_safetensors_header(case: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        parse_header(json.dumps(HEADERS[case]).encode(), 4)
    with pytest.raises(CorruptCheckpointError):
        parse_header(b"\xff\xfe" + json.dumps(HEADERS[case]).encode(), 4)


# ------------------------------------------------------------------------------------------------------- fuzzers
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from(["$tensor", "$dict", "../x", "F32", "U8", "torch", "numpy"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["$dict", "$odict", "$tensor", "$ndarray", "$tuple", "$set", "$float", "$bytes", "$size",
                         "$dtype", "$device", "$generator", "$stateful", "$npscalar", "type", "device", "x"]),
        kids, max_size=3),
    max_leaves=20,
)


def _valid_rank_dict() -> dict[str, Any]:
    files = [{"name": "r00000-p0000-abcd1234.safetensors", "size": 4096 + 16, "checksum": "0" * 32,
              "data_start": 4096, "compression": None, "stored_size": None}]
    tensors = [{"index": 0, "name": "w", "path": "state['w']", "dtype": "F32", "shape": [4], "file": 0,
                "offset": 4096, "nbytes": 16, "checksum": "0" * 32, "kind": "torch"}]
    return {"step": 1, "rank": 0, "world_size": 1, "save_id": "abcd1234", "files": files, "tensors": tensors,
            "tree": {"$dict": [["w", {"$tensor": 0}]]}, "metadata": None, "created": 1.0,
            "library_version": "0", "format_version": 1, "hash_algorithm": hashing.ALGORITHM,
            "format": "tierckpt.rank"}


def _valid_rank_dict_v2() -> dict[str, Any]:
    """The same manifest in format version 2: the tensor records as a table (two tensors, so that columns have
    lengths to disagree on)."""
    d = _valid_rank_dict()
    d["files"][0]["size"] = 4096 + 24
    d["tensors"] = {"name": ["w", "b"], "path": ["state['w']", "state['b']"], "dtype": ["F32", "BF16"],
                    "shape": [[4], [4]], "file": [0, 0], "offset": [4096, 4112], "nbytes": [16, 8],
                    "checksum": ["0" * 32, "1" * 32], "kind": ["torch", "torch"], "shard": [None, None]}
    d["tree"] = {"$dict": [["w", {"$tensor": 0}], ["b", {"$tensor": 1}]]}
    d["format_version"] = 2
    return d


def _valid_step_dict() -> dict[str, Any]:
    return {"step": 1, "world_size": 1, "save_id": "abcd1234",
            "ranks": [{"rank": 0, "name": "r00000-abcd1234.manifest.json", "size": 10, "checksum": "0" * 32}],
            "total_bytes": 10, "metadata": None, "created": 1.0, "library_version": "0", "format_version": 1,
            "hash_algorithm": hashing.ALGORITHM, "format": "tierckpt.step"}


def _mutate(d: Any, path: list[Any], value: Any) -> None:
    """Replace the node at ``path`` (indices/keys, wrapped modulo what exists) with ``value``."""
    node = d
    for i, p in enumerate(path):
        if isinstance(node, dict) and node:
            key = sorted(node)[p % len(node)]
        elif isinstance(node, list) and node:
            key = p % len(node)
        else:
            return
        if i == len(path) - 1 or not isinstance(node[key], (dict, list)):
            node[key] = value
            return
        node = node[key]


def _parse_ok(fn, raw: bytes) -> None:
    try:
        fn(raw)
    except CheckpointError:
        pass


mutation = st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=4), json_values)


def test_valid_fuzz_seeds_parse() -> None:
    RankManifest.from_bytes(_seal(_valid_rank_dict()))
    assert len(RankManifest.from_bytes(_seal(_valid_rank_dict_v2())).tensors) == 2
    StepManifest.from_bytes(_seal(_valid_step_dict()))


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=4), st.sampled_from(["rank", "rank_v2", "step"]))
def test_fuzz_manifests_resealed(mutations, kind: str) -> None:
    d = {"rank": _valid_rank_dict, "rank_v2": _valid_rank_dict_v2, "step": _valid_step_dict}[kind]()
    rank = kind != "step"
    for path, value in mutations:
        _mutate(d, path, value)
    try:
        raw = _seal(d)
    except (ValueError, TypeError):  # not representable as canonical JSON: raw bytes then
        raw = json.dumps(d, default=str).encode()
    _parse_ok(RankManifest.from_bytes if rank else StepManifest.from_bytes, raw)


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_manifest_bytes(raw: bytes) -> None:
    _parse_ok(RankManifest.from_bytes, raw)
    _parse_ok(StepManifest.from_bytes, raw)
    _parse_ok(lambda r: parse_header(r, 16), raw)
    _parse_ok(lambda r: parse_header_length(r, 64), raw)


@FUZZ
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=4), st.integers(0, 64))
def test_fuzz_safetensors_header(obj: dict[str, Any], data_size: int) -> None:
    _parse_ok(lambda r: parse_header(r, data_size), json.dumps(obj).encode())


_RECORDS = (
    TensorRecord(0, "w", "state['w']", "F32", (4,), 0, 0, 16, "", "torch"),
    TensorRecord(1, "a", "state['a']", "I64", (2,), 0, 16, 16, "", "numpy"),
)
_BYTES = torch.arange(32, dtype=torch.uint8)


def _raw(i: int) -> torch.Tensor:
    rec = _RECORDS[i]
    return _BYTES[rec.offset : rec.offset + rec.nbytes]


@FUZZ
@given(json_values, st.booleans())
@example({"$dict": [[[], None]]}, False)  # a list as a dict key: once a TypeError from the planner
@example({"$dict": [[{"$tuple": [[]]}, 1]]}, True)
@example({"$set": [[]]}, False)  # a list in a set: once a TypeError from the decoder
def test_fuzz_tree_decoder(tree: Any, strict: bool) -> None:
    state: dict[str, Any] = {"w": torch.zeros(4), "a": 0, "n": {"x": 1}, "l": [1, 2]}
    try:
        plan = plan_restore(state, {"$dict": [["w", tree], ["n", tree], ["l", tree], ["z", tree]]}, _RECORDS,
                            strict=strict, step=1)
        plan.apply(_RECORDS, tensor_view_factory(_RECORDS, _raw), step=1)
    except CheckpointError:
        pass
    try:
        plan = plan_restore(state, tree, _RECORDS, strict=strict, step=1)
        plan.apply(_RECORDS, tensor_view_factory(_RECORDS, _raw), step=1)
    except CheckpointError:
        pass
