"""Template-free loading: ``CheckpointManager.load`` returns a saved state as plain values, verified, with restore's
fallback across tiers and steps; ``keys=`` reads only the selected tensors; nothing is unpickled; multi-rank jobs
load each rank's own tree without a collective.

Run as a script (``python test_load.py RANK CONFIG``), this module is one rank of the 2-rank job of
:func:`test_multi_rank_load_on_one_rank_and_on_all`.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._support.helpers import (
    assert_array_equal,
    assert_tensor_equal,
    assert_tree_equal,
    data_files,
    flip_byte,
    step_path,
)
from tierckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoadResult,
    StateMismatchError,
    StorageError,
)
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.testing import refused_url
from tierckpt.tiers.reader import read_ranks, read_step

pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------------------------------------ helpers
def _training_state(seed: int = 0) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW after one step (so it has moments), among plain values of every kind."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).square().sum().backward()
    optim.step()
    state = {
        "model": model,
        "optim": optim,
        "step": 7,
        "rng": torch.get_rng_state(),
        "cfg": {"lr": 1e-3, "name": "x", "betas": (0.9, 0.95)},
        "arr": np.arange(12, dtype=np.float64).reshape(3, 4) / 7,
    }
    return state, model, optim


def _values(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 16, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16),
            "step": seed}


def _records(root: Path, step: int) -> tuple[Any, list]:
    """(rank manifest, its tensor records) of a committed step in a local folder."""
    store = LocalStore(root, tier="local", create=False)
    rm = read_ranks(store, read_step(store, step), [0])[0]
    return rm, list(rm.tensors)


def _ranges(rm: Any, prefix: str) -> list[tuple[str, int, int]]:
    """(data file name, start, end) of every record whose key path starts with ``prefix``."""
    return [(rm.files[r.file].name, r.offset, r.offset + r.nbytes) for r in rm.tensors
            if r.path.startswith(prefix) and r.nbytes]


def _overlaps(reads: list[tuple[str, int, int]], ranges: list[tuple[str, int, int]]) -> list[tuple]:
    return [(rd, rg) for rd in reads for rg in ranges
            if rd[0].endswith("/" + rg[0]) and rd[1] < rg[2] and rg[1] < rd[2]]


@pytest.fixture
def local_reads(monkeypatch) -> list[tuple[str, int, int]]:
    """Every byte range read from a local store's files: (relative path, start, end)."""
    reads: list[tuple[str, int, int]] = []
    many, direct = LocalStore.readinto_many, LocalStore.readinto_direct

    def readinto_many(self, rel, offset, bufs):
        reads.append((rel, offset, offset + sum(memoryview(b).nbytes for b in bufs)))
        return many(self, rel, offset, bufs)

    def readinto_direct(self, rel, offset, buf):
        reads.append((rel, offset, offset + memoryview(buf).nbytes))
        return direct(self, rel, offset, buf)

    monkeypatch.setattr(LocalStore, "readinto_many", readinto_many)
    monkeypatch.setattr(LocalStore, "readinto_direct", readinto_direct)
    return reads


def _assert_owns_memory(t: torch.Tensor, where: str) -> None:
    """A tensor whose storage is exactly its own bytes: not a view into a larger (staging or scratch) buffer."""
    assert t._base is None, where
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{where}: a view of a larger buffer"


