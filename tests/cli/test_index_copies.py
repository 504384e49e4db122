"""Every complete copy of a multi-rank step carries a shard index of its own references: ``tierckpt sync`` writes
the remote's (moto S3: rank manifests there name fan-out data files, so their references differ from the local
ones), ``tierckpt pull`` the pulled copy's (re-sealed rank manifests), and a resharding read of the pulled copy
goes through it, reading only the rank manifests it needs. ``tierckpt verify`` reads a copy's index whole and
reports a damaged, cut or stale one (the exit code of a corrupt step, the file named, the repair said). The steps
are built by hand with the format modules (4 ranks, one shard each of a 1-D tensor split over a 4-rank mesh): no
rank is started."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tierckpt.cli import main as cli
from tierckpt.format import hashing, layout, shard_index
from tierckpt.format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from tierckpt.format.safetensors import build_header
from tierckpt.format.shards import mesh_index
from tierckpt.storage.base import join
from tierckpt.storage.commit import protocol_for, read_step_manifest
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.sharded import indexed_rank_manifests
from tierckpt.tiers.uploader import replicate_step
from tierckpt.tiers.verify import verify_step

WORLD, ROWS, STEP = 4, 16, 3
MESH = "4:dp"


def _mesh_step(store: LocalStore, step: int = STEP) -> StepManifest:
    """Commit a step of ``WORLD`` ranks into ``store`` (every rank's shard: a shared folder's copy) whose one tensor
    is split row-wise over a 4-rank mesh ``dp``; returns its manifest."""
    save_id = layout.new_save_id()
    rng = random.Random(step)
    protocol = protocol_for(store)
    staging = protocol.begin(store, step, save_id)
    refs, total = [], 0
    for rank in range(WORLD):
        header = build_header([("w", "U8", (ROWS,), ROWS)], {"format": "pt"})
        payload = rng.randbytes(ROWS)
        d = hashing.digest(payload)
        fname = layout.data_file_name(rank, 0, save_id)
        store.write_bytes(join(staging, fname), header + payload)
        shard = {"global_shape": [WORLD * ROWS], "offset": [rank * ROWS], "placements": ["S(0)"],
                 "mesh_shape": [WORLD], "mesh_dims": ["dp"], "coordinate": [rank]}
        rm = RankManifest(step=step, rank=rank, world_size=WORLD, save_id=save_id,
                          files=(FileRecord(fname, len(header) + ROWS,
                                            hashing.file_checksum([hashing.digest(header), d]), len(header)),),
                          tensors=(TensorRecord(0, "w", "state['w']", "U8", (ROWS,), 0, len(header), ROWS, d.hex(),
                                                shard=shard),),
                          tree={"kind": "test"}, metadata=None)
        raw = rm.to_bytes()
        ref = RankRef(rank, layout.rank_manifest_name(rank, save_id), len(raw), hashing.digest(raw).hex(),
                      mesh_index(t.shard for t in rm.tensors))
        store.write_bytes(join(staging, ref.name), raw)
        refs.append(ref)
        total += rm.total_bytes
    manifest = StepManifest(step=step, world_size=WORLD, save_id=save_id, ranks=tuple(refs), total_bytes=total)
    store.write_bytes(join(staging, layout.STEP_MANIFEST), manifest.to_bytes())
    protocol.commit(store, staging, step)
    return manifest


def _index_refs(raw: bytes, manifest: StepManifest) -> tuple[shard_index.IndexHead, list[RankRef]]:
    """The head and every reference of an index file, parsed."""
    end = shard_index.head_line(raw, step=manifest.step)
    assert end is not None
    head = shard_index.parse_head(raw[:end], step=manifest.step, save_id=manifest.save_id,
                                  world_size=manifest.world_size)
    refs = []
    for b in range(-(-head.world_size // head.block_ranks)):
        at, size = head.block_span(b)
        refs += shard_index.parse_block(raw[at : at + size], head, b)
    return head, refs


def _plain(refs: tuple[RankRef, ...]) -> list[RankRef]:
    return [dataclasses.replace(r, mesh=()) for r in refs]


def _ep(s3_server: Any) -> list[str]:
    return ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]


class CountingStore(LocalStore):
    """A local store that records the files it reads (by name)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, tier="local", create=False)
        self.names: list[str] = []

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        self.names.append(rel.rsplit("/", 1)[-1])
        return super().read_bytes(rel, max_size=max_size)

    def readinto_many(self, rel: str, offset: int, bufs: list[memoryview]) -> int:
        self.names.append(rel.rsplit("/", 1)[-1])
        return super().readinto_many(rel, offset, bufs)


