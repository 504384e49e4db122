"""Export a checkpoint's model weights as plain safetensors files that Hugging Face ``from_pretrained`` reads
(``tierckpt export``, :func:`export_weights`).

What is written: the tensors of ``state[key]`` of one committed step (a module comes back as its ``state_dict()``
tree, so the names are the module's ``state_dict`` names; nested mappings are joined with ``.``), in saved order, as
``model.safetensors`` when they fit in ``max_shard_bytes``, else as ``model-00001-of-0000N.safetensors`` files
(filled in order, a new file started when the next tensor would not fit, a larger tensor alone in its own file)
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``), as
Hugging Face's ``save_pretrained`` does. Each file's safetensors metadata is ``{"format": "pt", "tierckpt_step":
"<step>", "tierckpt_source": "<url of the copy read>"}``. ``dtype`` casts floating tensors only. A tensor saved under
several names (tied weights) is written under each name, from the same memory (safetensors files cannot share
storage between names; ``from_pretrained`` ties such weights again on load, and finds every name it expects).

Reading: the checkpoint root is opened read-only (never as a :class:`~tierckpt.CheckpointManager`, whose folder lock
a live job holds) and read through the template-free loader (:mod:`.engine.load`): only ``state[key]``'s byte ranges,
every byte verified against its checksum; a corrupt or missing copy falls back to the other tier's, then (without
``step``) to the next older step, with a warning. A multi-rank step (DTensor/FSDP2 shards) is exported as the full,
unsharded tensors: each global tensor is allocated once and every rank's shards are read (one rank at a time,
verified) into it, the shards having to tile it exactly. Memory: one copy of the exported tensors, plus one rank's
shards of them while a multi-rank step is assembled, plus one cast tensor at a time while writing.

Files are written under temporary names, fsynced and renamed into place, the index last; nothing is written before
every tensor has been read and verified. Each temporary is created exclusively under a fresh random name
(``.<file>.<random>.tmp``, ``O_EXCL | O_NOFOLLOW``), so a link or file planted in the output folder is never
written through; only the rename gives a file its final name (a link there is replaced, not followed). Modes are
0644 less the umask (0600 under ``umask 077``). An output folder already holding an export (``model.safetensors``,
an index or ``model-*-of-*.safetensors``) is refused unless ``overwrite``, which replaces it (stale shards of the
earlier export are removed, so ``from_pretrained`` cannot pick up a mix).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .engine import load as _load
from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .format import layout
from .format.safetensors import build_header
from .readonly import Reader
from .snapshot.decode import decode_tree
from .snapshot.dtypes import CODE_TO_TORCH, TORCH_TO_CODE
from .snapshot.loaded import byte_view
from .storage.base import Store
from .storage.files import write_all, write_replace
from .storage.local import fsync_dir
from .storage.open import is_url, open_store
from .tiers.backing import prove_backed
from .tiers.listing import first_intact, list_tiers
from .tiers.reader import check_sizes, read_ranks, read_step

log = logging.getLogger(__name__)

#: Default largest file: 5 GB, Hugging Face's ``max_shard_size="5GB"`` (decimal, as HF counts it).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
#: ``dtype`` names accepted (``--dtype``).
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class ExportError(ValueError):
    """The export cannot be made as asked: ``state[key]`` is not a mapping of tensors, a bad option, or an output
    folder that already holds an export (without ``overwrite``)."""


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_weights` wrote.

    Attributes:
        step: the step exported.
        files: paths of the files written, the safetensors files in order, then the index (when sharded).
        total_bytes: bytes of tensor data written (the index's ``total_size``).
    """

    step: int
    files: tuple[str, ...]
    total_bytes: int


