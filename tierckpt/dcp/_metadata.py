"""The JSON form of DCP's ``Metadata`` that tierckpt stores, storage keys, and step ids (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpointError

FORMAT = "tierckpt.dcp"
FORMAT_VERSION = 1
DATA_KEY = "dcp"
META_KEY = "dcp_metadata"
#: A staged state that no DCP save thread picked up within this many seconds makes the next ``stage`` raise.
UNCLAIMED_TIMEOUT_S = 120.0

_LAYOUTS = {"strided": torch.strided, "sparse_coo": torch.sparse_coo}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


@dataclass(frozen=True)
class Record:
    """Where one DCP item is stored: tierckpt rank ``rank``'s ``{"dcp": {key: ...}}``."""

    rank: int
    key: str


@dataclass(frozen=True)
class _RankTag:
    """A global save plan's ``storage_data``: the rank that the plan belongs to."""

    rank: int


def storage_key(index: MetadataIndex) -> str:
    """The deterministic key of an item: ``"t:<offsets>:<fqn>"`` for a tensor chunk, ``"b:<fqn>"`` for bytes.

    Injective: offsets hold no ``:``, so the fqn (which may hold anything) is what follows the second one."""
    if index.offset is None:
        return f"b:{index.fqn}"
    return f"t:{','.join(map(str, index.offset))}:{index.fqn}"


# ------------------------------------------------------------------------------------------------ metadata JSON
def _name(value: Any, table: dict[str, Any], what: str) -> str:
    for k, v in table.items():
        if v == value:
            return k
    raise ValueError(f"tierckpt.dcp: cannot store a tensor {what} of {value!r} in the JSON metadata")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _planner_data_to_json(planner_data: Any) -> Any:
    if planner_data is None:
        return None
    bad = ValueError("tierckpt.dcp stores DCP's planner_data as JSON and understands only DefaultSavePlanner's form "
                     f"(a mapping fqn -> tuple of str/int path parts); got {type(planner_data).__name__}: use "
                     "DefaultSavePlanner, or a planner whose planner_data has that form")
    if not isinstance(planner_data, Mapping):
        raise bad
    out = {}
    for fqn, parts in planner_data.items():
        if type(fqn) is not str or not isinstance(parts, (tuple, list)):
            raise bad
        if not all(type(p) in (str, int) for p in parts):
            raise bad
        out[fqn] = list(parts)
    return out


def _dcp_version() -> str | None:
    """The DCP format version that torch's own writer stamps on its metadata (``FileSystemWriter.finish``)."""
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:
        return None
    return str(CURRENT_DCP_VERSION)


def metadata_to_json(md: Metadata, storage: Mapping[MetadataIndex, Record]) -> str:
    """DCP ``Metadata`` as JSON text, with ``storage`` (every item's :class:`Record`) as its ``storage_data``.

    Schema (``"format": "tierckpt.dcp"``, ``"version": 1``)::

        {"format": "tierckpt.dcp", "version": 1, "dcp_version": <Metadata.version or null>,
         "state_dict_metadata": {fqn: {"type": "tensor", "dtype": "float32", "size": [..],
                                       "properties": {"layout": "strided", "requires_grad": false,
                                                      "memory_format": "contiguous_format", "pin_memory": false},
                                       "chunks": [{"offsets": [..], "sizes": [..]}, ..]}
                                  | {"type": "bytes"}},
         "storage_data": [[fqn, offset (list or null), index (int or null), rank, key], ..],
         "planner_data": {fqn: [path part (str or int), ..]} or null,
         "storage_meta": {"checkpoint_id": str or null, "save_id": .., "load_id": .., "modules": [..]} or null}

    Raises ``ValueError`` for what this schema cannot hold (another planner's ``planner_data``, an unknown layout)."""
    sdm: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        elif isinstance(entry, TensorStorageMetadata):
            p = entry.properties
            sdm[fqn] = {"type": "tensor", "dtype": _dtype_name(p.dtype), "size": list(entry.size),
                        "properties": {"layout": _name(p.layout, _LAYOUTS, "layout"),
                                       "requires_grad": bool(p.requires_grad),
                                       "memory_format": _name(p.memory_format, _MEMORY_FORMATS, "memory format"),
                                       "pin_memory": bool(p.pin_memory)},
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks]}
        else:
            raise ValueError(f"tierckpt.dcp: unknown DCP storage metadata {type(entry).__name__} for {fqn!r}")
    sm = md.storage_meta
    meta = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(getattr(sm, "modules", []) or [])}
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "dcp_version": getattr(md, "version", None) or _dcp_version(),
           "state_dict_metadata": sdm,
           "storage_data": [[i.fqn, None if i.offset is None else list(i.offset), i.index, r.rank, r.key]
                            for i, r in storage.items()],
           "planner_data": _planner_data_to_json(md.planner_data), "storage_meta": meta}
    return json.dumps(doc, separators=(",", ":"))


