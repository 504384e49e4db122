"""The JSON marker files :class:`~tierckpt.lightning.TieredCheckpointIO` writes at Lightning's checkpoint paths
(``{"tierckpt_step": N, "root": ..., "remote": ...}``, never the weights): writing and reading them, and the exact
JSON of the callback states a marker keeps when a second save at the same step differs from the first (floats by
their hex, small tensors by their bytes), with the copy and comparison that find those differences."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

try:
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # the standalone pytorch_lightning package
    from lightning_fabric.utilities.cloud_io import get_filesystem  # type: ignore[no-redef]

MARKER_KEY = "tierckpt_step"


def write_marker(path: str, marker: dict[str, Any]) -> None:
    """Write ``marker`` as JSON at ``path``: a local path through a temporary file renamed into place, a URL
    through Lightning's filesystem."""
    data = json.dumps(marker, allow_nan=False)
    if "://" in path and not path.startswith("file://"):
        fs = get_filesystem(path)
        with fs.open(path, "w") as f:
            f.write(data)
        return
    local = path.removeprefix("file://")
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    tmp = f"{local}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, local)


def read_marker(path: str) -> dict[str, Any] | None:
    """The marker at ``path``, or None when there is no file there. Raises ValueError when the file is not a
    tierckpt marker (nothing is unpickled)."""
    fs = get_filesystem(path)
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        head = f.read(1 << 20)
    try:
        marker = json.loads(head)
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"TieredCheckpointIO: {path} is not a tierckpt marker (a checkpoint written by another "
                         "CheckpointIO? this plug-in never unpickles)") from None
    if not isinstance(marker, dict) or type(marker.get(MARKER_KEY)) is not int:
        raise ValueError(f"TieredCheckpointIO: {path} is not a tierckpt marker")
    return marker


def copy_tree(obj: Any) -> Any:
    """A copy of a small tree, tensors cloned (Lightning's objects change after save_checkpoint returns)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_tree(v) for v in obj) if type(obj) in (list, tuple) else [copy_tree(v) for v in obj]
    return obj


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex()
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def encode(obj: Any, max_tensor_bytes: int) -> Any:
    """Exact JSON for a small callback state: None/bool/int/str as themselves, the rest tagged. Raises ValueError
    for a tensor of more than ``max_tensor_bytes`` (or not strided, or quantized), TypeError for another type."""
    if obj is None or isinstance(obj, (bool, str)) or type(obj) is int:
        return obj
    if isinstance(obj, float):
        return {"$float": obj.hex()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > max_tensor_bytes or t.layout is not torch.strided or t.is_quantized:
            raise ValueError(f"a {tuple(t.shape)} {t.dtype} tensor is too large or unusual for a marker")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
        return {"$tensor": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "hex": raw.hex()}
    if isinstance(obj, Mapping):
        return {"$dict": [[encode(k, max_tensor_bytes), encode(v, max_tensor_bytes)] for k, v in obj.items()]}
    if type(obj) is list:
        return [encode(v, max_tensor_bytes) for v in obj]
    if type(obj) is tuple:
        return {"$tuple": [encode(v, max_tensor_bytes) for v in obj]}
    raise TypeError(f"a value of type {type(obj).__name__}")


def decode(obj: Any) -> Any:
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "$float" in obj:
        return float.fromhex(obj["$float"])
    if "$tensor" in obj:
        dtype = getattr(torch, obj["$tensor"])
        raw = bytes.fromhex(obj["hex"])
        if not raw:
            return torch.empty(obj["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(obj["shape"]).clone()
    if "$dict" in obj:
        return {decode(k): decode(v) for k, v in obj["$dict"]}
    if "$tuple" in obj:
        return tuple(decode(v) for v in obj["$tuple"])
    raise ValueError(f"unknown marker value {obj!r}")
