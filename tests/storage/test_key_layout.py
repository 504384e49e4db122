"""The object-store key layout: data files under a fan-out tag (``step-<N>/<tag>-r<rank>-p<part>-<id>.safetensors``),
so that a step's data objects spread over 256 key prefixes. The tag function's spread over 8,192 ranks and the
per-prefix request rates it implies; real saves to the moto S3 server (prefixes counted in the bucket, restored,
verified, pulled); steps of the plain layout (the golden copies) still read from S3; retention, ``prune`` and
``prune --leftovers`` leave no object of a deleted or half-uploaded step; a manifest naming a path outside its
step folder is refused."""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from tests._support.steps import build_step, write_step
from tierckpt import CheckpointManager
from tierckpt.cli import main as cli
from tierckpt.cli.remote import pull_step
from tierckpt.errors import CorruptCheckpointError
from tierckpt.format import hashing, layout
from tierckpt.storage.base import join
from tierckpt.storage.faulty import FaultyStore
from tierckpt.storage.fsspec_store import FsspecStore
from tierckpt.storage.local import LocalStore
from tierckpt.tiers.reader import read_manifests
from tierckpt.tiers.uploader import replicate_step
from tierckpt.tiers.verify import verify_step

GOLDEN = Path(__file__).resolve().parents[1] / "format" / "golden"

#: S3's published request rates per prefix (per second)
S3_PUT_PER_PREFIX = 3500
S3_GET_PER_PREFIX = 5500


# --- the tag function ------------------------------------------------------------------------------------------


def test_fanout_name_is_a_pure_function_of_the_plain_name() -> None:
    plain = layout.data_file_name(3, 0, "3112f1ba")
    spread = layout.spread_name(plain)
    tag = layout.fanout_tag(plain)
    assert spread == f"{tag}-{plain}" and len(tag) == 2 and int(tag, 16) < layout.FANOUT
    assert layout.spread_name(plain) == spread and layout.spread_name(spread) == spread  # pure, idempotent
    assert layout.plain_name(spread) == plain and layout.plain_name(plain) == plain
    assert layout.check_file_name(spread) == spread  # still one safe path component
    other = f"{int(tag, 16) ^ 1:02x}-{plain}"  # not the name's own tag: not a fan-out name, left as it is
    assert layout.plain_name(other) == other
    for name in (layout.rank_manifest_name(3, "3112f1ba"), layout.STEP_MANIFEST, "model.safetensors"):
        assert layout.plain_name(name) == name
    assert layout.stored_name(plain, True) == spread and layout.stored_name(spread, False) == plain


def _save_id(step: int) -> str:
    """A multi-rank job's save id of ``step`` (:func:`tierckpt.engine.sharded.save_id`, which imports torch)."""
    return xxhash.xxh3_64_hexdigest(f"5f0c2d9e8a7b6c41:{step}".encode())


def test_fanout_spreads_8192_ranks_under_s3_request_rates() -> None:
    """8,192 ranks x 1 GiB (two 512 MiB files each, the default file_size_mb), saved or restored in 60 s: 16 MiB
    upload parts (a multipart upload is a create, the parts and a complete per file) and the reader's 8 MiB ranged
    GETs (plus one size request per file). In one prefix that is 2.7x S3's PUT rate and 3.2x its GET rate; spread
    over 256 tags the busiest prefix takes under 3% of either."""
    ranks, files, seconds = 8192, 2, 60.0
    puts_per_file = 2 + (512 << 20) // (16 << 20)
    gets_per_file = 1 + (512 << 20) // (8 << 20)
    flat = ranks * files
    assert flat * puts_per_file / seconds > 2.5 * S3_PUT_PER_PREFIX
    assert flat * gets_per_file / seconds > 3 * S3_GET_PER_PREFIX
    for step in (1000, 1001, 1002):
        per_tag = collections.Counter(layout.fanout_tag(layout.data_file_name(r, p, _save_id(step)))
                                      for r in range(ranks) for p in range(files))
        busiest = max(per_tag.values())
        assert len(per_tag) == layout.FANOUT and busiest < 2 * flat / layout.FANOUT, (step, busiest)
        assert busiest * puts_per_file / seconds < 0.03 * S3_PUT_PER_PREFIX
        assert busiest * gets_per_file / seconds < 0.03 * S3_GET_PER_PREFIX
    # consecutive ranks, and one rank's consecutive steps, do not share a tag more than chance does
    sid = _save_id(1000)
    same = sum(layout.fanout_tag(layout.data_file_name(r, 0, sid)) == layout.fanout_tag(layout.data_file_name(r + 1, 0,
               sid)) for r in range(ranks - 1))
    assert same < 0.02 * ranks, same
    over_steps = {layout.fanout_tag(layout.data_file_name(3, 0, _save_id(s))) for s in range(1000, 1100)}
    assert len(over_steps) > 50, len(over_steps)