# ------------------------------------------------------------------------------------------------ round trip
def test_round_trip_nested_state_with_module_and_optimizer(tmp_path) -> None:
    state, model, optim = _training_state()
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(7, state, metadata={"note": "seven", "loss": 1.25})
        mgr.wait()
        res = mgr.load()
    assert isinstance(res, LoadResult)
    assert (res.step, res.tier, res.metadata) == (7, "local", {"note": "seven", "loss": 1.25})
    got = res.state
    assert list(got) == ["model", "optim", "step", "rng", "cfg", "arr"]
    # modules and optimizers come back as their state_dict() trees
    want_model = model.state_dict()
    assert isinstance(got["model"], OrderedDict) and list(got["model"]) == list(want_model)
    for k, v in want_model.items():
        assert_tensor_equal(got["model"][k], v, f"model[{k}]")
        _assert_owns_memory(got["model"][k], f"model[{k}]")
    want_optim = optim.state_dict()
    assert set(got["optim"]["state"]) == {0, 1, 2, 3}  # int keys stay ints
    assert_tree_equal(got["optim"], want_optim, "optim")
    assert got["optim"]["state"][0]["exp_avg"].abs().sum() > 0  # moments after a step, not zeros
    assert got["step"] == 7 and type(got["step"]) is int
    assert_tensor_equal(got["rng"], state["rng"], "rng")
    assert_tree_equal(got["cfg"], {"lr": 1e-3, "name": "x", "betas": (0.9, 0.95)}, "cfg")
    assert_array_equal(got["arr"], state["arr"], "arr")
    assert got["arr"].flags.owndata and got["arr"].flags.writeable
    # the loaded optimizer state feeds a fresh optimizer (the template-free path's usual next step)
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fresh.load_state_dict(got["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(got["optim"])
    assert_tree_equal(fresh_opt.state_dict(), want_optim, "fresh optimizer")


def test_result_is_a_frozen_dataclass(tmp_path) -> None:
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(1, {"x": torch.ones(2)})
        res = mgr.load()
    with pytest.raises(AttributeError):
        res.step = 2  # type: ignore[misc]
    assert res.metadata is None


# ------------------------------------------------------------------------------------------------ keys
def test_keys_loads_one_subtree_and_reads_no_byte_of_the_others(tmp_path, local_reads) -> None:
    state, model, optim = _training_state()
    root = tmp_path / "local"
    with CheckpointManager(root) as mgr:
        mgr.save(3, state)
        mgr.wait()
        rm, _ = _records(root, 3)
        optim_ranges, model_ranges = _ranges(rm, "state['optim']"), _ranges(rm, "state['model']")
        assert optim_ranges and model_ranges
        # the recorder sees reads: a full load reads the optimizer's bytes
        local_reads.clear()
        mgr.load()
        assert _overlaps(local_reads, optim_ranges)

        local_reads.clear()
        res = mgr.load(keys=["model"])
        assert list(res.state) == ["model"] and res.step == 3
        for k, v in model.state_dict().items():
            assert_tensor_equal(res.state["model"][k], v, k)
        assert _overlaps(local_reads, model_ranges), local_reads
        assert not _overlaps(local_reads, optim_ranges), "an optimizer tensor was read"
        read = sum(e - s for _, s, e in local_reads)
        assert read == sum(e - s for _, s, e in model_ranges), local_reads  # not even a header

        local_reads.clear()
        res = mgr.load(keys=("cfg", "step"))
        assert res.state == {"step": 7, "cfg": {"lr": 1e-3, "name": "x", "betas": (0.9, 0.95)}}
        assert local_reads == []  # no tensor selected: no data file read


def test_unknown_key_raises_key_error_naming_it_and_the_keys(tmp_path) -> None:
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(1, {"model": {"w": torch.ones(3)}, "optim": {"m": torch.zeros(3)}, 5: "int key"})
        with pytest.raises(KeyError) as ei:
            mgr.load(keys=["model", "nope"])
    assert isinstance(ei.value, StateMismatchError)
    msg = str(ei.value)
    assert "'nope'" in msg and "'model'" in msg and "'optim'" in msg and "5" in msg and "step 1" in msg


def test_keys_corrupt_selected_tensor_is_detected_unselected_one_is_not_read(tmp_path, caplog) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, keep_local=3) as mgr:
        for s in (1, 2):
            mgr.save(s, {"model": _values(s), "optim": _values(100 + s)})
        mgr.wait()
        rm, recs = _records(root, 2)
        folder = step_path(root, 2)
        # damage one optimizer tensor: a load of the model alone never reads it, so it still loads step 2
        opt_rec = next(r for r in recs if r.path == "state['optim']['w']")
        _flip_at(folder / rm.files[opt_rec.file].name, opt_rec.offset + 5)
        res = mgr.load(keys=["model"])
        assert res.step == 2
        assert_tree_equal(res.state["model"], _values(2))
        with pytest.raises(CorruptCheckpointError):
            mgr.load(step=2)  # the whole step does not verify
        # damage a model tensor: its own checksum catches it, the load falls back to step 1 and names the file
        model_rec = next(r for r in recs if r.path == "state['model']['w']")
        name = rm.files[model_rec.file].name
        _flip_at(folder / name, model_rec.offset + 7)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            res = mgr.load(keys=["model"])
        assert res.step == 1
        assert_tree_equal(res.state["model"], _values(1))
        assert any(name in r.getMessage() and "step 2" in r.getMessage() for r in caplog.records), caplog.text
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.load(step=2, keys=["model"])
        assert name in ei.value.bad_files


def _flip_at(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------------ step selection
def test_exact_step_and_missing_step(tmp_path) -> None:
    with CheckpointManager(tmp_path / "local", keep_local=5) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.load()  # nothing saved yet
        for s in (1, 2, 3):
            mgr.save(s, _values(s))
        mgr.wait()
        res = mgr.load(step=2)
        assert res.step == 2
        assert_tree_equal(res.state, _values(2))
        assert mgr.load().step == 3
        with pytest.raises(CheckpointNotFoundError) as ei:
            mgr.load(step=5)
        assert ei.value.step == 5


def test_flipped_byte_falls_back_to_the_remote_copy_of_the_same_step(tmp_path, s3_server, s3_bucket,
                                                                      caplog) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, remote=f"{s3_bucket}/run", storage_options=s3_server.storage_options(),
                           keep_local=3) as mgr:
        for s in (1, 2):
            mgr.save(s, _values(s), metadata={"s": s})
        mgr.wait()
        bad = data_files(step_path(root, 2))[0]
        flip_byte(bad, offset_from_end=3)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            res = mgr.load()
        assert (res.step, res.tier, res.metadata) == (2, "remote", {"s": 2})
        assert_tree_equal(res.state, _values(2))
        assert any(bad.name in r.getMessage() and "tier local" in r.getMessage() for r in caplog.records), caplog.text
        # a missing file: the same fallback
        bad.unlink()
        res = mgr.load(keys=["w"])
        assert (res.step, res.tier) == (2, "remote")
        assert_tensor_equal(res.state["w"], _values(2)["w"], "w")
        # the local tier alone: its newest intact step
        res = mgr.load(source="local")
        assert (res.step, res.tier) == (1, "local")
        assert_tree_equal(res.state, _values(1))


def test_flipped_byte_without_a_remote_falls_back_to_the_previous_step(tmp_path, caplog) -> None:
    root = tmp_path / "local"
    with CheckpointManager(root, keep_local=3) as mgr:
        for s in (1, 2):
            mgr.save(s, _values(s))
        mgr.wait()
        bad = data_files(step_path(root, 2))[0]
        flip_byte(bad, offset_from_end=3)
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            res = mgr.load()
        assert (res.step, res.tier) == (1, "local")
        assert_tree_equal(res.state, _values(1))
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and bad.name in r.getMessage()]
        assert warned and "step 2" in warned[0].getMessage(), caplog.text
        with pytest.raises(CorruptCheckpointError) as ei:
            mgr.load(step=2)
        assert bad.name in ei.value.bad_files and ei.value.step == 2
        # every step damaged: corrupt, not "no checkpoint"
        flip_byte(data_files(step_path(root, 1))[0], offset_from_end=3)
        with pytest.raises(CorruptCheckpointError):
            mgr.load()


