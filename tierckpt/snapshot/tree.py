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
- anything that cannot be stored (a value of another type; a nested, sparse, quantized or meta tensor; a
  tensor subclass) raises ``TypeError`` naming its key path and what it is, before any buffer is touched.

Cost: a save of a state with thousands of tensors waits for this module, so the common shapes of a state (dicts of
plain tensors under str/int keys, and dicts of those, such as an optimizer's per-parameter state) are encoded a
whole dict at a time, reading each tensor attribute through ``map``
rather than per-tensor Python code, and a :class:`FlattenMemo` of the previous flatten supplies key paths, leaf
names and shape tuples when the new state's keys, dtypes and shapes compare equal to the old ones. The memo holds
no tensor, and every tensor attribute that decides a save's correctness (type, dtype, shape, layout, device, data
pointer for aliasing) is read from the new state every time.
"""

from __future__ import annotations

import base64
import collections
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import chain, compress
from typing import Any, NamedTuple

import numpy as np
import torch

from ..format.dtypes import ITEMSIZE
from ..format.plan import LeafSpec
from .dtensor import is_dtensor, shard_info
from .dtypes import NUMPY_TO_CODE, TORCH_TO_CODE

#: Trees deeper than this are refused when decoding (a hostile manifest could otherwise exhaust the stack).
MAX_DEPTH = 200
#: A dict holding at least this many values, all plain tensors under str/int keys, is encoded in one batch; below
#: it the batch's fixed cost (a few sets and lists) exceeds the per-item path's.
BATCH_MIN = 8

#: Exact types of the tensors and keys that batches take (subclasses take the per-item paths); :mod:`.loadbatch`
#: and :mod:`.capture` batch the same ones.
PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
PLAIN_KEY_TYPES = frozenset({str, int})  # repr() and str() of these are plain, so paths can be memoised
_STRIDED = frozenset({torch.strided})
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_LAYOUT = operator.attrgetter("layout")
_DEVICE = operator.attrgetter("device")
_IS_CPU = operator.attrgetter("is_cpu")
_NUMEL = torch.Tensor.numel
_DATA_PTR = torch.Tensor.data_ptr


@dataclass
class Leaf:
    """One stored tensor or array, as one object (see :attr:`FlatState.leaves`)."""

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


class _NodeMemo:
    """What encoding one all-tensor dict produced last time: reused when its keys, dtypes and shapes are unchanged.

    Never mutated once built (a memo may be shared by the flattens of consecutive saves)."""

    __slots__ = ("keys", "paths", "bases", "dtypes", "codes", "shapes", "nbytes", "first", "items")

    def __init__(self, keys: list, paths: list[str], bases: list[str], dtypes: list | None = None,
                 codes: list[str] | None = None, shapes: list[tuple[int, ...]] | None = None,
                 nbytes: list[int] | None = None, first: int = -1, items: list | None = None) -> None:
        self.keys, self.paths, self.bases = keys, paths, bases
        self.dtypes, self.codes, self.shapes, self.nbytes = dtypes, codes, shapes, nbytes
        self.first, self.items = first, items  # leaf index of the first value, and the encoded items (no aliases)


@dataclass(frozen=True)
class FlattenMemo:
    """What one :func:`flatten` learned, to speed up the next flatten of a state of the same structure.

    It holds key paths, names, dtypes and shapes, never a tensor; every entry is used only after comparing equal to
    what the new state has, so a stale memo costs time, never correctness.
    """

    nodes: dict[tuple[str, str | None], _NodeMemo]
    bases: list[str]
    names: list[str]
    codes: list[str]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    specs: tuple[LeafSpec, ...]


@dataclass
class FlatState:
    """The encoded tree plus one column per leaf attribute (columns, not objects: thousands of leaves per save)."""

    tree: Any
    values: list[Any]  # torch.Tensor | np.ndarray per leaf; the caller clears it once the data is copied
    kinds: list[str]  # "torch" | "numpy"
    specs: tuple[LeafSpec, ...]  # name, dtype code, shape, nbytes: what the snapshot plan depends on
    paths: list[str]
    shards: list[dict[str, Any] | None]  # DTensor shards: place in the global tensor
    stateful_paths: list[str] = field(default_factory=list)
    all_cpu: bool = True  # every torch leaf is in host memory (the copy needs no device-to-host path)
    memo: FlattenMemo | None = None
    #: Each leaf's data pointer as read by this flatten (0 for arrays; any value for empty tensors, which are never
    #: copied): the copy that follows at once reuses them instead of reading them again (see
    #: :func:`.copier.copy_into`'s ``layout_checked``).
    ptrs: list[int] = field(default_factory=list)

    @property
    def leaves(self) -> list[Leaf]:
        """The leaves as objects (for tools and tests; the save path reads the columns)."""
        return [Leaf(p, s.name, v, k, s.dtype, s.shape, s.nbytes, sh)
                for p, s, v, k, sh in zip(self.paths, self.specs, self.values, self.kinds, self.shards)]


class StateDictOf(NamedTuple):
    """The ``state_dict()`` of a stateful object, taken earlier (a lazy save's capture, :mod:`.capture`): encoded
    exactly as the object itself would be (``$stateful`` with its type's name)."""

    type_name: str
    state_dict: Any


class GeneratorState(NamedTuple):
    """A ``torch.Generator``'s state, taken earlier (a lazy save's capture): encoded as the generator would be."""

    state: torch.Tensor
    device: str


def type_name(obj: Any) -> str:
    """What a ``$stateful`` node records of its object's type."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def state_dict_of(obj: Any, path: str) -> Any:
    """``obj.state_dict()``, its failure raised as the ``TypeError`` that names the key path (flatten and capture)."""
    try:
        return obj.state_dict()
    except Exception as exc:
        raise TypeError(f"{type(obj).__name__}.state_dict() failed at {path}: {exc}") from exc


def unsupported(obj: Any, path: str) -> TypeError:
    """The error for a value no checkpoint can hold (flatten and capture raise the same one)."""
    return TypeError(
        f"cannot checkpoint a value of type {type_name(obj)} at {path}: "
        "supported are tensors, numpy arrays, objects with state_dict()/load_state_dict(), and nested "
        "dict/list/tuple of those and of int, float, str, bool, None, bytes"
    )


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (torch.Tensor, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _refuse_tensor(t: torch.Tensor, path: str) -> None:
    """Raise the TypeError that says why ``t`` cannot be stored, and what to store instead (the checks in the
    order they are documented: nested, sparse, quantized, meta, a subclass, a dtype safetensors lacks)."""
    if t.is_nested:  # strided nested tensors have no sizes; jagged ones are a subclass with a symbolic size
        raise TypeError(f"cannot checkpoint a nested tensor ({t.layout}) at {path}: store its components "
                        "(t.unbind()) or a padded tensor (t.to_padded_tensor(0.0)) instead")
    if t.layout is not torch.strided:
        raise TypeError(f"cannot checkpoint a sparse tensor ({t.layout}) at {path}: store t.to_dense(), or its "
                        "indices and values, instead")
    if t.is_quantized:
        raise TypeError(f"cannot checkpoint a quantized tensor ({t.dtype}) at {path}: store t.dequantize(), or "
                        "t.int_repr() with its scale and zero point, instead")
    if t.is_meta:
        raise TypeError(f"cannot checkpoint a meta tensor at {path}: it holds no data (materialise the module "
                        "first, e.g. to_empty() and its initialisation)")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"cannot checkpoint tensor subclass {type(t).__name__} at {path}")
    raise TypeError(f"cannot checkpoint tensor of dtype {t.dtype} at {path}")


def _alias_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same memory viewed the same way: stored once (tied parameters)."""
    return (t.data_ptr(), t.device, t.dtype, tuple(t.shape), t.stride())


def _child_prefix(prefix: str | None, key: Any) -> str:
    """The dotted name prefix of a child (``None`` stands for the root: no parts yet)."""
    return str(key) if prefix is None else prefix + "." + str(key)


def leaf_names(bases: list[str]) -> list[str]:
    """Unique leaf names: a base used before gets ``#2``, ``#3``... (in leaf order, so names are deterministic)."""
    if len(set(bases)) == len(bases):
        return bases
    names: list[str] = []
    used: set[str] = set()
    for base in bases:
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}#{n}"
        used.add(name)
        names.append(name)
    return names


class _Flattener:
    def __init__(self, memo: FlattenMemo | None) -> None:
        # one column per leaf attribute
        self.values: list[Any] = []
        self.ptrs: list[int] = []
        self.kinds: list[str] = []
        self.codes: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.nbytes: list[int] = []
        self.paths: list[str] = []
        self.bases: list[str] = []
        self.shards: list[dict[str, Any] | None] = []
        self.stateful: list[str] = []
        self.all_cpu = True
        # Aliases (the same memory under several keys) are found by data pointer first: a pointer no earlier leaf
        # has cannot alias, so the full key (pointer, device, dtype, shape, stride) is computed only on a pointer
        # collision. by_ptr: data pointer -> the first leaf there while its full key is not yet in `seen`, else -1.
        self.by_ptr: dict[int, int] = {}
        self.seen: dict[tuple, int] = {}
        self.old_nodes = memo.nodes if memo is not None else {}
        self.nodes: dict[tuple[str, str | None], _NodeMemo] = {}

    def _append(self, value: Any, kind: str, code: str, shape: tuple[int, ...], nbytes: int, path: str,
                prefix: str | None, shard: dict[str, Any] | None = None, ptr: int = 0) -> int:
        idx = len(self.values)
        self.values.append(value)
        self.ptrs.append(ptr)
        self.kinds.append(kind)
        self.codes.append(code)
        self.shapes.append(shape)
        self.nbytes.append(nbytes)
        self.paths.append(path)
        self.bases.append(prefix or "tensor")
        self.shards.append(shard)
        return idx

    def add_tensor(self, t: torch.Tensor, path: str, prefix: str | None, shard: dict[str, Any] | None = None) -> int:
        code = TORCH_TO_CODE.get(t.dtype)  # quantized dtypes have no code
        is_cpu = t.is_cpu
        if code is None or t.layout is not torch.strided or t.is_nested or (not is_cpu and t.is_meta) or (
                type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)):
            _refuse_tensor(t, path)
        numel = t.numel()
        idx = len(self.values)
        ptr = 0
        if numel:
            ptr = t.data_ptr()
            first = self.by_ptr.get(ptr)
            if first is None:
                self.by_ptr[ptr] = idx
            else:  # an earlier leaf starts at the same address: compare full keys
                if first >= 0:
                    self.seen[_alias_key(self.values[first])] = first
                    self.by_ptr[ptr] = -1
                key = _alias_key(t)
                if key in self.seen:
                    return self.seen[key]
                self.seen[key] = idx
        if not is_cpu:
            self.all_cpu = False
        # no detach(): the copy into staging runs under no_grad, and a detach costs microseconds per tensor
        return self._append(t, "torch", code, tuple(t.shape), numel * ITEMSIZE[code], path, prefix, shard, ptr)

    def add_array(self, a: np.ndarray, path: str, prefix: str | None) -> int:
        code = (NUMPY_TO_CODE.get(a.dtype.newbyteorder("=")) if a.dtype.byteorder not in ("|", "=")
                else NUMPY_TO_CODE.get(a.dtype))
        if code is None:
            raise TypeError(f"cannot checkpoint numpy array of dtype {a.dtype} at {path}")
        return self._append(a, "numpy", code, tuple(a.shape), a.size * a.dtype.itemsize, path, prefix)

    def encode_tensor_dict(self, obj: dict, path: str, prefix: str | None) -> list | None:
        """The items of a dict of plain tensors, encoded in one batch; None when the batch does not apply (then the
        per-item path runs, and raises the same error for the same first bad value as always)."""
        vals = list(obj.values())
        if not set(map(type, vals)) <= PLAIN_TENSOR_TYPES:
            return None
        keys = list(obj)
        if not set(map(type, keys)) <= PLAIN_KEY_TYPES:
            return None
        memo = self.old_nodes.get((path, prefix))
        if memo is None or memo.keys != keys:
            bases = [str(k) or "tensor" for k in keys] if prefix is None else [f"{prefix}.{k}" for k in keys]
            memo = _NodeMemo(keys, [f"{path}[{k!r}]" for k in keys], bases)

        def items_of(first: int) -> list:
            return [[k, {"$tensor": i}] for k, i in zip(keys, range(first, first + len(keys)))]

        return self._encode_batch(vals, memo, path, prefix, items_of, keys)

    def encode_tensor_dicts(self, obj: dict, path: str, prefix: str | None) -> list | None:
        """The items of a dict of dicts of plain tensors (an optimizer's per-parameter state, ``{param: {"step":
        ..., "exp_avg": ..., ...}}``) in one batch, encoded exactly as the per-item path would; None when the batch
        does not apply (or a tensor aliases another: the per-item path stores aliases once)."""
        inner = list(obj.values())
        if set(map(type, inner)) != {dict}:
            return None
        keys = list(obj)
        inner_keys = [list(d) for d in inner]
        vals = [v for d in inner for v in d.values()]
        if len(vals) < BATCH_MIN or not set(map(type, vals)) <= PLAIN_TENSOR_TYPES:
            return None
        if (not set(map(type, keys)) <= PLAIN_KEY_TYPES
                or not set(map(type, chain.from_iterable(inner_keys))) <= PLAIN_KEY_TYPES):
            return None
        signature = (keys, inner_keys)
        memo = self.old_nodes.get((path, prefix))
        if memo is None or memo.keys != signature:
            paths, bases = [], []
            for k, ks in zip(keys, inner_keys):
                outer_path, outer_prefix = f"{path}[{k!r}]", _child_prefix(prefix, k)
                paths += [f"{outer_path}[{k2!r}]" for k2 in ks]
                bases += [_child_prefix(outer_prefix, k2) or "tensor" for k2 in ks]
            memo = _NodeMemo(signature, paths, bases)

        def items_of(first: int) -> list:
            items, i = [], first
            for k, ks in zip(keys, inner_keys):
                items.append([k, {"$dict": [[k2, {"$tensor": j}] for k2, j in zip(ks, range(i, i + len(ks)))]}])
                i += len(ks)
            return items

        return self._encode_batch(vals, memo, path, prefix, items_of, None)

    def _encode_batch(self, vals: list, memo: _NodeMemo, path: str, prefix: str | None,
                      items_of: Callable[[int], list], alias_keys: list | None) -> list | None:
        """Append a batch of plain tensors as leaves and return the node's encoded items (from the memo when the
        dtypes, shapes and leaf positions are unchanged). ``alias_keys``: the dict's keys, to encode a batch with an
        aliased tensor item by item; None: return None for such a batch, before anything was appended."""
        dtypes = list(map(_DTYPE, vals))
        if dtypes == memo.dtypes:
            codes = memo.codes
        else:
            codes = list(map(TORCH_TO_CODE.get, dtypes))
            if None in codes:  # quantized, complex...: the per-item path names the first one
                return None
        if not set(map(_LAYOUT, vals)) <= _STRIDED:
            return None
        all_cpu = all(map(_IS_CPU, vals))
        if not all_cpu and any(d.type == "meta" for d in set(map(_DEVICE, vals))):
            return None
        try:
            sizes = list(map(_SHAPE, vals))
        except RuntimeError:  # a nested tensor of the strided layout has no sizes: the per-item path names it
            return None
        if codes is memo.codes and sizes == memo.shapes:
            shapes, nbytes = memo.shapes, memo.nbytes
        else:
            shapes = list(map(tuple, sizes))
            nbytes = list(map(operator.mul, map(_NUMEL, vals), map(ITEMSIZE.__getitem__, codes)))  # type: ignore[arg-type]
        first = len(self.values)
        n = len(vals)
        ptrs = list(map(_DATA_PTR, vals))
        # data pointer -> leaf of every non-empty tensor (empty ones never alias); kept if all pointers are new
        pairs = zip(ptrs, range(first, first + n))
        if 0 in nbytes:
            fresh, n_live = dict(compress(pairs, nbytes)), n - nbytes.count(0)
        else:
            fresh, n_live = dict(pairs), n
        if len(fresh) != n_live or not self.by_ptr.keys().isdisjoint(fresh):
            if alias_keys is None:
                return None
            if not all_cpu:
                self.all_cpu = False
            return self._encode_aliased(alias_keys, vals, dtypes, codes, shapes, nbytes, ptrs, memo, path, prefix)
        if not all_cpu:
            self.all_cpu = False
        self.by_ptr.update(fresh)
        self._extend(vals, codes, shapes, nbytes, ptrs, memo.paths, memo.bases, 0, n, record=False)
        if memo.first == first and memo.items is not None and memo.codes is codes and memo.shapes is shapes:
            self.nodes[(path, prefix)] = memo
            return memo.items
        items = items_of(first)
        self.nodes[(path, prefix)] = _NodeMemo(memo.keys, memo.paths, memo.bases, dtypes, codes, shapes, nbytes,
                                               first, items)
        return items

    def _encode_aliased(self, keys: list, vals: list, dtypes: list, codes: list[str], shapes: list, nbytes: list[int],
                        ptrs: list[int], memo: _NodeMemo, path: str, prefix: str | None) -> list:
        """A batch in which some tensor shares its address with an earlier one (tied weights): runs of fresh
        addresses still go in batches; each colliding tensor goes through add_tensor, which compares full keys."""
        known, earlier, colliding = self.by_ptr, set(), []
        for j, (p, nb) in enumerate(zip(ptrs, nbytes)):
            if nb:
                if p in known or p in earlier:
                    colliding.append(j)
                earlier.add(p)
        items: list = []
        start, first, n = 0, len(self.values), len(vals)
        for j in [*colliding, n]:
            self._extend(vals, codes, shapes, nbytes, ptrs, memo.paths, memo.bases, start, j)
            items.extend([k, {"$tensor": i}] for k, i in zip(keys[start:j], range(first, first + j - start)))
            if j < n:
                items.append([keys[j], {"$tensor": self.add_tensor(vals[j], memo.paths[j], memo.bases[j])}])
            first = len(self.values)
            start = j + 1
        self.nodes[(path, prefix)] = _NodeMemo(keys, memo.paths, memo.bases, dtypes, codes, shapes, nbytes)
        return items

    def _extend(self, vals: list, codes: list[str], shapes: list, nbytes: list[int], ptrs: list[int],
                paths: list[str], bases: list[str], a: int, b: int, *, record: bool = True) -> None:
        """Append tensors ``a:b`` of a batch (and, with ``record``, index their data pointers ``ptrs``, which no
        earlier leaf has and which are all distinct, for finding aliases)."""
        if a == 0 and b == len(vals):
            sl = slice(None)
        elif a >= b:
            return
        else:
            sl = slice(a, b)
        first = len(self.values)
        nb = nbytes[sl]
        idx = range(first, first + len(nb))
        if record:
            self.by_ptr.update(zip(ptrs[sl], idx) if 0 not in nb else compress(zip(ptrs[sl], idx), nb))
        self.values += vals[sl]
        self.ptrs += ptrs[sl]
        self.kinds += ["torch"] * len(nb)
        self.codes += codes[sl]
        self.shapes += shapes[sl]
        self.nbytes += nb
        self.paths += paths[sl]
        self.bases += bases[sl]
        self.shards += [None] * len(nb)

    def encode_mapping(self, obj: Mapping, path: str, prefix: str | None, depth: int) -> dict[str, list]:
        tag = "$odict" if isinstance(obj, collections.OrderedDict) else "$dict"
        if type(obj) is dict or type(obj) is collections.OrderedDict:
            batch = None
            if len(obj) >= BATCH_MIN:
                batch = self.encode_tensor_dict(obj, path, prefix)
            if batch is None and obj and type(next(iter(obj.values()))) is dict and depth + 2 <= MAX_DEPTH:
                batch = self.encode_tensor_dicts(obj, path, prefix)
            if batch is not None:
                return {tag: batch}
        items = []
        for k, v in obj.items():
            tk = type(k)
            if tk is not str and tk is not int and not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                raise TypeError(f"cannot checkpoint dict key of type {tk.__name__} at {path}")
            items.append([k if tk is str or tk is int else self.encode(k, path, prefix, depth + 1),
                          self.encode(v, f"{path}[{k!r}]", _child_prefix(prefix, k), depth + 1)])
        return {tag: items}

    def encode(self, obj: Any, path: str, prefix: str | None, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
        tp = type(obj)
        if tp is torch.Tensor or tp is torch.nn.Parameter:  # the common cases first
            return {"$tensor": self.add_tensor(obj, path, prefix)}
        if tp is dict or tp is collections.OrderedDict:
            return self.encode_mapping(obj, path, prefix, depth)
        if tp is int or tp is str:
            return obj
        if tp is StateDictOf:
            self.stateful.append(path)
            return {"$stateful": self.encode(obj.state_dict, path, prefix, depth + 1), "type": obj.type_name}
        if tp is GeneratorState:
            return {"$generator": self.add_tensor(obj.state, path, prefix), "device": obj.device}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return {"$float": float(obj).hex()}
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(obj)).decode()}
        if is_dtensor(obj):
            local, info, writer = shard_info(obj, path)
            code = TORCH_TO_CODE.get(local.dtype)
            if code is None:
                raise TypeError(f"cannot checkpoint tensor of dtype {local.dtype} at {path}")
            if writer:  # a replicated shard is stored by one rank only
                self.add_tensor(local, path, prefix, shard=info)
            # the layout as every rank saved it, also on ranks that store no shard of it (a replicated one)
            return {"$dtensor": path, "global_shape": info["global_shape"], "dtype": code,
                    "placements": info["placements"], "mesh_shape": info["mesh_shape"], "mesh_dims": info["mesh_dims"]}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self.add_tensor(obj, path, prefix)}
        if isinstance(obj, np.ndarray):
            return {"$ndarray": self.add_array(obj, path, prefix)}
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return {"$npscalar": self.add_array(np.asarray(obj), path, prefix)}
        if isinstance(obj, torch.Generator):
            return {"$generator": self.add_tensor(obj.get_state(), path, prefix), "device": str(obj.device)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"$size": list(obj)}
        if isinstance(obj, Mapping):
            return self.encode_mapping(obj, path, prefix, depth)
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]", _child_prefix(prefix, i), depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, f"{path}[{i}]", _child_prefix(prefix, i), depth + 1)
                               for i, v in enumerate(obj)]}
        if isinstance(obj, (set, frozenset)):
            return {"$set": [self.encode(v, path, prefix, depth + 1) for v in obj]}
        if is_stateful(obj):
            self.stateful.append(path)
            sd = state_dict_of(obj, path)
            return {"$stateful": self.encode(sd, path, prefix, depth + 1), "type": type_name(obj)}
        raise unsupported(obj, path)


def flatten(state: Mapping[str, Any], memo: FlattenMemo | None = None) -> FlatState:
    """Encode ``state`` (read-only). Raises ``TypeError`` naming the key path of anything that cannot be stored.

    ``memo``: the :attr:`FlatState.memo` of an earlier flatten (of any state); it only makes this one faster.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    f = _Flattener(memo)
    try:
        tree = f.encode(state, "state", None)
    except RecursionError:
        raise TypeError("state is too deeply nested or contains a reference cycle") from None
    if memo is not None and f.bases == memo.bases:
        names = memo.names
    else:
        names = leaf_names(f.bases)
    if memo is not None and names is memo.names and f.codes == memo.codes and f.shapes == memo.shapes \
            and f.nbytes == memo.nbytes:
        specs = memo.specs
    else:
        specs = tuple(map(LeafSpec, names, f.codes, f.shapes, f.nbytes))
    new_memo = FlattenMemo(f.nodes, f.bases, names, f.codes, f.shapes, f.nbytes, specs)
    return FlatState(tree, f.values, f.kinds, specs, f.paths, f.shards, f.stateful, f.all_cpu, new_memo, f.ptrs)