def parse_size(text: str | int) -> int:
    """A size as Hugging Face's ``max_shard_size`` takes it: an int of bytes, or ``"5GB"`` (decimal units), ``"2GiB"``
    (binary units), ``"500MB"``, ``"100"``; more than 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _SIZE_UNITS:
            raise ExportError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB or a number of bytes)")
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ExportError(f"a size must be more than 0 bytes, got {text!r}")
    return value


def export_weights(
    root_or_url: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    key: str = "model",
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    remote: str | os.PathLike[str] | None = None,
    timeout_s: float | None = 30.0,
    overwrite: bool = False,
    threads: int = 4,
) -> ExportResult:
    """Write ``state[key]`` of ``step`` (None: the newest intact one) of the checkpoint root ``root_or_url`` (a
    tier root path, a single step folder, or a URL) as safetensors files in ``out_dir``; see the module docstring.

    ``remote``: a second tier (a URL or path) read when the first has no intact copy (as ``restore`` does; the
    first may then be missing altogether). ``storage_options``: fsspec options for the URLs. ``timeout_s``: how long
    listing a tier reached over the network may take, retries included. ``dtype``: ``"bf16"``, ``"fp16"``,
    ``"fp32"`` (or a torch dtype) for the floating tensors. ``max_shard_bytes``: largest file (bytes or ``"5GB"``).

    Raises:
        CheckpointNotFoundError: no tier holds a committed step (or ``step``), or the root does not exist.
        CorruptCheckpointError: copies exist but none verifies (naming the files at fault).
        StateMismatchError: ``key`` is not a top-level key of the step (a ``KeyError`` naming the keys it has).
        StorageError: a tier could not be read (and no other tier holds the step).
        ExportError: ``state[key]`` is not a mapping of tensors, a bad argument, or ``out_dir`` holds an export.
    """
    if step is not None and (type(step) is not int or step < 0):
        raise ExportError(f"step must be a non-negative int or None, got {step!r}")
    if not isinstance(key, str) or not key:
        raise ExportError(f"key must be a non-empty str, got {key!r}")
    cast = _dtype_of(dtype)
    limit = parse_size(max_shard_bytes)
    if threads < 1:
        raise ExportError(f"threads must be at least 1, got {threads}")
    out = os.fspath(out_dir)
    existing = _existing_export(out)
    if existing and not overwrite:
        raise ExportError(f"{out} already holds an export ({', '.join(existing[:3])}"
                          f"{' ...' if len(existing) > 3 else ''}); pass overwrite=True (--overwrite) to replace it")
    stores, only = _open_tiers(root_or_url, remote, storage_options)
    if step is None:
        step = only
    reader = Reader(threads=threads)
    try:
        urls = ", ".join(s.url for s in stores)
        listing = list_tiers(stores, deadline_s=timeout_s)
        try:
            listing.require(step, urls)
        except StorageError:  # the tier's own error (require's words are a restore's)
            raise next(iter(listing.failed.values())) from None
        got_step, source, weights = _load_weights(reader, stores, step, key, listing.steps)
    finally:
        reader.close()
        for s in stores:
            s.close()
    return _write(out, weights, step=got_step, source=source, cast=cast, limit=limit, stale=existing)


# ---------------------------------------------------------------------------------------------------------- reading


def _open_tiers(root: str | os.PathLike[str], remote: str | os.PathLike[str] | None,
                options: dict[str, Any] | None) -> tuple[list[Store], int | None]:
    """The stores to read, first ``root`` then ``remote`` (read-only: nothing is created), and the step when
    ``root`` is a single step's folder."""
    target = os.fspath(root).rstrip("/") or "/"
    base = target.rsplit("/", 1)[-1]
    only = layout.parse_step_dir(base)
    if only is not None:
        target = target[: -len(base)].rstrip("/") or "/"
    stores: list[Store] = []
    if is_url(target):  # a tier reached over the network: listed within the deadline (not "local")
        stores.append(open_store(target, storage_options=options, tier="remote", create=False))
    elif os.path.isdir(target.removeprefix("file://")):
        stores.append(open_store(target, tier="local", create=False))
    elif remote is None:
        raise CheckpointNotFoundError("no such checkpoint folder", path=target)
    if remote is not None:
        r = os.fspath(remote)
        if not is_url(r) and not os.path.isdir(r.removeprefix("file://")):
            if not stores:
                raise CheckpointNotFoundError("neither the root nor the remote exists", path=f"{target}, {r}")
            log.warning("export: the remote %s does not exist; reading %s only", r, target)
        else:
            tier = "fallback" if stores and stores[0].tier == "remote" else "remote"
            stores.append(open_store(r, storage_options=options if is_url(r) else None, tier=tier, create=False))
    return stores, only


def _load_weights(reader: Reader, stores: list[Store], step: int | None, key: str,
                  listings: dict[str, set[int]]) -> tuple[int, str, dict[str, torch.Tensor]]:
    """(step, url of the copy read, name -> tensor) of the newest intact step (or exactly ``step``) of ``stores``,
    with the fallbacks of :func:`._load.load`."""
    s, store, tree = first_intact(lambda store, s: _load_copy(reader, store, s, key), stores, listings, step,
                                  what="export", skip=(CorruptCheckpointError, CheckpointNotFoundError),
                                  verb="loads")
    return s, store.url, _flatten(tree, key)


