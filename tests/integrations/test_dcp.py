"""tierckpt as the storage of torch.distributed.checkpoint (tierckpt/dcp/).

Single process first (DCP without a process group), then real gloo jobs (tests/integrations/_dcp_worker.py) with an
FSDP2 model and its optimizer through get_state_dict/set_state_dict: 2 ranks save and load, then a 4-rank save loaded
on 2.
"""

from __future__ import annotations

import json
import secrets
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

import tierckpt
import tierckpt.dcp as tdcp
from tests._support.ranks import REPO_ROOT, assert_all_ok, rank_env, run_ranks
from tierckpt import cli
from tierckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore")]

TESTS_DIR = Path(__file__).resolve().parent
WORKER = TESTS_DIR / "_dcp_worker.py"


# ------------------------------------------------------------------------------------------------ helpers
def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, opt, seed)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(500 + seed)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, epoch: int = 0) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": epoch, "name": "run", "blob": b"\x00\x01"}}


def snapshot(state: Any) -> Any:
    """A deep copy of every tensor and value (to compare after later training steps change the live state)."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    else:
        assert a == b, path


def load_into_fresh(mgr: tierckpt.CheckpointManager, step_: int | None = None) -> tuple[int | None, dict]:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = make(seed=99)
    state = state_of(model, opt, epoch=-1)
    state["extra"] = {"epoch": -1, "name": "", "blob": b""}
    reader = tdcp.StorageReader(mgr, step=step_)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return reader.loaded_step, snapshot(state_of(model, opt, epoch=state["extra"]["epoch"]) | {"extra": state["extra"]})


def failure(exc: CheckpointException) -> BaseException:
    """The exception a rank raised inside DCP's CheckpointException."""
    (err, _tb), = exc.failures.values()
    return err


def data_files(root: Path, step_: int) -> list[Path]:
    return sorted((root / f"step-{step_:010d}").glob("r*-p*.safetensors"))


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte is a tensor byte (the header is padded to 4096)
    path.write_bytes(bytes(data))


@pytest.fixture
def mgr(tmp_path: Path):
    m = tierckpt.CheckpointManager(tmp_path / "local", keep_local=5)
    yield m
    m.close()


# ------------------------------------------------------------------------------------------------ single process
def test_roundtrip_model_optimizer(mgr: tierckpt.CheckpointManager) -> None:
    model, opt = make(seed=1)
    state = state_of(model, opt, epoch=7)
    want = snapshot(state)
    md = dcp.save(state, storage_writer=tdcp.StorageWriter(mgr, 5))
    assert all(isinstance(r, tdcp.Record) and r.rank == 0 for r in md.storage_data.values())
    assert [s.step for s in mgr.steps()] == [5]
    got_step, got = load_into_fresh(mgr)
    assert got_step == 5
    assert_same(want, got)
    # what is stored: plain records under "dcp", the metadata as JSON text on the coordinator, nothing pickled
    saved = mgr.load(5).state
    assert set(saved) == {"dcp", "dcp_metadata"}
    assert isinstance(saved["dcp"]["b:extra.blob"], bytes)
    assert isinstance(saved["dcp"]["t:0,0:model.0.weight"], torch.Tensor)
    doc = json.loads(saved["dcp_metadata"])
    assert doc["format"] == "tierckpt.dcp" and doc["state_dict_metadata"]["extra.epoch"] == {"type": "bytes"}
    assert doc["planner_data"]["model.0.weight"] == ["model", "0.weight"]


