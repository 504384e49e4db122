"""``tierckpt export`` / :func:`tierckpt.export.export_weights`: a checkpoint's model weights as safetensors files
that Hugging Face ``from_pretrained`` reads.

A tiny GPT-2 (from a config, no download) trains a few seeded AdamW steps, each step saved with its optimizer under
tierckpt (local tier plus a POSIX remote); the exports are read back with ``GPT2LMHeadModel.from_pretrained`` and
must give bit-identical logits. Also: sharding with the index file, ``--dtype``, the error exit codes, the remote
tier, and a 2-rank DTensor/FSDP2 checkpoint exported as full tensors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import tierckpt
from tests._support.lazy import lazy, requires
from tests._support.procs import run_python
from tests._support.ranks import assert_all_ok, rank_env, run_ranks
from tierckpt.cli import main
from tierckpt.export import ExportError, export_weights, parse_size
from tierckpt.storage.local import LocalStore
from tierckpt.testing.netfaults import refused_url
from tierckpt.tiers.reader import read_manifests

GPT2Config = lazy("transformers", "GPT2Config")
GPT2LMHeadModel = lazy("transformers", "GPT2LMHeadModel")

pytestmark = [pytest.mark.timeout(180), requires("transformers")]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = (1, 2, 3)


def _config() -> Any:
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32)


def _input() -> torch.Tensor:
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(_input()).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A GPT-2 trained 3 steps, each saved (model + optim + step) with a remote tier; the logits of each step's
    weights and a copy of each step's state_dict."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one tensor under two names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    logits, states = {}, {}
    with tierckpt.CheckpointManager(root / "local", remote=str(root / "r"), keep_local=3) as mgr:
        for step in STEPS:
            model.train()
            ids = torch.randint(0, 101, (4, 16), generator=gen)
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model, "optim": opt, "step": step})
            logits[step] = _logits(model)
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return {"root": root, "local": root / "local", "remote": root / "r", "logits": logits, "states": states}


def _run(capsys: pytest.CaptureFixture[str], args: list[Any]) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _from_pretrained(out_dir: Path) -> Any:
    _config().save_pretrained(out_dir)
    return GPT2LMHeadModel.from_pretrained(out_dir)


def _headers(out_dir: Path) -> dict[str, dict[str, Any]]:
    """name -> {"file", "dtype", "metadata"} of every tensor in the folder's safetensors files."""
    found: dict[str, dict[str, Any]] = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in list(st.keys()):
                assert name not in found, f"{name} in both {found[name]['file']} and {f.name}"
                found[name] = {"file": f.name, "dtype": st.get_slice(name).get_dtype(), "metadata": st.metadata()}
    return found