def _load_copy(reader: Reader, store: Store, step: int, key: str) -> Any:
    """``state[key]`` of ``step`` in ``store`` as plain values; the distributed tensors of a multi-rank step as
    their full global tensors."""
    manifest = read_step(store, step)
    if manifest.world_size == 1:
        state, _ = _load.load_copy(reader, store, step, [key])
        return state[key]
    where = f"{store.url}/{layout.step_dir(step)}"
    if manifest.holds_ranks is not None and len(manifest.holds_ranks) < manifest.world_size:
        raise CheckpointNotFoundError(f"this copy holds the shards of ranks {list(manifest.holds_ranks)} of "
                                      f"{manifest.world_size} only (a node-local tier); exporting the full tensors "
                                      "needs every rank's: export from the remote tier", step=step, tier=store.tier,
                                      path=where)
    rms = read_ranks(store, manifest, None)
    if sorted(rm.rank for rm in rms) != list(range(manifest.world_size)):
        raise CorruptCheckpointError("the step does not hold a rank manifest for every rank", step=step,
                                     tier=store.tier, path=where)
    rms.sort(key=lambda rm: rm.rank)
    root = _load.select(rms[0].tree, [key], step=step, tier=store.tier, where=where)
    wanted, paths = _load.referenced(root, len(rms[0].tensors))
    plain = {i for i in wanted if rms[0].tensors[i].shard is None}
    values = _load.read_records(reader, store, rms[0], plain)
    full = _assemble(reader, store, rms, paths, step=step, where=where)
    state = decode_tree(root, rms[0].tensors, values.__getitem__, step=step, dtensor=full.__getitem__)
    return state[key]