def test_metadata_json_roundtrip_and_refusals() -> None:
    model, opt = make(seed=2)
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state_of(model, opt), is_coordinator=True)
    plans, md = planner.create_global_plan([planner.create_local_plan()])
    records = {it.index: tdcp.Record(0, tdcp.storage_key(it.index)) for it in plans[0].items}
    back = tdcp.metadata_from_json(tdcp.metadata_to_json(md, records))
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data
    assert back.storage_data == records
    with pytest.raises(ValueError, match="planner_data"):
        tdcp.metadata_to_json(Metadata({"x": BytesStorageMetadata()}, planner_data={"x": object()}), {})
    with pytest.raises(CorruptCheckpointError):
        tdcp.metadata_from_json('{"format": "other"}')
    # keys are injective: a tensor chunk and a byte item never collide, whatever the fqn holds
    assert tdcp.storage_key(MetadataIndex("a", [0])) != tdcp.storage_key(MetadataIndex("t:0:a"))


def test_async_save_with_stager_back_to_back(mgr: tierckpt.CheckpointManager) -> None:
    model, opt = make(seed=3)
    stager = tdcp.Stager(mgr)
    expected, futures, ptrs = {}, [], []
    for s in (10, 20, 30):
        step(model, opt, s)
        state = state_of(model, opt, epoch=s)
        expected[s] = snapshot(state)
        resp = dcp.async_save(state, storage_writer=tdcp.StorageWriter(mgr, s), async_stager=stager)
        futures.append(getattr(resp, "upload_completion", resp))
        ptrs.append(stager._buffers[("model", "0.weight")].data_ptr())
        with torch.no_grad():  # the training thread changes the live tensors at once: the staged copy is unaffected
            for p in model.parameters():
                p.add_(1000.0)
    for f in futures:
        f.result(timeout=60)
    assert len(set(ptrs)) == 1, "the stager reuses one buffer per tensor across saves"
    stager.close()
    assert [s.step for s in mgr.steps()] == [10, 20, 30]
    for s in (10, 20, 30):
        got_step, got = load_into_fresh(mgr, s)
        assert got_step == s
        assert_same(expected[s], got)


def test_stager_survives_a_failed_async_save(mgr: tierckpt.CheckpointManager) -> None:
    model, opt = make(seed=10)
    stager = tdcp.Stager(mgr)
    ok = dcp.async_save(state_of(model, opt), storage_writer=tdcp.StorageWriter(mgr, 5), async_stager=stager)
    again = dcp.async_save(state_of(model, opt), storage_writer=tdcp.StorageWriter(mgr, 5), async_stager=stager)
    getattr(ok, "upload_completion", ok).result(timeout=60)
    with pytest.raises(CheckpointException) as info:  # step 5 again: mgr.save refuses it, in the save thread
        getattr(again, "upload_completion", again).result(timeout=60)
    assert isinstance(failure(info.value), CheckpointError)
    bad = dcp.async_save(state_of(model, opt), checkpoint_id="/nowhere/latest",  # refused by reset(), first thing
                         storage_writer=tdcp.StorageWriter(mgr, 6), async_stager=stager)
    with pytest.raises(ValueError, match="checkpoint_id"):
        getattr(bad, "upload_completion", bad).result(timeout=60)
    step(model, opt, 6)
    want = snapshot(state_of(model, opt))
    last = dcp.async_save(state_of(model, opt), storage_writer=tdcp.StorageWriter(mgr, 6), async_stager=stager)
    getattr(last, "upload_completion", last).result(timeout=60)
    assert [s.step for s in mgr.steps()] == [5, 6]
    assert_same(want["model"], load_into_fresh(mgr, 6)[1]["model"])


def test_step_exact_and_missing(mgr: tierckpt.CheckpointManager) -> None:
    model, opt = make(seed=4)
    first = snapshot(state_of(model, opt, epoch=1))
    dcp.save(state_of(model, opt, epoch=1), storage_writer=tdcp.StorageWriter(mgr, 1))
    step(model, opt, 2)
    dcp.save(state_of(model, opt, epoch=2), storage_writer=tdcp.StorageWriter(mgr, 2))
    got_step, got = load_into_fresh(mgr, 1)
    assert got_step == 1
    assert_same(first, got)
    with pytest.raises(CheckpointException) as info:
        load_into_fresh(mgr, 3)
    assert isinstance(failure(info.value), CheckpointNotFoundError)
    assert failure(info.value).step == 3