def test_source_remote_after_the_local_folder_is_wiped(tmp_path, s3_server, s3_bucket, monkeypatch) -> None:
    state, model, optim = _training_state(seed=3)
    url, opts = f"{s3_bucket}/run", s3_server.storage_options()
    root = tmp_path / "local"
    with CheckpointManager(root, remote=url, storage_options=opts) as mgr:
        mgr.save(4, state, metadata={"epoch": 1})
        mgr.wait()
    shutil.rmtree(root)
    reads: list[tuple[str, int, int]] = []
    readinto = FsspecStore.readinto

    def spy(self, rel, offset, buf):
        reads.append((rel, offset, offset + memoryview(buf).nbytes))
        return readinto(self, rel, offset, buf)

    monkeypatch.setattr(FsspecStore, "readinto", spy)
    with CheckpointManager(root, remote=url, storage_options=opts) as mgr:
        res = mgr.load(source="remote")
        assert (res.step, res.tier, res.metadata) == (4, "remote", {"epoch": 1})
        assert_tree_equal(res.state["model"], model.state_dict(), "model")
        assert_tree_equal(res.state["optim"], optim.state_dict(), "optim")
        assert_array_equal(res.state["arr"], state["arr"])
        assert mgr.load().tier == "remote"  # auto: the local tier is empty
        # keys from the object store: the model's ranges only
        remote_store = FsspecStore(url, storage_options=opts, tier="remote")
        rm = read_ranks(remote_store, read_step(remote_store, 4), [0])[0]
        remote_store.close()
        reads.clear()
        res = mgr.load(keys=["model"], source="remote")
        assert_tree_equal(res.state["model"], model.state_dict(), "model")
        data_reads = [r for r in reads if r[0].endswith(".safetensors")]
        assert _overlaps(data_reads, _ranges(rm, "state['model']"))
        assert not _overlaps(data_reads, _ranges(rm, "state['optim']")), data_reads
    with CheckpointManager(tmp_path / "other") as mgr, pytest.raises(ValueError, match="no remote"):
        mgr.load(source="remote")