def _flip_byte(root: Path, step: int, tensor_path: str) -> str:
    """Flip one byte inside the saved bytes of the tensor at ``tensor_path``; returns its data file's name."""
    _, (rm,) = read_manifests(LocalStore(root), step)
    rec = next((t for t in rm.tensors if t.path == tensor_path), None)
    assert rec is not None, [t.path for t in rm.tensors]
    name = rm.files[rec.file].name
    path = root / f"step-{step:010d}" / name
    raw = bytearray(path.read_bytes())
    raw[rec.offset + rec.nbytes // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return name


# ------------------------------------------------------------------------------------------ 1. from_pretrained
def test_cli_export_loads_in_from_pretrained_with_identical_logits(trained: dict[str, Any], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    rc, stdout, err = _run(capsys, ["export", trained["local"], "--step", 3, "--key", "model", out])
    assert rc == 0, stdout + err
    assert "step 3" in stdout
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # small: one file, no index
    heads = _headers(out)
    # every state_dict name, the tied pair both present (from_pretrained ties them again)
    assert sorted(heads) == sorted(trained["states"][3])
    meta = heads["lm_head.weight"]["metadata"]
    assert meta == {"format": "pt", "tierckpt_step": "3", "tierckpt_source": LocalStore(trained["local"]).url}
    loaded = _from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert torch.equal(_logits(loaded), trained["logits"][3])


def test_subprocess_export_newest_step_and_explicit_older_step(trained: dict[str, Any], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m tierckpt.cli export`` without --step exports the newest step; --step 2 exports step 2's weights
    (not the newest's)."""
    out = tmp_path / "newest"
    proc = run_python(["-m", "tierckpt.cli", "export", str(trained["local"]), str(out)], timeout=120, cwd=REPO_ROOT,
                      env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 3" in proc.stdout
    assert torch.equal(_logits(_from_pretrained(out)), trained["logits"][3])
    older = tmp_path / "older"
    rc, stdout, err = _run(capsys, ["export", trained["local"], "--step", "2", older])
    assert rc == 0, stdout + err
    got = _logits(_from_pretrained(older))
    assert torch.equal(got, trained["logits"][2]) and not torch.equal(got, trained["logits"][3])


# ------------------------------------------------------------------------------------------------ 2. sharding
def test_small_max_shard_size_writes_an_index_and_still_loads(trained: dict[str, Any], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sharded"
    rc, stdout, err = _run(capsys, ["export", trained["local"], "--step", 3, out, "--max-shard-size", "20KB"])
    assert rc == 0, stdout + err
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    heads = _headers(out)  # asserts every name is in one file only
    states = trained["states"][3]
    assert sorted(index["weight_map"]) == sorted(heads) == sorted(states)
    assert all(index["weight_map"][k] == h["file"] for k, h in heads.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in states.values())
    for f in files:  # each file within the limit unless it holds one tensor larger than it
        with safe_open(str(out / f), "pt") as st:
            names = list(st.keys())
            size = sum(st.get_tensor(k).nbytes for k in names)
        assert size <= 20_000 or len(names) == 1, (f, size, names)
    assert torch.equal(_logits(_from_pretrained(out)), trained["logits"][3])
    # a second export into the same folder is refused, then replaces it with --overwrite (no stale shards left)
    rc, _, err = _run(capsys, ["export", trained["local"], "--step", 3, out])
    assert rc == 2 and "--overwrite" in err, err
    rc, _, err = _run(capsys, ["export", trained["local"], "--step", 3, out, "--overwrite"])
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(_logits(GPT2LMHeadModel.from_pretrained(out)), trained["logits"][3])


def test_parse_size_follows_hugging_face_units() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size("100") == 100 and parse_size(7) == 7
    for bad in ("0", "five", "5XB", "-1GB"):
        with pytest.raises(ExportError):
            parse_size(bad)


# ------------------------------------------------------------------------------------------------- 3. dtype
def test_dtype_bf16_casts_floating_tensors_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(3)
    net = torch.nn.Linear(4, 3)
    net.register_buffer("counts", torch.arange(5, dtype=torch.int64))
    net.register_buffer("mask", torch.tensor([True, False]))
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(1, {"model": net})
    out = tmp_path / "bf16"
    rc, stdout, err = _run(capsys, ["export", tmp_path / "ck", out, "--dtype", "bf16"])
    assert rc == 0, stdout + err
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        got = {k: st.get_tensor(k) for k in list(st.keys())}
    assert got["weight"].dtype == torch.bfloat16 and torch.equal(got["weight"], net.weight.detach().bfloat16())
    assert got["bias"].dtype == torch.bfloat16 and torch.equal(got["bias"], net.bias.detach().bfloat16())
    assert got["counts"].dtype == torch.int64 and torch.equal(got["counts"], net.counts)
    assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], net.mask)
    plain = export_weights(tmp_path / "ck", tmp_path / "plain")  # no dtype: as saved
    with safe_open(plain.files[0], "pt") as st:
        assert st.get_tensor("weight").dtype == torch.float32
        assert torch.equal(st.get_tensor("weight"), net.weight.detach())
    assert plain.step == 1 and plain.total_bytes == sum(t.nbytes for t in net.state_dict().values())


# ------------------------------------------------------------------------------------------------- 4. errors
def test_missing_step_and_missing_key_exit_2(trained: dict[str, Any], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, ["export", trained["local"], "--step", 99, tmp_path / "a"])
    assert rc == 2 and "99" in err, err
    rc, _, err = _run(capsys, ["export", trained["local"], "--step", 3, "--key", "ema", tmp_path / "b"])
    assert rc == 2, err
    assert "'ema'" in err and "'model'" in err and "'optim'" in err and "'step'" in err, err
    rc, _, err = _run(capsys, ["export", tmp_path / "no_such_root", tmp_path / "c"])
    assert rc == 2, err
    # a key that is not a mapping of tensors
    rc, _, err = _run(capsys, ["export", trained["local"], "--step", 3, "--key", "step", tmp_path / "d"])
    assert rc == 2 and "not a mapping of tensors" in err, err
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_corrupt_data_file_of_the_only_step_exits_1_naming_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(4)
    net = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    with tierckpt.CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(5, {"model": net, "optim": opt})
    name = _flip_byte(tmp_path / "ck", 5, "state['model']['weight']")
    for step_args in (["--step", "5"], []):
        rc, out, err = _run(capsys, ["export", tmp_path / "ck", tmp_path / "out", *step_args])
        assert rc == 1, out + err
        assert name in err, err
        assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_unreachable_remote_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, ["export", "s3://tierckpt-export/run", tmp_path / "out", "--step", "1",
                                 "--storage-option", f"client_kwargs.endpoint_url={refused_url()}",
                                 "--storage-option", "key=k", "--storage-option", "secret=s", "--timeout", "2"])
    assert rc == 3, out + err
    assert "s3://tierckpt-export/run" in err and not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------- 5. remote tier
def test_export_reads_the_remote_tier_when_the_local_is_gone_or_corrupt(trained: dict[str, Any], tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    remote_url = LocalStore(trained["remote"]).url
    # the remote root given directly
    out = tmp_path / "direct"
    rc, stdout, err = _run(capsys, ["export", trained["remote"], "--step", 3, out])
    assert rc == 0, stdout + err
    assert _headers(out)["lm_head.weight"]["metadata"]["tierckpt_source"] == remote_url
    assert torch.equal(_logits(_from_pretrained(out)), trained["logits"][3])
    # the local tier gone: the remote given with --remote is read
    out = tmp_path / "gone"
    rc, stdout, err = _run(capsys, ["export", tmp_path / "local_gone", out, "--remote", trained["remote"]])
    assert rc == 0, stdout + err
    assert _headers(out)["lm_head.weight"]["metadata"]["tierckpt_source"] == remote_url
    assert torch.equal(_logits(_from_pretrained(out)), trained["logits"][3])
    # a corrupt local copy: the remote's copy is read instead (without --remote the export fails)
    local = tmp_path / "local_copy"
    shutil.copytree(trained["local"], local)
    _flip_byte(local, 3, "state['model']['transformer.h.0.mlp.c_fc.weight']")
    rc, _, err = _run(capsys, ["export", local, "--step", 3, tmp_path / "bad"])
    assert rc == 1, err
    out = tmp_path / "fallback"
    rc, stdout, err = _run(capsys, ["export", local, "--step", 3, out, "--remote", trained["remote"]])
    assert rc == 0, stdout + err
    assert _headers(out)["lm_head.weight"]["metadata"]["tierckpt_source"] == remote_url
    assert torch.equal(_logits(_from_pretrained(out)), trained["logits"][3])


# ------------------------------------------------------------------------------------- 6. multi-rank (DTensor)
#: One rank of a 2-rank job (gloo through a FileStore): an FSDP2 model trained 2 steps and a DTensor dict (uneven
#: Shard(0), Shard(1) bf16, Replicate int64), committed at step 1 to a per-rank local tier and a shared remote; rank 0
#: writes the full tensors to ref.pt.
_WORKER = r'''
import datetime, os, sys
from pathlib import Path
import torch
import torch.distributed as dist

rank, world, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import tierckpt

mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.ReLU(), torch.nn.Linear(9, 5))
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(2):
    model(torch.randn(3, 6, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    opt.zero_grad()
g = torch.Generator().manual_seed(5)
full = {"w": torch.randn(9, 7, generator=g), "e": torch.randn(5, 11, generator=g).to(torch.bfloat16),
        "b": torch.arange(13, dtype=torch.int64)}
place = {"w": [Shard(0)], "e": [Shard(1)], "b": [Replicate()]}
dt = {k: distribute_tensor(v, mesh, place[k]) for k, v in full.items()}
ref = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()}, "dt": full}
if rank == 0:
    torch.save(ref, root / "ref.pt")
with tierckpt.CheckpointManager(root / f"node{rank}", remote=root / "remote", collective_timeout_s=60) as mgr:
    mgr.save(1, {"model": model, "optim": opt, "dt": dt})
    mgr.wait()
dist.barrier()
dist.destroy_process_group()
(root / f"result-job-r{rank}.json").write_text("{}")
os._exit(0)
'''


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export2")
    worker = root / "worker.py"
    worker.write_text(_WORKER)
    ranks = run_ranks(lambda r: [str(worker), str(r), "2", str(root)], 2, root, "job", env=rank_env(), timeout=120)
    assert_all_ok(ranks, "job", 120)
    return root


def test_multi_rank_dtensor_checkpoint_exports_full_tensors(two_ranks: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ref = torch.load(two_ranks / "ref.pt")
    _, rms = read_manifests(LocalStore(two_ranks / "remote"), 1)
    assert len(rms) == 2 and all(any(t.shard for t in rm.tensors) for rm in rms)  # really sharded on 2 ranks
    for key in ("model", "dt"):
        out = tmp_path / key
        rc, stdout, err = _run(capsys, ["export", two_ranks / "remote", "--step", 1, "--key", key, out])
        assert rc == 0, stdout + err
        with safe_open(str(out / "model.safetensors"), "pt") as st:
            got = {k: st.get_tensor(k) for k in list(st.keys())}
        assert sorted(got) == sorted(ref[key])  # the full names
        for k, v in ref[key].items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    # a node-local tier holds one rank's shards only: refused (exit 2), never a partial tensor; with the remote: ok
    rc, _, err = _run(capsys, ["export", two_ranks / "node0", "--step", 1, tmp_path / "partial"])
    assert rc == 2 and "holds the shards of ranks [0]" in err, err
    assert not (tmp_path / "partial").exists()
    rc, _, err = _run(capsys, ["export", two_ranks / "node0", tmp_path / "both", "--remote", two_ranks / "remote",
                               "--key", "dt"])
    assert rc == 0, err
    with safe_open(str(tmp_path / "both" / "model.safetensors"), "pt") as st:
        assert torch.equal(st.get_tensor("w"), ref["dt"]["w"])


def test_multi_rank_shard_damage_is_corruption_not_a_wrong_file(two_ranks: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    remote = tmp_path / "remote"
    shutil.copytree(two_ranks / "remote", remote)
    _, rms = read_manifests(LocalStore(remote), 1)
    rec = next(t for t in rms[1].tensors if t.path == "state['dt']['w']")
    name = rms[1].files[rec.file].name
    path = remote / "step-0000000001" / name
    raw = bytearray(path.read_bytes())
    raw[rec.offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    rc, _, err = _run(capsys, ["export", remote, "--key", "dt", tmp_path / "out"])
    assert rc == 1 and name in err, err
    assert not (tmp_path / "out").exists()