# ---------------------------------------------------------------------------------------- sync and pull (moto S3)
def test_sync_and_pull_give_each_copy_an_index_of_its_own_references(tmp_path: Path, s3_server: Any, s3_bucket: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    local = LocalStore(tmp_path / "local", tier="local")
    mine = _mesh_step(local)
    assert not list((tmp_path / "local" / layout.step_dir(STEP)).glob("shards-*"))  # built without one
    url = f"{s3_bucket}/run"
    assert cli(["sync", str(tmp_path / "local"), url, *_ep(s3_server)]) == 0
    remote = FsspecStore(url, storage_options=s3_server.storage_options(), tier="remote")
    theirs = read_step_manifest(remote, layout.step_dir(STEP), STEP)
    assert theirs is not None and theirs.save_id == mine.save_id
    # the remote rank manifests name fan-out data files: other bytes, other references than the local ones
    assert [(r.size, r.checksum) for r in theirs.ranks] != [(r.size, r.checksum) for r in mine.ranks]
    name = shard_index.index_name(mine.save_id)
    raw = remote.read_bytes(f"{layout.step_dir(STEP)}/{name}", max_size=1 << 20)
    head, refs = _index_refs(raw, theirs)
    assert refs == _plain(theirs.ranks)  # the remote's own references, not the local copy's
    assert all(head.meshes[MESH].at((r,)) == (r,) for r in range(WORLD))
    capsys.readouterr()
    assert cli(["verify", url, "--json", *_ep(s3_server)]) == 0
    (report,) = json.loads(capsys.readouterr().out)["steps"]
    assert report["ok"] and report["index"] == name and report["extra_files"] == [], report

    # pull: the pulled copy's rank manifests are re-sealed under the plain names, and its index lists those
    assert cli(["pull", url, str(tmp_path / "pulled"), "--step", str(STEP), *_ep(s3_server)]) == 0
    remote.close()
    folder = tmp_path / "pulled" / layout.step_dir(STEP)
    pulled = read_step_manifest(LocalStore(tmp_path / "pulled", tier="local"), layout.step_dir(STEP), STEP)
    assert pulled is not None and [(r.size, r.checksum) for r in pulled.ranks] != [(r.size, r.checksum)
                                                                                   for r in theirs.ranks]
    assert [p.name for p in folder.glob("shards-*")] == [name]
    _, refs = _index_refs((folder / name).read_bytes(), pulled)
    assert refs == _plain(pulled.ranks)
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "pulled"), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["steps"]
    assert report["ok"] and report["index"] == name, report
    assert cli(["inspect", str(tmp_path / "pulled"), "--step", str(STEP), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shard_index"] == name
    assert cli(["ls", str(tmp_path / "pulled"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in listed["steps"]] == [STEP] and listed["incomplete"] == [], listed

    # a resharding read of the pulled copy (a shared folder every rank reads): a target of rows 40..47 lies in
    # saved rank 2's shard only; the index names it, and only rank 2's manifest is read (never manifest.json)
    store = CountingStore(tmp_path / "pulled")
    cut = dataclasses.replace(pulled, ranks=pulled.ranks[:1])  # what a restoring rank knows: step, save, world
    have: dict[int, tuple[Any, RankManifest]] = {}
    layouts = [((WORLD * ROWS,), ("S(0)",), (WORLD,), MESH, ([40], [8]))]
    assert indexed_rank_manifests([store], cut, layouts, have, lambda _t: None)
    assert sorted(have) == [2] and have[2][1].rank == 2
    assert set(store.names) == {name, pulled.ranks[2].name}, store.names


def test_a_step_without_distributed_tensors_gets_no_index(tmp_path: Path) -> None:
    """Built from refs without mesh coordinates (``shard_index.build`` returns None): sync writes none."""
    local = LocalStore(tmp_path / "local", tier="local")
    mine = _mesh_step(local)
    plain = dataclasses.replace(mine, ranks=tuple(_plain(mine.ranks)))
    local.put_atomic(f"{layout.step_dir(STEP)}/{layout.STEP_MANIFEST}", plain.to_bytes())
    replicate_step(local, LocalStore(tmp_path / "remote", tier="remote"), STEP)
    assert sorted(p.name for p in (tmp_path / "remote" / layout.step_dir(STEP)).iterdir()
                  if not p.name.endswith(".safetensors")) == sorted(
        [layout.STEP_MANIFEST] + [r.name for r in mine.ranks])


# ---------------------------------------------------------------------------------------------------- verify
def _damage(kind: str, root: Path, manifest: StepManifest, name: str) -> None:
    path = root / layout.step_dir(STEP) / name
    raw = bytearray(path.read_bytes())
    end = shard_index.head_line(bytes(raw), step=STEP)
    assert end is not None
    if kind == "flipped":  # a byte inside block 0's references: its checksum no longer matches
        raw[end + 40] ^= 0x01
    elif kind == "truncated":
        del raw[-7:]
    elif kind == "stale":  # the index of another copy of the same save: the zstd remote's references
        remote = LocalStore(root.parent / "zstd", tier="remote")
        replicate_step(LocalStore(root, tier="local"), remote, STEP, compression="zstd")
        raw = bytearray((root.parent / "zstd" / layout.step_dir(STEP) / name).read_bytes())
        assert raw != path.read_bytes()
    elif kind == "mesh":  # sealed and with the right references, but a head placing ranks 0 and 1 the other way
        swap = {0: 1, 1: 0}
        moved = [dataclasses.replace(r, mesh=((MESH, (swap.get(r.rank, r.rank),)),)) for r in manifest.ranks]
        raw = bytearray(shard_index.build(STEP, manifest.save_id, WORLD, moved) or b"")
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", ["flipped", "truncated", "stale", "mesh"])
def test_verify_reports_a_damaged_or_stale_index_naming_it(tmp_path: Path, kind: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    store = LocalStore(root, tier="local")
    manifest = _mesh_step(store)
    written = shard_index.of_copy(manifest)
    assert written is not None
    name, raw = written
    store.put_atomic(f"{layout.step_dir(STEP)}/{name}", raw)
    capsys.readouterr()
    assert cli(["verify", str(root)]) == 0
    assert "shard index checked" in capsys.readouterr().out
    _damage(kind, root, manifest, name)
    assert cli(["verify", str(root), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)["steps"]
    assert not report["ok"] and report["bad_files"] == [name], report
    (err,) = report["errors"]
    # the CLI names a root by its path (its tier is the folder given)
    assert f"step {STEP}" in err and f"{root}/{layout.step_dir(STEP)}/{name}" in err, err
    assert "manifest.json" in err and f"deleting {name} is a safe repair" in err, err
    want = {"flipped": "checksum mismatch", "truncated": "truncated", "stale": "stale", "mesh": "mesh 4:dp"}[kind]
    assert want in err, err
    # the library's report names the tier of the store it was given
    lib = verify_step(LocalStore(root, tier="local", create=False), STEP)
    assert not lib.ok and lib.bad_files == [name] and "tier local" in lib.errors[0], lib
    # the text report says the same; deleting the index repairs the step
    assert cli(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and name in out and "safe repair" in out, out
    (root / layout.step_dir(STEP) / name).unlink()
    assert cli(["verify", str(root)]) == 0


def test_an_index_of_another_save_is_an_extra_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    manifest = _mesh_step(LocalStore(root, tier="local"))
    other = shard_index.index_name("0" * 16)
    shutil.copy(root / layout.step_dir(STEP) / manifest.ranks[0].name, root / layout.step_dir(STEP) / other)
    capsys.readouterr()
    assert cli(["verify", str(root), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["steps"]
    assert report["ok"] and report["extra_files"] == [other] and report["index"] is None, report
