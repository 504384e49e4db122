"""Building and parsing safetensors headers, with every size bounds-checked before it is trusted.

Layout of a data file (the safetensors format, readable by ``safetensors.safe_open``)::

    [u64 little-endian N][N bytes of JSON header, padded with spaces][tensor bytes, back to back]

tierckpt pads the header so that tensor data starts on a 4096-byte boundary (aligned I/O), and orders tensors by
decreasing element size so that every tensor starts aligned to its own element size (safetensors itself forbids
gaps between tensors).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from .checks import check_json_memory, check_shape, unique_keys
from .dtypes import ITEMSIZE

ALIGN = 4096
#: The safetensors reference implementation refuses headers above 100 MB; so do we.
MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # relative to the data section
    end: int


def build_header(entries: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Header bytes (length prefix included) for tensors laid out back to back in the given order.

    ``entries`` are ``(name, dtype_code, shape, nbytes)``. The result's length is a multiple of :data:`ALIGN`.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    total = 8 + len(body)
    padded = -(-total // ALIGN) * ALIGN
    body += b" " * (padded - total)
    return struct.pack("<Q", len(body)) + body


def parse_header_length(prefix: bytes, file_size: int, *, where: str = "") -> int:
    """Validate the 8-byte length prefix against the file size before anything is allocated."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"safetensors file too short for its header{where}")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER or n + 8 > file_size:
        raise CorruptCheckpointError(f"safetensors header length {n} exceeds the file ({file_size} bytes){where}")
    return n


def parse_header(raw: bytes, data_size: int, *, where: str = "") -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Parse and check a header: known dtypes, sane shapes, offsets that tile ``[0, data_size)`` exactly. A header
    whose parse would take more than :data:`.checks.JSON_MEMORY_PER_BYTE` bytes per byte is refused before it is
    parsed, and one that runs out of memory all the same is corrupt too."""
    check_json_memory(raw, f"safetensors header{where}")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
        raise CorruptCheckpointError(f"unreadable safetensors header{where}: {exc or type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"safetensors header is not an object{where}")
    meta = obj.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptCheckpointError(f"bad safetensors __metadata__{where}")
    entries: dict[str, HeaderEntry] = {}
    for name, e in obj.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise CorruptCheckpointError(f"bad safetensors entry {name!r}{where}")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in ITEMSIZE:
            raise CorruptCheckpointError(f"unknown dtype {dtype!r} for {name!r}{where}")
        shape_t = check_shape(shape, f"{name!r}{where}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(x) is int for x in offs)
            or not 0 <= offs[0] <= offs[1] <= data_size
        ):
            raise CorruptCheckpointError(f"bad data_offsets {offs!r} for {name!r}{where}")
        if offs[1] - offs[0] != math.prod(shape_t) * ITEMSIZE[dtype]:
            raise CorruptCheckpointError(f"size of {name!r} does not match its shape and dtype{where}")
        entries[name] = HeaderEntry(name, dtype, shape_t, offs[0], offs[1])
    pos = 0
    for ent in sorted(entries.values(), key=lambda x: (x.start, x.end)):
        if ent.start != pos:
            raise CorruptCheckpointError(f"tensor data does not tile the file at {ent.name!r}{where}")
        pos = ent.end
    if pos != data_size:
        raise CorruptCheckpointError(f"tensor data ends at {pos} but the data section is {data_size} bytes{where}")
    return entries, meta

