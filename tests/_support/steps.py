"""Hand-built steps: a valid one-rank step made with the format modules alone (no manager, no torch), and
written through a store's commit protocol."""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.format import hashing, layout
from tierckpt.format.manifest import FileRecord, RankManifest, RankRef, StepManifest, TensorRecord
from tierckpt.format.safetensors import build_header
from tierckpt.storage.base import Store, join
from tierckpt.storage.commit import protocol_for


@dataclass(frozen=True)
class BuiltStep:
    step: int
    save_id: str
    manifest: StepManifest
    rank_manifest: RankManifest
    files: dict[str, bytes]  # data file name -> bytes


def build_step(step: int, *, save_id: str | None = None, sizes: tuple[int, ...] = (4096, 1000, 0, 37),
               n_files: int = 2, zeros: bool = False, seed: int = 0) -> BuiltStep:
    """A valid one-rank step: ``n_files`` safetensors files holding U8 tensors of ``sizes`` bytes each (random
    bytes, or zeros), with correct segment checksums, a rank manifest and a step manifest."""
    import random

    rng = random.Random(seed * 1000 + step)
    save_id = save_id or layout.new_save_id()
    files: dict[str, bytes] = {}
    file_records = []
    tensor_records = []
    index = 0
    for part in range(n_files):
        entries = [(f"t{part}_{i}", "U8", (n,), n) for i, n in enumerate(sizes)]
        header = build_header(entries, {"format": "pt"})
        payloads = [bytes(n) if zeros else rng.randbytes(n) for n in sizes]
        digests = [hashing.digest(header)]
        offset = len(header)
        for (name, dtype, shape, n), payload in zip(entries, payloads):
            d = hashing.digest(payload)
            digests.append(d)
            tensor_records.append(TensorRecord(index, name, f"state[{name!r}]", dtype, shape, part, offset, n, d.hex()))
            offset += n
            index += 1
        data = header + b"".join(payloads)
        fname = layout.data_file_name(0, part, save_id)
        files[fname] = data
        file_records.append(FileRecord(fname, len(data), hashing.file_checksum(digests), len(header)))
    rm = RankManifest(step=step, rank=0, world_size=1, save_id=save_id, files=tuple(file_records),
                      tensors=tuple(tensor_records), tree={"kind": "test"}, metadata={"built": "by hand"})
    raw = rm.to_bytes()
    rname = layout.rank_manifest_name(0, save_id)
    sm = StepManifest(step=step, world_size=1, save_id=save_id,
                      ranks=(RankRef(0, rname, len(raw), hashing.digest(raw).hex()),), total_bytes=rm.total_bytes,
                      metadata={"built": "by hand"})
    return BuiltStep(step, save_id, sm, rm, files)


def write_step(store: Store, built: BuiltStep, *, commit: bool = True) -> str:
    """Write a built step through the store's commit protocol; returns the staging folder. With ``commit=False``
    the data and rank manifest are written but neither ``manifest.json`` nor the commit (a crash's leftover)."""
    protocol = protocol_for(store)
    staging = protocol.begin(store, built.step, layout.new_save_id())
    for name, data in built.files.items():
        with store.open_write(join(staging, name), size_hint=len(data)) as w:
            w.write(data)
    rname = built.manifest.ranks[0].name
    store.write_bytes(join(staging, rname), built.rank_manifest.to_bytes())
    if commit:
        store.write_bytes(join(staging, layout.STEP_MANIFEST), built.manifest.to_bytes())
        protocol.commit(store, staging, built.step)
    return staging