# --- real saves to S3 ------------------------------------------------------------------------------------------


def _state(seed: int, n: int = 16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:02d}": torch.randn(1 << 18, generator=g) for i in range(n)}  # 1 MiB each


def _zeros(n: int = 16) -> dict[str, Any]:
    return {f"t{i:02d}": torch.zeros(1 << 18) for i in range(n)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _keys(s3_admin: Any, url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    root = url.removeprefix("s3://").rstrip("/")
    return sorted(k[len(root) + 1 :] for k in s3_admin.find(root))


def _ep(s3_server: Any) -> list[str]:
    return ["--storage-option", f"client_kwargs.endpoint_url={s3_server.endpoint_url}"]


def test_an_upload_to_s3_spreads_a_ranks_many_parts_over_prefixes(tmp_path: Path, s3_server: Any, s3_bucket: str,
                                                                  s3_admin: Any) -> None:
    """One rank's step of 32 data files, uploaded by the real uploader: its objects start with many prefixes, the
    manifests stay where they were, and verify and pull read it (the pulled copy under the local names)."""
    built = build_step(1, n_files=32, sizes=(4096, 100))
    local = LocalStore(tmp_path / "local", tier="local")
    write_step(local, built)
    url, opts = f"{s3_bucket}/parts", s3_server.storage_options()
    remote = FsspecStore(url, storage_options=opts, tier="remote")
    replicate_step(local, remote, 1)
    keys = _keys(s3_admin, url)
    data = [k for k in keys if k.endswith(".safetensors")]
    assert len(data) == 32 and all(k.startswith("step-0000000001/") for k in data), keys
    names = [k.split("/", 1)[1] for k in data]
    assert sorted(layout.plain_name(n) for n in names) == sorted(built.files)
    assert all(n == layout.spread_name(n) != layout.plain_name(n) for n in names), names
    prefixes = {k[: len("step-0000000001/") + 2] for k in data}  # the key prefixes S3 partitions on
    assert len(prefixes) >= 24, sorted(prefixes)  # 32 files over 256 tags: a few collide at most
    assert sorted(k for k in keys if not k.endswith(".safetensors")) == [
        "step-0000000001/manifest.json", f"step-0000000001/{built.manifest.ranks[0].name}"]
    assert cli(["verify", url, *_ep(s3_server)]) == 0
    assert cli(["inspect", url, "--step", "1", *_ep(s3_server)]) == 0
    pull_step(remote, LocalStore(tmp_path / "pulled", tier="local"), 1)
    pulled = {p.name: p.read_bytes() for p in (tmp_path / "pulled" / "step-0000000001").glob("*.safetensors")}
    assert pulled == built.files


def test_a_ranks_shard_upload_writes_tagged_names_that_rank_0s_listing_confirms(tmp_path: Path, s3_server: Any,
                                                                                 s3_bucket: str) -> None:
    """The multi-rank upload path (each rank uploads its shard, rank 0 confirms every reported size with one
    listing of the step folder before it commits): the sizes reported are the tagged names the listing finds."""
    from tierckpt.tiers.sharded import upload_shard

    built = build_step(2, n_files=8, sizes=(4096, 100))
    local = LocalStore(tmp_path / "local", tier="local")
    write_step(local, built)
    remote = FsspecStore(f"{s3_bucket}/shard", storage_options=s3_server.storage_options(), tier="remote")
    ref, sizes, _held = upload_shard(local, remote, 2, 0)
    data = {n: size for n, size in sizes.items() if n != ref.name}
    assert sorted(layout.plain_name(n) for n in data) == sorted(built.files)
    assert all(n == layout.spread_name(n) != layout.plain_name(n) for n in data), data
    listed = remote.sizes(layout.step_dir(2))
    assert all(listed.get(n) == size for n, size in sizes.items()), (listed, sizes)


def test_a_managers_save_to_s3_is_spread_and_a_wiped_node_restores_it(tmp_path: Path, s3_server: Any,
                                                                      s3_bucket: str, s3_admin: Any) -> None:
    url, opts = f"{s3_bucket}/run", s3_server.storage_options()
    with CheckpointManager(tmp_path / "local", remote=url, storage_options=opts, file_size_mb=1,
                           log_records=False) as mgr:
        mgr.save(1, _state(1, 4))
        mgr.wait()
    names = [k.split("/", 1)[1] for k in _keys(s3_admin, url) if k.endswith(".safetensors")]
    assert len(names) == 4 and all(n == layout.spread_name(n) != layout.plain_name(n) for n in names), names
    with CheckpointManager(tmp_path / "wiped", remote=url, storage_options=opts, cache_remote_restores=True,
                           log_records=False) as mgr:
        state = _zeros(4)
        assert mgr.restore(state, source="remote") == 1 and _equal(state, _state(1, 4))
    # the restore cached the step in the wiped node's tier, under the local names
    cached = sorted(p.name for p in (tmp_path / "wiped" / "step-0000000001").glob("*.safetensors"))
    assert cached == sorted(layout.plain_name(n) for n in names)


def test_plain_layout_steps_on_s3_still_restore_verify_and_pull(tmp_path: Path, s3_server: Any, s3_bucket: str,
                                                                s3_admin: Any) -> None:
    """The golden remote copies (every format version read, written before the fan-out) uploaded as they are."""
    sys.path.insert(0, str(GOLDEN))
    from make_golden import STEP, golden_state  # noqa: PLC0415

    opts = s3_server.storage_options()
    versions = sorted(p.name for p in GOLDEN.glob("v*") if (p / "remote").is_dir())
    assert versions
    want = golden_state()
    for version in versions:
        url = f"{s3_bucket}/{version}"
        for f in sorted((GOLDEN / version / "remote").rglob("*")):
            if f.is_file():
                s3_admin.pipe(f"{url.removeprefix('s3://')}/{f.relative_to(GOLDEN / version / 'remote')}",
                              f.read_bytes())
        data = [k.rsplit("/", 1)[-1] for k in _keys(s3_admin, url) if k.endswith(".safetensors")]
        assert data and all(layout.plain_name(n) == n for n in data), data  # no fan-out tag
        with CheckpointManager(tmp_path / f"{version}-wiped", remote=url, storage_options=opts,
                               log_records=False) as mgr:
            loaded = mgr.load(source="remote")
            assert loaded.step == STEP, version
            for k, v in want["extra"].items():
                assert torch.equal(loaded.state["extra"][k], v), (version, k)
            assert torch.equal(loaded.state["model"]["weight"], want["model"].weight.detach()), version
        remote = FsspecStore(url, storage_options=opts, tier="remote")
        report = verify_step(remote, STEP)
        assert report.ok, (version, report.errors)
        into = tmp_path / f"{version}-pulled"
        pulled = pull_step(remote, LocalStore(into, tier="local"), STEP)  # every byte checked on the way
        assert pulled.step == STEP and (into / layout.step_dir(STEP) / layout.STEP_MANIFEST).exists()


def test_prune_retention_and_leftovers_remove_every_object_of_a_spread_step(
        tmp_path: Path, s3_server: Any, s3_bucket: str, s3_admin: Any, capsys: pytest.CaptureFixture[str]) -> None:
    opts = s3_server.storage_options()
    # retention: a manager keeping one remote step leaves only the newest step's objects
    kept = f"{s3_bucket}/kept"
    with CheckpointManager(tmp_path / "a", remote=kept, storage_options=opts, keep_remote=1, file_size_mb=1,
                           log_records=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step, 2))
            mgr.wait()
    assert {k.split("/", 1)[0] for k in _keys(s3_admin, kept) if "/" in k} == {"step-0000000003"}
    # prune --keep 1 --leftovers: a committed older step and a half-uploaded step (its manifest.json never
    # written: the data and rank manifest stay, as a killed uploader leaves them) are gone, object by object
    with CheckpointManager(tmp_path / "b", keep_local=3, file_size_mb=1, log_records=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step, 2))
            mgr.wait()
    url = f"{s3_bucket}/pruned"
    remote = FsspecStore(url, storage_options=opts, tier="remote")
    local = LocalStore(tmp_path / "b", tier="local")
    for step in (1, 2):
        replicate_step(local, remote, step)
    refusing = FaultyStore(remote, fail={"write_bytes": [2]}, error_factory=lambda op, n: PermissionError(op))
    with pytest.raises(Exception, match="write_bytes"):
        replicate_step(local, refusing, 3)  # rank manifest written, manifest.json refused
    left = [k for k in _keys(s3_admin, url) if k.startswith("step-0000000003/")]
    assert len(left) == 3 and not any(k.endswith("/manifest.json") for k in left), left  # 2 data files + rank
    capsys.readouterr()
    assert cli(["prune", url, "--keep", "1", "--leftovers", "--min-age", "0", "--no-verify", *_ep(s3_server)]) == 0
    out = capsys.readouterr().out
    assert "deleted step 1" in out and "step-0000000003" in out, out
    assert {k.split("/", 1)[0] for k in _keys(s3_admin, url) if "/" in k} == {"step-0000000002"}


