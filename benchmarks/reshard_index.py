"""What a resharding restart reads of a step's metadata per rank: the step's whole ``manifest.json`` (what every
rank read before shard indexes) against the shard index (``shards-<save id>.json``), at several world sizes.

The step is an FSDP-style checkpoint of W ranks (``--tensors`` parameters, each ``Shard(0)`` on a 1-D mesh of W),
and with ``--tp N`` (8 by default; 1 leaves it out) also one of FSDP2 over tensor parallelism (a mesh of W/N x N,
each parameter ``_StridedShard(0, N), Shard(0)``, as FSDP2 cuts a column-wise tensor-parallel weight), each
restored onto W/2 ranks of FSDP alone. Its remote copy is built as a save writes it: ``manifest.json`` listing
every rank (name, size, checksum and mesh coordinate) and the index the library builds from the same references,
both written into a scratch folder. For ``--sample`` target ranks spread over the new job, the library's own reader
(:func:`tierckpt.tiers.sharded.indexed_rank_manifests`' steps: the head, the rank map, the blocks) runs against a
store that counts every request and byte; the rank manifests and data it then reads are the same either way and
are not counted. Also timed per rank: the parse of what is read and the computation of which saved ranks
overlap the rank's targets (before: every rank's box of every tensor, as the step manifest's mesh index needs; after:
the mesh coordinates that overlap, :func:`tierckpt.format.shards.overlapping_coordinates`).

    .venv/bin/python benchmarks/reshard_index.py --worlds 256 1024 2048 8192
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness as h

from tierckpt.format import layout, shard_index
from tierckpt.format.manifest import RankRef, StepManifest
from tierckpt.format.shards import mesh_key, overlaps, saved_box
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import sharded

STEP, SID = 1000, "05f632d6c7078d6c"


class Counting(LocalStore):
    """A POSIX store that counts each read and its bytes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, tier="remote")
        self.requests = self.bytes = 0

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        raw = super().read_bytes(rel, max_size=max_size)
        self.requests, self.bytes = self.requests + 1, self.bytes + len(raw)
        return raw

    def readinto_many(self, rel: str, offset: int, bufs: list[memoryview]) -> int:
        n = super().readinto_many(rel, offset, bufs)
        self.requests, self.bytes = self.requests + 1, self.bytes + n
        return n


