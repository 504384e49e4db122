"""Resharding: DTensor and FSDP2 state saved on 2 ranks, restored onto 1 process, 3 ranks and 4 ranks (1-D and 2-D
meshes, other placements than saved), bit-exact; replicated data stored once; and the error paths (global shape
mismatch, a damaged shard of one rank in the remote, per-rank state onto another world size).

Three multi-process jobs run (``tests/distributed/_reshard_worker.py``, gloo through a FileStore, one "node" folder
per rank and a shared POSIX remote): ``save2`` (2 ranks), then ``load4`` (4 ranks) and ``load3`` (3 ranks). Each job
runs many checks in one spawn (torch imports dominate the cost) and records per phase what every rank saw; the tests
assert on those records. Single-process restores run in the test process itself (no process group), against a
pristine copy of the remote taken right after ``save2`` (``load4`` damages the original at its end).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tests._support.ranks import Ranks, assert_all_ok, rank_env, run_ranks
from tests.distributed._reshard_worker import (
    M2_SAVE_PLACEMENTS,
    damage_rank1,
    dt_full,
    fsdp_model,
    m2_full,
    same,
)
from tierckpt.errors import CorruptCheckpointError, StateMismatchError
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.reader import read_manifests

pytestmark = [pytest.mark.timeout(240)]

TESTS_DIR = Path(__file__).resolve().parent
WORKER = TESTS_DIR / "_reshard_worker.py"
DT_KEYS = ("w", "e", "b", "r", "i")


# ------------------------------------------------------------------------------------------------ jobs
Run = Ranks  # one job's outcome (tests/_support/ranks.py)


def launch(name: str, world: int, root: Path, timeout: float = 150) -> Run:
    """Start ``world`` ranks of job ``name`` and wait for all (killing them all past ``timeout``)."""
    ranks = run_ranks(lambda r: [str(WORKER), name, str(r), str(world), str(root)], world, root, name,
                      env=rank_env(), timeout=timeout)
    assert_all_ok(ranks, name, timeout)
    return ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch("save2", 2, tmp_path_factory.mktemp("reshard"))


@pytest.fixture(scope="module")
def load4(saved: Run) -> Run:
    return launch("load4", 4, saved.root)


@pytest.fixture(scope="module")
def load3(saved: Run) -> Run:
    return launch("load3", 3, saved.root)


def single(root: Path, local: str, remote: str) -> tierckpt.CheckpointManager:
    """A one-process manager (no process group, whatever else the test session initialised)."""
    return tierckpt.CheckpointManager(root / local, remote=root / remote, rank=0, world_size=1)


def fsdp_or_skip(saved: Run, variant: str) -> dict[str, Any]:
    recs = saved.phases(f"{variant}_save")
    if "unsupported" in recs[0]:
        pytest.skip(recs[0]["unsupported"])
    return torch.load(saved.root / f"{variant}_ref.pt", weights_only=False)


def assert_all_exact(recs: list[dict[str, Any]], keys: Any, *, step: int) -> None:
    for r, rec in enumerate(recs):
        assert rec["restored"] == step, f"rank {r}: {rec}"
        for k in keys:
            assert rec["keys"][k] == {"exact": True, "placements_kept": True}, f"rank {r}, key {k}: {rec['keys'][k]}"


def rank_manifests(store_dir: Path, step: int) -> dict[int, Any]:
    _m, rms = read_manifests(LocalStore(store_dir, tier="remote"), step, ranks=None)
    return {rm.rank: rm for rm in rms}


# ---------------------------------------------------------------------------------------------- 1. DTensor 2 -> 1, 4, 3
def test_dtensor_two_ranks_to_one_process_plain_tensors(saved: Run, tmp_path: Path) -> None:
    for step in (2, 1):
        st = {"model": {k: torch.zeros_like(v) for k, v in dt_full(step).items()}, "step": 0}
        with single(saved.root, f"single_dt{step}", "remote_pristine") as m:
            got = m.restore(st, step=None if step == 2 else step)
        assert got == step and st["step"] == step
        for k, ref in dt_full(step).items():
            assert type(st["model"][k]) is torch.Tensor
            assert same(st["model"][k], ref), f"step {step}, key {k}: not bit-exact"


def test_dtensor_two_ranks_to_four_ranks_other_placements(load4: Run) -> None:
    recs = load4.phases("dt_1d")
    assert_all_exact(recs, DT_KEYS, step=2)
    assert [r["step_value"] for r in recs] == [2] * 4


def test_dtensor_two_ranks_to_four_ranks_2d_mesh(load4: Run) -> None:
    recs = load4.phases("dt_2d")
    assert_all_exact(recs, DT_KEYS, step=2)


def test_reshard_reads_only_the_manifests_of_the_ranks_whose_shards_overlap(load4: Run) -> None:
    # saved as Shard(0) on 4 ranks, restored as (Shard(0), Replicate) on a (2, 2) mesh: rank r = 2i + j needs the
    # rows saved by ranks 2i and 2i + 1, and the step manifest's mesh index says which those are
    for rank, rec in enumerate(load4.phases("index_reads")):
        assert rec["restored"] == 1 and rec["exact"], rec
        i = rank // 2
        assert rec["other_ranks_read"] == sorted({2 * i, 2 * i + 1} - {rank}), (rank, rec)


def test_dtensor_two_ranks_to_three_ranks_uneven(load3: Run) -> None:
    recs = load3.phases("dt_3")
    assert_all_exact(recs, DT_KEYS, step=2)
    assert [r["step_value"] for r in recs] == [2] * 3


def test_dtensor_restore_onto_empty_local_shard(load4: Run) -> None:
    assert_all_exact(load4.phases("dt_empty_target"), DT_KEYS, step=2)


def test_dtensor_saved_on_2d_mesh(load4: Run, tmp_path: Path) -> None:
    """Saved by the 4-rank job on a (2, 2) mesh; restored there onto a 1-D mesh, and here into plain tensors."""
    assert_all_exact(load4.phases("m2_save"), M2_SAVE_PLACEMENTS, step=5)
    rms = rank_manifests(load4.root / "m2_remote", 5)
    writers = {k: sorted(r for r, rm in rms.items() if any(t.path == f"state['t'][{k!r}]" for t in rm.tensors))
               for k in M2_SAVE_PLACEMENTS}
    # rank r sits at mesh coordinate (r // 2, r % 2); only coordinate 0 on Replicate dims writes
    assert writers == {"a": [0, 2], "c": [0, 1], "d": [0], "f": [0, 1, 2, 3]}
    st = {"t": {k: torch.zeros_like(v) for k, v in m2_full().items()}}
    with single(load4.root, "single_m2", "m2_remote") as m:
        assert m.restore(st) == 5
    for k, ref in m2_full().items():
        assert same(st["t"][k], ref), k


# ------------------------------------------------------------------------------------------------ 2. replicated once
def test_replicated_tensor_stored_once(saved: Run, load4: Run) -> None:
    for step in (1, 2):
        rms = rank_manifests(saved.root / "remote_pristine", step)
        assert sorted(rms) == [0, 1]
        paths = {r: {t.path for t in rm.tensors} for r, rm in rms.items()}
        assert "state['model']['b']" in paths[0]
        assert "state['model']['b']" not in paths[1]
        for k in ("w", "e", "r", "i"):  # sharded keys: each rank holds its shard
            assert all(f"state['model'][{k!r}]" in paths[r] for r in (0, 1)), k
        # every key's saved shards add up to the global tensor exactly once
        for k, ref in dt_full(step).items():
            stored = sum(t.nbytes for rm in rms.values() for t in rm.tensors if t.path == f"state['model'][{k!r}]")
            assert stored == ref.numel() * ref.element_size(), k
        b = next(t for t in rms[0].tensors if t.path == "state['model']['b']")
        assert b.shard is not None and b.shard["offset"] == [0] and b.shard["global_shape"] == [13]
    # and every rank of the 4-rank job got its piece of the replicated tensor (placed as Shard(0) there)
    for r, rec in enumerate(load4.phases("dt_1d")):
        assert rec["keys"]["b"]["exact"], r


# ------------------------------------------------------------------------------------------------ 3. FSDP2
def _fsdp_target(ref: dict[str, Any], variant: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    model = fsdp_model(uneven=variant == "fsdpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optim = {"state": {fqn: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                       for fqn, s in ref["optim"]["state"].items()},
             "param_groups": [dict(g, lr=0.0) for g in ref["optim"]["param_groups"]]}
    return model, optim


@pytest.mark.parametrize("variant", ["fsdp", "fsdpu"])
def test_fsdp2_two_ranks_to_one_process(saved: Run, variant: str) -> None:
    ref = fsdp_or_skip(saved, variant)
    model, optim = _fsdp_target(ref, variant)
    st = {"model": model, "optim": optim}
    with single(saved.root, f"single_{variant}", f"{variant}_remote") as m:
        assert m.restore(st) == 3
    live = model.state_dict()
    assert sorted(live) == sorted(ref["model"])
    for k, v in ref["model"].items():
        assert same(live[k], v), k
    assert sorted(optim["state"]) == sorted(ref["optim"]["state"])
    for fqn, s in ref["optim"]["state"].items():
        assert sorted(s) == sorted(optim["state"][fqn]) and {"step", "exp_avg", "exp_avg_sq"} <= set(s)
        for k, v in s.items():
            assert same(optim["state"][fqn][k], v), f"{fqn}.{k}"
    assert optim["param_groups"] == ref["optim"]["param_groups"]
    # the restored full state drives a plain (non-distributed) AdamW: parameters as saved, moments as saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    opt.load_state_dict({"state": {i: optim["state"][n] for i, n in enumerate(names)},
                         "param_groups": [dict(g, params=list(range(len(names)))) for g in optim["param_groups"]]})
    assert same(opt.state[model[0].weight]["exp_avg"], ref["optim"]["state"]["0.weight"]["exp_avg"])


def _assert_fsdp_phase(recs: list[dict[str, Any]]) -> None:
    for r, rec in enumerate(recs):
        if "unsupported" in rec:
            pytest.skip(rec["unsupported"])
        assert rec["restored"] == 3, f"rank {r}: {rec}"
        assert rec["model_keys"] and rec["optim_keys"], f"rank {r}: {rec}"
        assert rec["model"] and all(rec["model"].values()), f"rank {r}: model {rec['model']}"
        kinds = {k.rsplit(".", 1)[1] for k in rec["optim"]}
        assert kinds == {"step", "exp_avg", "exp_avg_sq"}, kinds
        assert all(rec["optim"].values()), f"rank {r}: optimizer {rec['optim']}"
        assert rec["trains_on"], f"rank {r}"


def test_fsdp2_two_ranks_to_four_ranks(saved: Run, load4: Run) -> None:
    fsdp_or_skip(saved, "fsdp")
    _assert_fsdp_phase(load4.phases("fsdp_load"))


def test_fsdp2_uneven_two_ranks_to_four_ranks(saved: Run, load4: Run) -> None:
    fsdp_or_skip(saved, "fsdpu")
    _assert_fsdp_phase(load4.phases("fsdpu_load"))


# ------------------------------------------------------------------------------------------------ 4. errors
def test_global_shape_mismatch_names_key_on_every_rank(load4: Run) -> None:
    for r, rec in enumerate(load4.phases("dt_shape_mismatch")):
        assert rec["raised"] is not None and rec["raised"]["type"] == "StateMismatchError", f"rank {r}: {rec}"
        assert "state['model']['w']" in rec["raised"]["msg"] and "[9, 7]" in rec["raised"]["msg"], rec
        assert rec["untouched"], f"rank {r}: state changed by a refused restore"


def test_global_shape_mismatch_single_process(saved: Run) -> None:
    st = {"model": {k: torch.zeros_like(v) for k, v in dt_full(2).items()}, "step": 0}
    st["model"]["e"] = torch.zeros(5, 12, dtype=torch.bfloat16)
    with single(saved.root, "single_mismatch", "remote_pristine") as m, \
            pytest.raises(StateMismatchError, match=r"state\['model'\]\['e'\]"):
        m.restore(st)
    assert st["step"] == 0 and all(bool((v == 0).all()) for v in st["model"].values())


def test_damaged_rank1_shard_in_remote_falls_back_on_every_rank(load4: Run) -> None:
    recs = load4.phases("dt_damaged_falls_back")
    assert recs[0]["changed"], "rank 0 damaged nothing"
    assert_all_exact(recs, DT_KEYS, step=1)
    assert [r["step_value"] for r in recs] == [1] * 4


def test_damaged_every_step_same_error_on_every_rank(load4: Run) -> None:
    recs = load4.phases("dt_damaged_everywhere")
    assert recs[0]["changed"]
    for r, rec in enumerate(recs):
        assert rec["raised"] is not None, f"rank {r} restored {rec.get('returned')}"
        assert rec["raised"]["type"] == "CorruptCheckpointError", f"rank {r}: {rec['raised']}"
        assert rec["untouched"], f"rank {r}: state changed by a failed restore"
    # the same error everywhere (each names its own node-local folder among the tiers it tried)
    msgs = {rec["raised"]["msg"].replace(f"/node{r},", "/node*,") for r, rec in enumerate(recs)}
    assert len(msgs) == 1, f"ranks got different errors: {msgs}"
    assert "step 2:" in recs[0]["raised"]["msg"] and "step 1:" in recs[0]["raised"]["msg"]
    assert "r00001-" in recs[0]["raised"]["msg"]


def test_damaged_rank1_shard_single_process(saved: Run, tmp_path: Path) -> None:
    """Single-process twin: the same damage makes a 1-process restore fall back, then fail with a clear error."""
    shutil.copytree(saved.root / "remote_pristine", tmp_path / "remote")
    assert damage_rank1(tmp_path, "remote", 2)
    st = {"model": {k: torch.zeros_like(v) for k, v in dt_full(1).items()}, "step": 0}
    with single(tmp_path, "local", "remote") as m:
        assert m.restore(st) == 1
    assert all(same(st["model"][k], v) for k, v in dt_full(1).items())
    assert damage_rank1(tmp_path, "remote", 1)
    st = {"model": {k: torch.zeros_like(v) for k, v in dt_full(1).items()}, "step": 0}
    with single(tmp_path, "local2", "remote") as m, pytest.raises(CorruptCheckpointError, match="r00001-"):
        m.restore(st)
    assert st["step"] == 0 and all(bool((v == 0).all()) for v in st["model"].values())


def test_per_rank_state_refuses_other_world_sizes(saved: Run, load3: Run, load4: Run) -> None:
    for run in (load3, load4):
        for r, rec in enumerate(run.phases("plain_refused")):
            assert rec["raised"] is not None and rec["raised"]["type"] == "StateMismatchError", (
                f"{run.name} r{r}: {rec}")
            assert "resharded" in rec["raised"]["msg"], rec
            assert rec["untouched"], f"{run.name} rank {r}"
    st = {"w": torch.zeros(4), "n": -1}
    with single(saved.root, "single_plain", "plain_remote") as m, pytest.raises(StateMismatchError, match="resharded"):
        m.restore(st)
    assert st["n"] == -1 and bool((st["w"] == 0).all())


def test_strict_false_with_fewer_dtensor_keys(saved: Run) -> None:
    st = {"model": {"w": torch.zeros(9, 7)}, "step": 0}
    with single(saved.root, "single_nonstrict", "remote_pristine") as m:
        assert m.restore(st, strict=False) == 2
    full = dt_full(2)
    assert same(st["model"]["w"], full["w"])
    for k, v in st["model"].items():  # keys the state lacked: if added, as the full tensors
        assert same(v, full[k]), k