def test_compressed_remote_copy_loads_whole_and_by_key(tmp_path, s3_server, s3_bucket) -> None:
    state, model, optim = _training_state(seed=5)
    url, opts = f"{s3_bucket}/zstd", s3_server.storage_options()
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=opts, remote_compression="zstd") as mgr:
        mgr.save(2, state)
        mgr.wait()
        res = mgr.load(source="remote")
        assert res.tier == "remote"
        assert_tree_equal(res.state["optim"], optim.state_dict(), "optim")
        res = mgr.load(source="remote", keys=["model"])
        assert list(res.state) == ["model"]
        assert_tree_equal(res.state["model"], model.state_dict(), "model")


def test_unlisted_tier_with_nothing_elsewhere_raises_storage_error(tmp_path, s3_server) -> None:
    opts = s3_server.storage_options()
    opts["client_kwargs"] = {"endpoint_url": refused_url()}
    opts["config_kwargs"] = {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
    with CheckpointManager(tmp_path / "local", remote="s3://bucket/run", storage_options=opts,
                           remote_timeout_s=2.0, upload_deadline_s=5.0) as mgr:
        with pytest.raises(StorageError, match="refusing to report"):
            mgr.load()
        with pytest.raises(CheckpointNotFoundError):
            mgr.load(source="local")  # the local tier answered: it is empty


# ------------------------------------------------------------------------------------------------ memory
def test_loaded_tensors_are_independent_of_later_saves(tmp_path) -> None:
    state, model, _optim = _training_state()
    with CheckpointManager(tmp_path / "local", keep_local=4, staging_buffers=1) as mgr:
        mgr.save(1, state)
        mgr.wait()
        first = mgr.load()
        kept = {k: v.clone() for k, v in first.state["model"].items()}
        for k, v in first.state["model"].items():
            _assert_owns_memory(v, k)
        for s in (2, 3):  # the staging slot is reused by every save; the loaded tensors must not change
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            mgr.save(s, state)
            mgr.wait()
        second = mgr.load()
        assert second.step == 3
        for k, v in kept.items():
            assert_tensor_equal(first.state["model"][k], v, k)
            assert not torch.equal(second.state["model"][k], v) or v.numel() == 0, k
        # and a second load returns new tensors, not the first load's
        again = mgr.load(step=1)
        for k, v in first.state["model"].items():
            assert again.state["model"][k].data_ptr() != v.data_ptr()
            again.state["model"][k].add_(1)  # writable, and changing it leaves the first load's alone
            assert_tensor_equal(v, kept[k], k)


# ------------------------------------------------------------------------------------------------ dtypes, ties
class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_bfloat16_zero_dim_empty_generator_and_tied_tensors(tmp_path) -> None:
    shared = torch.randn(6, 5)
    net = _Tied()
    gen = torch.Generator().manual_seed(11)
    state = {
        "bf": (torch.randn(5, 3) * 1e3).to(torch.bfloat16),
        "zero_dim": torch.tensor(2.5, dtype=torch.float64),
        "zero_dim_int": torch.tensor(-(2**62)),
        "empty": torch.empty(0, 4),
        "tied_a": shared,
        "tied_b": shared,
        "net": net,
        "npscalar": np.float32(1.5),
        "np_bool": np.array([True, False, True]),
        "gen": gen,
        "misc": [torch.float16, torch.device("cpu"), torch.Size([2, 3]), b"\x00\xff", {1, 2}, -0.0, float("inf")],
    }
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(1, state)
        got = mgr.load().state
    assert_tensor_equal(got["bf"], state["bf"], "bf")
    assert got["zero_dim"].shape == () and got["zero_dim"].item() == 2.5
    assert_tensor_equal(got["zero_dim_int"], state["zero_dim_int"], "zero_dim_int")
    assert got["empty"].shape == (0, 4) and got["empty"].dtype == torch.float32
    # one tensor saved under two keys comes back as one tensor object under both (ties survive)
    assert got["tied_a"] is got["tied_b"]
    assert_tensor_equal(got["tied_a"], shared, "tied")
    assert got["net"]["emb.weight"] is got["net"]["head.weight"]
    assert_tensor_equal(got["net"]["emb.weight"], net.emb.weight.detach(), "net")
    assert type(got["npscalar"]) is np.float32 and got["npscalar"] == np.float32(1.5)
    assert_array_equal(got["np_bool"], state["np_bool"])
    assert isinstance(got["gen"], torch.Generator)
    assert torch.equal(got["gen"].get_state(), gen.get_state())
    assert_tree_equal(got["misc"][3:], state["misc"][3:], "misc")
    assert got["misc"][:3] == [torch.float16, torch.device("cpu"), torch.Size([2, 3])]


# ------------------------------------------------------------------------------------------------ no pickle
def test_load_never_unpickles(tmp_path, s3_server, s3_bucket, monkeypatch) -> None:
    state, model, optim = _training_state()
    with CheckpointManager(tmp_path / "local", remote=f"{s3_bucket}/run",
                           storage_options=s3_server.storage_options()) as mgr:
        mgr.save(1, state)
        mgr.wait()
        calls: list[str] = []

        def refuse(name: str):
            def fn(*a, **k):
                calls.append(name)
                raise AssertionError(f"load called {name}")
            return fn

        class Unpickler:
            def __init__(self, *a, **k) -> None:
                refuse("pickle.Unpickler")()

        monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
        monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
        monkeypatch.setattr(pickle, "Unpickler", Unpickler)
        monkeypatch.setattr(torch, "load", refuse("torch.load"))
        monkeypatch.setattr(np, "load", refuse("np.load"))
        for kw in ({}, {"keys": ["optim"]}, {"source": "remote"}, {"source": "remote", "keys": ["model"]}):
            res = mgr.load(**kw)
            assert res.step == 1, kw
        assert_tree_equal(res.state["model"], model.state_dict(), "model")
        assert calls == []
        with pytest.raises(AssertionError):  # the patches are live
            pickle.loads(pickle.dumps(1))


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kw, match", [
    ({"step": -1}, "step"), ({"step": "3"}, "step"), ({"step": 2.0}, "step"), ({"step": True}, "step"),
    ({"source": "s3"}, "source"), ({"keys": "model"}, "keys"), ({"keys": [1]}, "keys"), ({"keys": []}, "keys"),
    ({"keys": {"model"}}, "keys"),
])
def test_bad_arguments(tmp_path, kw, match) -> None:
    with CheckpointManager(tmp_path / "local") as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2)}})
        with pytest.raises(ValueError, match=match):
            mgr.load(**kw)