def one_world(world: int, tensors: int, sample: int, root: Path, tp: int = 1) -> dict[str, Any]:
    """One saved layout at one world size: ``tp`` 1 for FSDP alone, else FSDP2 over ``tp``-way tensor parallelism."""
    if tp == 1:
        placements, mesh, coords = ("S(0)",), (world,), [(r,) for r in range(world)]
    else:
        placements, mesh = (f"_S(0, {tp})", "S(0)"), (world // tp, tp)
        coords = [(r // tp, r % tp) for r in range(world)]
    key = mesh_key(mesh, None if tp == 1 else ("dp", "tp"))
    refs = [RankRef(r, layout.rank_manifest_name(r, SID), 180_000 + r % 977, f"{(r * 2654435761) % (1 << 128):032x}",
                    ((key, coords[r]),)) for r in range(world)]
    manifest = StepManifest(step=STEP, world_size=world, save_id=SID, ranks=tuple(refs), total_bytes=world << 30)
    raw_manifest, raw_index = manifest.to_bytes(), shard_index.build(STEP, SID, world, refs)
    assert raw_index is not None
    store = Counting(root / f"w{world}-tp{tp}")
    store.makedirs(layout.step_dir(STEP))
    store.put_atomic(f"{layout.step_dir(STEP)}/{layout.STEP_MANIFEST}", raw_manifest)
    store.put_atomic(f"{layout.step_dir(STEP)}/{shard_index.index_name(SID)}", raw_index)
    new = world // 2
    rows = world * 64  # each tensor: 64 rows a saved rank, 128 a restored one
    before: list[dict[str, float]] = []
    after: list[dict[str, float]] = []
    for target in sorted({round(i * (new - 1) / max(1, sample - 1)) for i in range(sample)}):
        box = ((128 * target, 0), (128, 1024))
        # before: manifest.json whole, then every rank's box of every tensor
        store.requests = store.bytes = 0
        t0 = time.perf_counter()
        got = StepManifest.from_bytes(store.read_bytes(f"{layout.step_dir(STEP)}/{layout.STEP_MANIFEST}",
                                                       max_size=1 << 30), step=STEP)
        t1 = time.perf_counter()
        wanted_before: set[int] = set()
        for _ in range(tensors):
            for ref in got.ranks:
                coord = dict(ref.mesh).get(key)
                b = saved_box((rows, 1024), placements, mesh, coord) if coord is not None else None
                if b is not None and overlaps(b, box):
                    wanted_before.add(ref.rank)
        t2 = time.perf_counter()
        before.append({"bytes": store.bytes, "requests": store.requests, "parse_s": t1 - t0, "plan_s": t2 - t1,
                       "ranks": len(wanted_before)})
        # after: the index's head, the ranks that overlap, the blocks naming them
        store.requests = store.bytes = 0
        t0 = time.perf_counter()
        found = sharded.index_head(store, manifest)
        assert found is not None
        t1 = time.perf_counter()
        wanted = shard_index.ranks_overlapping(found[1], [((rows, 1024), placements, mesh, key, box)] * tensors)
        t2 = time.perf_counter()
        assert wanted == wanted_before, (wanted, wanted_before)
        found_refs = sharded._index_refs(store, found[1], found[2], sorted(wanted))
        t3 = time.perf_counter()
        assert all(found_refs[r].checksum == refs[r].checksum for r in wanted)
        after.append({"bytes": store.bytes, "requests": store.requests, "parse_s": (t1 - t0) + (t3 - t2),
                      "plan_s": t2 - t1, "ranks": len(wanted)})

    def summary(runs: list[dict[str, float]]) -> dict[str, float]:
        return {k: max(r[k] for r in runs) if k in ("bytes", "requests", "ranks") else statistics.median(
            r[k] for r in runs) for k in runs[0]}

    return {"world": world, "tp": tp, "placements": list(placements), "restored_on": new, "tensors": tensors,
            "manifest_bytes": len(raw_manifest),
            "index_bytes": len(raw_index), "before": summary(before), "after": summary(after),
            "before_total_bytes": new * len(raw_manifest), "after_total_bytes": new * summary(after)["bytes"]}


def main() -> None:
    cli = h.Cli(__doc__, __file__, scratch=False)
    cli.add_argument("--worlds", type=int, nargs="+", default=[256, 1024, 2048, 8192])
    cli.add_argument("--tensors", type=int, default=100, help="distributed tensors a rank restores (default 100)")
    cli.add_argument("--sample", type=int, default=4, help="target ranks measured per world size (default 4)")
    cli.add_argument("--tp", type=int, default=8,
                     help="also a step of FSDP2 over this many tensor-parallel ranks (default 8; 1: FSDP alone only)")
    args = cli.parse()
    if args.tp < 1 or any(w % args.tp for w in args.worlds):
        cli.error("--tp must be >= 1 and divide every world size")
    layouts = [1] if args.tp == 1 else [1, args.tp]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_world(w, args.tensors, args.sample, Path(tmp), tp) for tp in layouts for w in args.worlds]
    heads = ["saved as", "W -> W/2", "manifest.json", "index", "read a rank, before", "after", "requests before/after",
             "rank manifests a rank", "parse+plan before", "after", "all ranks before", "after"]
    rows = [["FSDP" if r["tp"] == 1 else f"FSDP x TP {r['tp']}", f"{r['world']:,} -> {r['restored_on']:,}",
             f"{r['manifest_bytes']:,} B", f"{r['index_bytes']:,} B",
             f"{r['before']['bytes']:,} B", f"{r['after']['bytes']:,} B",
             f"{r['before']['requests']} / {r['after']['requests']}", str(r["after"]["ranks"]),
             f"{(r['before']['parse_s'] + r['before']['plan_s']) * 1e3:.1f} ms",
             f"{(r['after']['parse_s'] + r['after']['plan_s']) * 1e3:.2f} ms",
             f"{r['before_total_bytes'] / 1e9:.3g} GB", f"{r['after_total_bytes'] / 1e6:.3g} MB"] for r in runs]
    table = h.markdown_table(heads, rows)
    print(table)
    h.finish(args, {"runs": runs}, table)


if __name__ == "__main__":
    main()