def test_an_incremental_upload_keeps_the_file_it_carries_over(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    """Step 2 references step 1's file, which the remote lacks: the upload carries it into step 2's folder under
    step 1's save id. The commit's clean-up of other saves' files used to delete it right after the commit."""
    with CheckpointManager(tmp_path / "local", incremental=True, keep_local=4, log_records=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"base": _state(0, 2), "head": torch.full((64,), float(step))})
            mgr.wait()
    url, opts = f"{s3_bucket}/inc", s3_server.storage_options()
    remote = FsspecStore(url, storage_options=opts, tier="remote")
    replicate_step(LocalStore(tmp_path / "local", tier="local"), remote, 2)
    _m, rms = read_manifests(remote, 2)
    assert len({f.name.rsplit("-", 1)[1] for f in rms[0].files}) == 2, "one file carried over from step 1's save"
    assert cli(["verify", url, *_ep(s3_server)]) == 0
    with CheckpointManager(tmp_path / "wiped", remote=url, storage_options=opts, log_records=False) as mgr:
        state = {"base": _zeros(2), "head": torch.zeros(64)}
        assert mgr.restore(state, source="remote") == 2
        assert _equal(state["base"], _state(0, 2)) and torch.equal(state["head"], torch.full((64,), 2.0))


# --- what a manifest may name ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["folder", "parent", "absolute", "hidden"])
def test_a_manifest_naming_a_path_outside_its_step_is_refused(tmp_path: Path, shape: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    built = build_step(5)
    plain = built.rank_manifest.files[0].name
    bad = {"folder": f"{layout.fanout_tag(plain)}/{plain}", "parent": f"../step-0000000004/{plain}",
           "absolute": f"/tmp/{plain}", "hidden": f".{plain}"}[shape]
    rm = dataclasses.replace(built.rank_manifest, files=(dataclasses.replace(built.rank_manifest.files[0], name=bad),
                                                         *built.rank_manifest.files[1:]))
    raw = rm.to_bytes()
    ref = dataclasses.replace(built.manifest.ranks[0], size=len(raw), checksum=hashing.digest(raw).hex())
    store = LocalStore(tmp_path / "root", tier="local")
    folder = layout.step_dir(5)
    store.makedirs(folder)
    for name, data in built.files.items():
        store.write_bytes(join(folder, name), data)
    store.write_bytes(join(folder, ref.name), raw)
    store.write_bytes(join(folder, layout.STEP_MANIFEST), dataclasses.replace(built.manifest, ranks=(ref,)).to_bytes())
    with pytest.raises(CorruptCheckpointError) as ei:
        read_manifests(store, 5)
    assert ei.value.step == 5 and bad in str(ei.value), str(ei.value)
    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "root"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert json.dumps(bad)[1:-1] in json.dumps(doc), doc