def test_closed_manager_refuses(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path / "local")
    mgr.close()
    with pytest.raises(Exception, match="closed"):
        mgr.load()


# ------------------------------------------------------------------------------------------------ multi-rank
def test_multi_rank_load_on_one_rank_and_on_all(tmp_path) -> None:
    """Two gloo ranks save a state with sharded and replicated DTensors; rank 0 alone loads (a collective would hang
    it until the collective timeout), then both load; each gets its own shard."""
    from tests._support.ranks import assert_all_ok, rank_env, run_ranks

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"root": str(tmp_path), "store": f"file://{tmp_path}/pg-store"}))
    ranks = run_ranks(lambda r: [str(Path(__file__).resolve()), str(r), str(cfg)], 2, tmp_path, "load",
                      env=rank_env(), timeout=150)
    assert_all_ok(ranks, "load", 150)
    full = _dist_full()
    for rank in (0, 1):
        for phase in (["alone"] if rank == 0 else []) + ["all", "keys", "remote"]:
            rec = ranks.phase(rank, phase)
            rows = slice(0, 5) if rank == 0 else slice(5, 9)
            assert rec["step"] == 2, (rank, phase)
            assert rec["w"] == full["w"][rows].tolist(), (rank, phase)
            assert rec["own"] == [rank * 10 + 2] * 3, (rank, phase)
            # a replicated DTensor is stored by rank 0 only
            assert rec["rep"] == (full["rep"].tolist() if rank == 0 else None), (rank, phase)
            assert rec["seconds"] < 20, (rank, phase)