def test_checkpoint_id_path_names_the_step(mgr: tierckpt.CheckpointManager, tmp_path: Path) -> None:
    """torchtitan passes checkpoint_id="<folder>/step-<N>" with the writer: DCP hands it to reset(), which takes N."""
    model, opt = make(seed=9)
    want = snapshot(state_of(model, opt))
    dcp.save(state_of(model, opt), checkpoint_id=str(tmp_path / "ck" / "step-42"),
             storage_writer=tdcp.StorageWriter(mgr, 0))
    assert [s.step for s in mgr.steps()] == [42]
    state = state_of(*make(seed=97))
    reader = tdcp.StorageReader(mgr)
    dcp.load(state, checkpoint_id=str(tmp_path / "ck" / "step-42"), storage_reader=reader)
    assert reader.loaded_step == 42
    assert torch.equal(state["model"]["0.weight"], want["model"]["0.weight"])
    with pytest.raises(ValueError, match="checkpoint_id"):
        tdcp.StorageWriter(mgr, 0).reset("/somewhere/latest")


def test_empty_root_and_foreign_step(mgr: tierckpt.CheckpointManager) -> None:
    with pytest.raises(CheckpointException) as info:
        load_into_fresh(mgr)
    assert isinstance(failure(info.value), CheckpointNotFoundError)
    mgr.save(4, {"w": torch.ones(3)}).persisted.result()
    with pytest.raises(CheckpointException) as info:
        load_into_fresh(mgr, 4)
    err = failure(info.value)
    assert isinstance(err, CheckpointError) and "not saved through tierckpt.dcp" in str(err)


def test_corrupt_local_copy_loads_from_remote(tmp_path: Path) -> None:
    with tierckpt.CheckpointManager(tmp_path / "local", remote=str(tmp_path / "r")) as m:
        model, opt = make(seed=5)
        want = snapshot(state_of(model, opt, epoch=5))
        dcp.save(state_of(model, opt, epoch=5), storage_writer=tdcp.StorageWriter(m, 5))
        m.wait()
        for f in data_files(tmp_path / "local", 5):
            flip(f)
        got_step, got = load_into_fresh(m)
        assert got_step == 5
        assert_same(want, got)
        # without verifying first, each record is still checked when read, and read from the remote instead
        reader_state = state_of(*make(seed=98))
        dcp.load(reader_state, storage_reader=tdcp.StorageReader(m, verify=False))
        assert torch.equal(reader_state["model"]["0.weight"], want["model"]["0.weight"])


def test_corrupt_newest_step_loads_previous_and_verify_cli(mgr: tierckpt.CheckpointManager) -> None:
    root = Path(mgr.local.root)
    model, opt = make(seed=6)
    first = snapshot(state_of(model, opt, epoch=1))
    dcp.save(state_of(model, opt, epoch=1), storage_writer=tdcp.StorageWriter(mgr, 1))
    step(model, opt, 2)
    dcp.save(state_of(model, opt, epoch=2), storage_writer=tdcp.StorageWriter(mgr, 2))
    assert [s.step for s in mgr.steps()] == [1, 2]
    assert cli.main(["verify", str(root)]) == 0
    flip(data_files(root, 2)[0])
    assert cli.main(["verify", str(root)]) == 1
    got_step, got = load_into_fresh(mgr)
    assert got_step == 1
    assert_same(first, got)
    with pytest.raises(CheckpointException) as info:
        load_into_fresh(mgr, 2)
    assert isinstance(failure(info.value), CorruptCheckpointError)


def test_writer_refuses_without_collectives(mgr: tierckpt.CheckpointManager) -> None:
    model, opt = make(seed=8)
    import inspect

    if "use_collectives" not in inspect.signature(dcp.save).parameters:
        pytest.skip("this torch has no use_collectives")
    with pytest.raises(BaseException, match="use_collectives"):
        dcp.save(state_of(model, opt), storage_writer=tdcp.StorageWriter(mgr, 1), use_collectives=False)