def _assemble(reader: Reader, store: Store, rms: list[Any], paths: set[str], *, step: int,
              where: str) -> dict[str, torch.Tensor]:
    """The global tensor of every distributed-tensor key path of ``paths``, assembled from every rank's shard
    records (read one rank at a time, verified); the shards must tile each tensor exactly.

    Nothing is allocated before every rank's records agree on each tensor's global shape and dtype, lie inside it
    and hold exactly its number of elements, and the files they are read from have their recorded sizes, backed by
    stored bytes (:func:`.tiers.backing.prove_backed`): a global tensor is then no larger than the shards that the
    files really hold."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    covered: dict[str, int] = {}
    for rm in rms:
        for rec in rm.tensors:
            if rec.shard is None or rec.path not in paths:
                continue
            gshape = tuple(int(n) for n in rec.shard["global_shape"])
            if rec.path not in shapes:
                if rec.dtype not in CODE_TO_TORCH:
                    raise CorruptCheckpointError(f"distributed tensor {rec.path} has dtype {rec.dtype}, not a "
                                                 "torch dtype", step=step, tier=store.tier, path=where)
                shapes[rec.path] = (gshape, CODE_TO_TORCH[rec.dtype])
                covered[rec.path] = 0
            offset = tuple(int(n) for n in rec.shard["offset"])
            if ((gshape, CODE_TO_TORCH.get(rec.dtype)) != shapes[rec.path] or len(offset) != len(gshape)
                    or len(rec.shape) != len(gshape)
                    or any(o < 0 or o + n > g for o, n, g in zip(offset, rec.shape, gshape))):
                raise CorruptCheckpointError(f"saved shards of {rec.path} disagree on the global shape or dtype, or "
                                             "lie outside it", step=step, tier=store.tier, path=where)
            covered[rec.path] += math.prod(rec.shape)
    for p in paths:
        if p not in shapes:
            raise CorruptCheckpointError(f"no rank stored a shard of the distributed tensor {p}", step=step,
                                         tier=store.tier, path=where)
    for p, (gshape, _) in shapes.items():
        if covered[p] != math.prod(gshape):  # shards that overlap, or leave a gap (replicated ones are stored once)
            raise CorruptCheckpointError(f"saved shards of {p} hold {covered[p]} elements of its {math.prod(gshape)}",
                                         step=step, tier=store.tier, path=where)
    mine = [{rec.index for rec in rm.tensors if rec.shard is not None and rec.path in shapes} for rm in rms]
    for rm, indices in zip(rms, mine):
        held = sorted({rm.tensors[i].file for i in indices if rm.tensors[i].nbytes})
        check_sizes(store, dataclasses.replace(rm, files=tuple(rm.files[f] for f in held)))
        prove_backed(store, rm, held)
    out = {p: torch.empty(gshape, dtype=dtype) for p, (gshape, dtype) in shapes.items()}
    for rm, indices in zip(rms, mine):
        if not indices:
            continue
        shards = _load.read_records(reader, store, rm, indices)
        for i in sorted(indices):
            rec = rm.tensors[i]
            box = tuple(slice(o, o + n) for o, n in zip(rec.shard["offset"], rec.shape))
            out[rec.path][box].copy_(shards.pop(i))
        del shards
    return out


def _flatten(tree: Any, key: str) -> dict[str, torch.Tensor]:
    """``state[key]`` as name -> tensor in saved order (nested mappings joined with ``.``); :class:`ExportError` for
    anything that is not a tensor."""
    if not isinstance(tree, Mapping):
        raise ExportError(f"state[{key!r}] is a {type(tree).__name__}, not a mapping of tensors (a module's "
                          "state_dict)")
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Mapping) -> None:
        for name, value in node.items():
            if not isinstance(name, str):
                raise ExportError(f"state[{key!r}] has a non-str key {name!r} under {prefix or 'its root'}")
            full = f"{prefix}.{name}" if prefix else name
            if full in out:  # {"a.b": x, "a": {"b": y}}
                raise ExportError(f"two entries of state[{key!r}] are both named {full!r} once flattened")
            if isinstance(value, Mapping):
                walk(full, value)
            elif isinstance(value, np.ndarray) and value.dtype in _NUMPY_OK:
                out[full] = torch.from_numpy(value)
            elif isinstance(value, torch.Tensor):
                out[full] = value
            else:
                raise ExportError(f"state[{key!r}][{full!r}] is a {type(value).__name__}, not a tensor: it cannot "
                                  "be written to a safetensors file")

    walk("", tree)
    return out


_NUMPY_OK = {np.dtype(d) for d in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16,
                                   np.float32, np.float64)}


def _dtype_of(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ExportError(f"dtype must be a floating dtype, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of bf16, fp16, fp32, got {dtype!r}")
    return DTYPES[dtype]


# ---------------------------------------------------------------------------------------------------------- writing


def _existing_export(out: str) -> list[str]:
    """The names in ``out`` that an export writes (sorted); [] for a missing folder."""
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ExportError(f"{out} is not a folder") from None
    return sorted(n for n in names if n in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(n))


def _cast(t: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    if cast is not None and t.is_floating_point() and t.dtype != cast:
        t = t.to(cast)
    return t.contiguous()


def _plan_files(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names grouped into files in order, as ``save_pretrained`` does: a new file when the next tensor would
    push the current one past ``limit``; a tensor larger than ``limit`` alone in its file."""
    files: list[list[str]] = [[]]
    size = 0
    for name, n in sizes:
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def _write(out: str, weights: dict[str, torch.Tensor], *, step: int, source: str, cast: torch.dtype | None,
           limit: int, stale: list[str]) -> ExportResult:
    for name, t in weights.items():
        if cast is not None and t.is_floating_point():
            continue
        if t.dtype not in TORCH_TO_CODE:
            raise ExportError(f"{name} has dtype {t.dtype}, which safetensors cannot hold")
    itemsize = {n: (cast if cast is not None and t.is_floating_point() else t.dtype).itemsize
                for n, t in weights.items()}
    sizes = [(n, t.numel() * itemsize[n]) for n, t in weights.items()]
    total = sum(n for _, n in sizes)
    groups = _plan_files(sizes, limit)
    names = ([SINGLE_FILE] if len(groups) == 1
             else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    os.makedirs(out, exist_ok=True)
    meta = {"format": "pt", "tierckpt_step": str(step), "tierckpt_source": source}
    written: list[str] = []
    try:
        for fname, group in zip(names, groups):
            _write_file(os.path.join(out, fname), [(n, weights[n]) for n in group], meta, cast)
            written.append(os.path.join(out, fname))
        if len(groups) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f for f, group in zip(names, groups) for n in group}}
            path = os.path.join(out, INDEX_FILE)
            _write_bytes(path, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
            written.append(path)
        for name in stale:
            if os.path.join(out, name) not in written:
                os.unlink(os.path.join(out, name))
        fsync_dir(out)
    except BaseException:
        for path in written:  # never leave a partial export that from_pretrained would read
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    log.info("export: step %d from %s: %d tensors, %d bytes, in %s (%d file(s))", step, source, len(weights), total,
             out, len(groups))
    return ExportResult(step, tuple(written), total)


def _write_file(path: str, tensors: list[tuple[str, torch.Tensor]], meta: dict[str, str],
                cast: torch.dtype | None) -> None:
    """One safetensors file: the format's header (:func:`tierckpt.format.safetensors.build_header`), then each
    tensor's bytes in order, written straight from its memory (cast one tensor at a time), into a temporary renamed
    over ``path`` (:func:`tierckpt.storage.files.write_replace`)."""
    entries = []
    for name, t in tensors:
        dt = cast if cast is not None and t.is_floating_point() else t.dtype
        entries.append((name, TORCH_TO_CODE[dt], tuple(t.shape), t.numel() * dt.itemsize))
    header = build_header(entries, meta)

    def write(fd: int) -> None:
        write_all(fd, header)
        for _, t in tensors:
            c = _cast(t, cast)
            if c.numel():
                write_all(fd, byte_view(c))
            del c

    write_replace(path, write)


def _write_bytes(path: str, data: bytes) -> None:
    write_replace(path, lambda fd: write_all(fd, data))


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportError", "ExportResult", "export_weights", "parse_size"]