def _dist_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {"w": torch.randn(9, 3, generator=g), "rep": torch.randn(4, generator=g)}


def _rank_main(rank: int, cfg_path: Path) -> None:  # pragma: no cover - runs in the rank processes
    import datetime
    import time
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cfg = json.loads(cfg_path.read_text())
    root = Path(cfg["root"])
    dist.init_process_group("gloo", init_method=cfg["store"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    out = root / f"result-load-r{rank}.json"

    def record(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            res = fn()
            m = res.state["model"]
            results[name] = {"step": res.step, "w": m["w"].tolist(), "own": m["own"].tolist(),
                             "rep": None if m["rep"] is None else m["rep"].tolist(),
                             "seconds": time.monotonic() - t0}
        except Exception as exc:
            results[name] = {"phase_error": repr(exc), "traceback": traceback.format_exc()}
        out.write_text(json.dumps(results))

    mesh = init_device_mesh("cpu", (2,))
    full = _dist_full()
    with CheckpointManager(root / f"node{rank}", remote=str(root / "remote"), collective_timeout_s=30) as mgr:
        for step in (1, 2):
            state = {"model": {"w": distribute_tensor(full["w"], mesh, [Shard(0)]),
                               "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
                               "own": torch.full((3,), rank * 10 + step)},
                     "meta": {"rank": rank}}
            mgr.save(step, state)
        mgr.wait()
        dist.barrier()
        # rank 0 loads alone while rank 1 only polls a file (in no collective call at all): a collective in load,
        # on any group, would hang rank 0 until the gloo timeout
        done = root / "alone-done"
        if rank == 0:
            record("alone", lambda: mgr.load())
            done.write_text("1")
        else:
            deadline = time.monotonic() + 60
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        dist.barrier()
        record("all", lambda: mgr.load())
        record("keys", lambda: mgr.load(step=2, keys=["model"]))
        record("remote", lambda: mgr.load(source="remote"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # pragma: no cover - one rank of test_multi_rank_load_on_one_rank_and_on_all
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _rank_main(int(sys.argv[1]), Path(sys.argv[2]))
