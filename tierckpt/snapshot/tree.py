"""A state mapping <-> a JSON tree with explicit type tags, plus the tensors it holds.

Encoding (``flatten``): JSON null/bool/int/str/list stand for themselves; everything else is a one-key object whose key
is a tag: ``$float`` (``float.hex()``, exact incl. inf/nan/-0.0), ``$bytes`` (base64), ``$tuple``, ``$dict`` and
``$odict`` (lists of ``[key, value]`` pairs, so int and tuple keys survive), ``$set``, ``$tensor`` / ``$ndarray`` /
``$npscalar`` / ``$generator`` (an index into the tensor table), ``$stateful`` (an object restored through
``load_state_dict``), ``$dtype``, ``$device``, ``$size``, ``$dtensor`` (a key path whose shards are found by path, see
:mod:`.dtensor`). Decoding (:mod:`.load`) accepts exactly these tags.

Invariants:
- flattening reads the state and never mutates it, and never touches an RNG;
- the same tensor memory reached through several keys (tied parameters) is stored once and referenced twice;
- anything that cannot be stored raises ``TypeError`` naming its key path, before any buffer is touched.
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.plan import LeafSpec
from .dtensor import is_dtensor, shard_info
from .dtypes import NUMPY_TO_CODE, TORCH_TO_CODE

#: Trees deeper than this are refused when decoding (a hostile manifest could otherwise exhaust the stack).
MAX_DEPTH = 200


@dataclass
class Leaf:
    path: str
    name: str
    value: torch.Tensor | np.ndarray
    kind: str  # "torch" | "numpy"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    shard: dict[str, Any] | None = None  # DTensor shards: place in the global tensor

    def spec(self) -> LeafSpec:
        return LeafSpec(self.name, self.dtype, self.shape, self.nbytes)


@dataclass
class FlatState:
    tree: Any
    leaves: list[Leaf]
    stateful_paths: list[str] = field(default_factory=list)


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (torch.Tensor, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _key_repr(key: Any) -> str:
    return f"[{key!r}]"


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.names: set[str] = set()
        self.seen: dict[tuple, int] = {}
        self.stateful: list[str] = []

    def leaf_name(self, parts: list[str]) -> str:
        base = ".".join(parts) or "tensor"
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def add_tensor(self, t: torch.Tensor, path: str, parts: list[str], shard: dict[str, Any] | None = None) -> int:
        # per-tensor cost matters (states have thousands of tensors): only cheap attribute reads here
        if t.layout is not torch.strided or t.is_quantized or t.is_meta:
            raise TypeError(f"cannot checkpoint {t.layout} / quantized / meta tensor at {path}")
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise TypeError(f"cannot checkpoint tensor subclass {type(t).__name__} at {path}")
        code = TORCH_TO_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"cannot checkpoint tensor of dtype {t.dtype} at {path}")
        shape = tuple(t.shape)
        numel = t.numel()
        key = None
        if numel:
            key = (t.data_ptr(), t.device, t.dtype, shape, t.stride())
            if key in self.seen:
                return self.seen[key]
        idx = len(self.leaves)
        # no detach(): the copy into staging runs under no_grad, and a detach costs microseconds per tensor
        self.leaves.append(Leaf(path, self.leaf_name(parts), t, "torch", code, shape, numel * t.element_size(), shard))
        if key is not None:
            self.seen[key] = idx
        return idx

    def add_array(self, a: np.ndarray, path: str, parts: list[str]) -> int:
        code = NUMPY_TO_CODE.get(a.dtype.newbyteorder("=")) if a.dtype.byteorder not in ("|", "=") else NUMPY_TO_CODE.get(a.dtype)
        if code is None:
            raise TypeError(f"cannot checkpoint numpy array of dtype {a.dtype} at {path}")
        idx = len(self.leaves)
        self.leaves.append(Leaf(path, self.leaf_name(parts), a, "numpy", code, tuple(a.shape), a.size * a.dtype.itemsize))
        return idx

    def encode(self, obj: Any, path: str, parts: list[str], depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:  # the common case first
            return {"$tensor": self.add_tensor(obj, path, parts)}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return {"$float": float(obj).hex()}
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(obj)).decode()}
        if is_dtensor(obj):
            local, info, writer = shard_info(obj)
            code = TORCH_TO_CODE.get(local.dtype)
            if code is None:
                raise TypeError(f"cannot checkpoint tensor of dtype {local.dtype} at {path}")
            if writer:  # a replicated shard is stored by one rank only
                self.add_tensor(local, path, parts, shard=info)
            return {"$dtensor": path, "global_shape": info["global_shape"], "dtype": code}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self.add_tensor(obj, path, parts)}
        if isinstance(obj, np.ndarray):
            return {"$ndarray": self.add_array(obj, path, parts)}
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {"$npscalar": self.add_array(np.asarray(obj), path, parts)}
        if isinstance(obj, torch.Generator):
            return {"$generator": self.add_tensor(obj.get_state(), path, parts), "device": str(obj.device)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"$size": list(obj)}
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                    raise TypeError(f"cannot checkpoint dict key of type {type(k).__name__} at {path}")
                items.append([self.encode(k, path, parts, depth + 1), self.encode(v, path + _key_repr(k), parts + [str(k)], depth + 1)])
            return {"$odict" if isinstance(obj, collections.OrderedDict) else "$dict": items}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]", parts + [str(i)], depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, f"{path}[{i}]", parts + [str(i)], depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            return {"$set": [self.encode(v, path, parts, depth + 1) for v in obj]}
        if is_stateful(obj):
            self.stateful.append(path)
            try:
                sd = obj.state_dict()
            except Exception as exc:
                raise TypeError(f"{type(obj).__name__}.state_dict() failed at {path}: {exc}") from exc
            return {"$stateful": self.encode(sd, path, parts, depth + 1), "type": f"{type(obj).__module__}.{type(obj).__qualname__}"}
        raise TypeError(
            f"cannot checkpoint a value of type {type(obj).__module__}.{type(obj).__qualname__} at {path}: "
            "supported are tensors, numpy arrays, objects with state_dict()/load_state_dict(), and nested "
            "dict/list/tuple of those and of int, float, str, bool, None, bytes"
        )


def flatten(state: Mapping[str, Any]) -> FlatState:
    """Encode ``state`` (read-only). Raises ``TypeError`` naming the key path of anything that cannot be stored."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    f = _Flattener()
    try:
        tree = f.encode(state, "state", [])
    except RecursionError:
        raise TypeError("state is too deeply nested or contains a reference cycle") from None
    return FlatState(tree, f.leaves, f.stateful)