# ------------------------------------------------------------------------------------------------ gloo ranks
def launch(name: str, scenario: str, world: int, root: Path, local: Path, remote: Path,
           timeout: float = 120) -> list[dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    cfg = {"world": world, "root": str(root), "name": name, "local": str(local), "remote": str(remote),
           "store": f"file://{root}/store-{name}-{secrets.token_hex(4)}"}
    cfg_path = root / f"config-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    ranks = run_ranks(lambda r: [str(WORKER), scenario, str(r), str(cfg_path)], world, root, name,
                      env=rank_env(), timeout=timeout)
    assert_all_ok(ranks, name, timeout)
    skip = ("done", "init_s", "seconds")
    return [{k: ranks.phase(r, k) for k in ranks.results[r] if k not in skip} for r in range(world)]


def _compare(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    for key, want in saved.items():
        key_loaded = key
        assert key_loaded in loaded, key
        got = loaded[key_loaded]
        if isinstance(want, list):
            assert torch.allclose(torch.tensor(want, dtype=torch.float64), torch.tensor(got, dtype=torch.float64),
                                  rtol=0, atol=0), key
        else:
            assert got == want, key


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 2), (4, 2)], ids=["fsdp2-2to2", "fsdp2-4to2"])
def test_fsdp2_save_load(tmp_path: Path, save_world: int, load_world: int) -> None:
    warnings.filterwarnings("ignore")
    local, remote = tmp_path / "node", tmp_path / "remote"
    saved = launch("save", "save", save_world, tmp_path, local, remote)
    for rec in saved:
        assert rec["steps"] == [10, 20, 30, 40]
    assert saved[0]["sync_save"] == saved[-1]["sync_save"]  # full tensors: the same on every rank
    loaded = launch("load", "load", load_world, tmp_path, local, remote)
    for rec in loaded:
        assert rec["load_newest"]["step"] == 40
        _compare(saved[0]["async_saves"]["40"], rec["load_newest"]["state"])
        assert rec["load_10"]["step"] == 10
        _compare(saved[0]["sync_save"], rec["load_10"]["state"])
        assert rec["load_after_corruption"]["step"] == 30
        _compare(saved[0]["async_saves"]["30"], rec["load_after_corruption"]["state"])
    assert cli.main(["verify", str(remote)]) == 1  # step 40 was damaged on purpose


@pytest.mark.parametrize("point", ["mid-file", "before-manifest"])
def test_a_step_killed_mid_save_is_never_chosen(tmp_path: Path, point: str) -> None:
    """A process SIGKILLed while ``dcp.save`` writes step 2 (before its manifest is durable) leaves no checkpoint
    of step 2: the next ``dcp.load`` (newest) loads step 1, and asking for step 2 raises. (Killed after the manifest
    is durable, the step is complete: start-up recovery commits it, and it loads whole.)"""
    import os
    import signal

    from tests._support.procs import run_python

    root = tmp_path / "root"
    env = {**os.environ, "TIERCKPT_FAULT": f"{point}:2", "PYTHONPATH": str(REPO_ROOT)}
    proc = run_python([str(TESTS_DIR / "_dcp_kill.py"), str(root)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    with tierckpt.CheckpointManager(root, keep_local=5) as m:
        state = {"w": torch.zeros(4096), "b": torch.zeros(10, dtype=torch.int64)}
        reader = tdcp.StorageReader(m)
        dcp.load(state, storage_reader=reader)
        assert reader.loaded_step == 1
        assert torch.equal(state["w"], torch.full((4096,), 1.0)) and torch.equal(state["b"], torch.arange(10) + 1)
        assert [s.step for s in m.steps()] == [1]
        with pytest.raises(CheckpointException) as ei:
            dcp.load(state, storage_reader=tdcp.StorageReader(m, step=2))
        assert isinstance(failure(ei.value), CheckpointNotFoundError)