def metadata_from_json(text: str, *, step: int | None = None) -> Metadata:
    """The ``Metadata`` that :func:`metadata_to_json` wrote, with ``storage_data`` a dict ``MetadataIndex`` ->
    :class:`Record` and ``planner_data`` path parts as tuples. Raises :class:`CorruptCheckpointError` for anything
    else (the text was checksummed when read, so a failure here means another format or version)."""
    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"DCP metadata: {why}", step=step)

    try:
        doc = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != FORMAT_VERSION:
        raise bad(f"not {FORMAT} version {FORMAT_VERSION}")
    try:
        sdm: dict[str, Any] = {}
        for fqn, e in doc["state_dict_metadata"].items():
            if e["type"] == "bytes":
                sdm[fqn] = BytesStorageMetadata()
                continue
            if e["type"] != "tensor":
                raise bad(f"unknown entry type {e['type']!r}")
            dtype = getattr(torch, e["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise bad(f"unknown dtype {e['dtype']!r}")
            p = e["properties"]
            props = TensorProperties(dtype=dtype, layout=_LAYOUTS[p["layout"]], requires_grad=bool(p["requires_grad"]),
                                     memory_format=_MEMORY_FORMATS[p["memory_format"]],
                                     pin_memory=bool(p["pin_memory"]))
            chunks = [ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                      for c in e["chunks"]]
            sdm[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(e["size"]), chunks=chunks)
        storage = {}
        for fqn, offset, index, rank, key in doc["storage_data"]:
            if type(rank) is not int or type(key) is not str:
                raise bad("malformed storage_data entry")
            storage[MetadataIndex(fqn, offset, index)] = Record(rank, key)
        pd = doc["planner_data"]
        planner_data = None if pd is None else {k: tuple(v) for k, v in pd.items()}
        sm = doc["storage_meta"]
        storage_meta = None
        if sm is not None:
            storage_meta = StorageMeta(checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], load_id=sm["load_id"])
            if hasattr(storage_meta, "modules"):
                storage_meta.modules = list(sm["modules"])
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise bad(f"malformed ({type(exc).__name__}: {exc})") from None
    md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                  storage_meta=storage_meta)
    if doc.get("dcp_version") is not None and hasattr(md, "version"):
        md.version = doc["dcp_version"]
    return md



def _parse_step(checkpoint_id: Any) -> int:
    """A step from a DCP ``checkpoint_id``: an int, a string of digits, or a path whose last component is
    ``step-<digits>`` (torchtitan's ``<folder>/step-<N>``; only the number is used, never the path)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, (str, os.PathLike)):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str):
            if text.isdigit():
                return int(text)
            m = re.fullmatch(r"step-(\d+)", os.path.basename(text.rstrip("/")))
            if m:
                return int(m.group(1))
    raise ValueError("tierckpt.dcp: checkpoint_id must be a step (a non-negative int, or a path ending in "
                     f"step-<N>), got {checkpoint_id!r}")


