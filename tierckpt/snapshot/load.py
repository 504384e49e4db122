"""Loading a saved state tree into a live state in place (values decoded by :mod:`.decode`).

Invariants:
- loading is two-phase: :func:`plan_restore` checks every key, shape and dtype against the live state and raises
  :class:`StateMismatchError` before anything is changed (it needs only the manifest, so a restore may read the
  files into a staging buffer meanwhile); :meth:`RestorePlan.apply` first decodes every value (a malformed node
  raises here, with the state untouched) and only then changes the state.
- with ``in_place=True`` the plan also names, in :attr:`RestorePlan.direct`, the live CPU tensors that the reader may
  fill straight from the files (contiguous, same dtype and shape, not distributed); the restore reads the large ones
  straight into their memory (they change while the files are read, before the whole checkpoint is verified) and
  copies the small ones in from the verified buffer, and ``apply`` hands both on as the live tensors themselves.
- a dict of plain tensors is checked in one batch (:mod:`.loadbatch`) only where the walk below would accept every
  item and plan the same; everything else, every mismatch included, takes the walk, which names the key path.
- a live tensor whose elements share memory (an ``expand()``ed view: :func:`.loadbatch.overlaps_itself`) cannot
  take the saved values in place: in a plain dict or list of the state a fresh tensor holding them takes its place
  (as a read-only numpy array or a Python value is replaced), and in a module's ``state_dict()``, which only
  ``load_state_dict`` could change and cannot, the plan raises :class:`StateMismatchError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, MutableMapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError, StateMismatchError
from ..format.manifest import TensorRecord
from . import hostcopy
from .copier import copy_tensors
from .decode import Decoder
from .decode import decode_tree as decode_tree  # imported from here too
from .dtensor import is_dtensor, target_box
from .dtypes import CODE_TO_TORCH, NUMPY_TO_CODE, TORCH_TO_CODE
from .loadbatch import detached, direct_flags, overlaps_itself, plain_tensor_items
from .loaded import LoadedBuffer, TensorSource
from .modules import LOADING, SAVING, plain_tree
from .tree import MAX_DEPTH, is_stateful

_INDEX = attrgetter("index")


@dataclass
class RestorePlan:
    """Checked actions, applied only after the checkpoint's bytes are loaded and verified."""

    #: each action decodes what it needs and returns the closure that changes the state
    actions: list[Callable[[Decoder], Callable[[], None]]] = field(default_factory=list)
    #: key path -> (live target, saved dtype code, saved global shape) of every distributed-tensor leaf
    dtensor_targets: dict[str, tuple[Any, str, tuple[int, ...]]] = field(default_factory=dict)
    #: record index -> live CPU tensor its bytes may be read straight into (``in_place=True`` only)
    direct: dict[int, torch.Tensor] = field(default_factory=dict)
    #: (live tensor, record index) of every plain tensor leaf whose bytes must be copied in, done in one batch
    #: (leaves read straight into their live memory are not listed: they hold their bytes already)
    copies: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def apply(self, records: tuple[TensorRecord, ...], tensor: TensorSource, *, step: int | None,
              dtensor: Callable[[str], Any] | None = None, loaded: LoadedBuffer | None = None) -> None:
        """Change the state. ``loaded``: where ``tensor(i)``'s bytes lie, so that the plain tensors are copied
        straight from there in one native call (no view per tensor) when every live one is a plain host tensor."""
        dec = Decoder(records, tensor, step=step, dtensor=dtensor, direct=frozenset(self.direct))
        # decode everything first (a malformed node raises here, before the state is touched), then commit. No
        # commit reads a live tensor another one writes (decoded values are views of the loaded bytes or clones),
        # so the tensor copies can run together, after the others.
        commits = [action(dec) for action in self.actions]
        idx = [i for _, i in self.copies]
        ranges = loaded.ranges(records, idx) if loaded is not None and hostcopy.available and idx else None
        srcs = [tensor(i) for i in idx] if ranges is None else None
        for commit in commits:
            commit()
        dsts = [d for d, _ in self.copies]
        # the live tensors are read after the commits (a load_state_dict may have replaced some memory)
        if ranges is not None and hostcopy.copy_from_addresses(dsts, *ranges):
            return
        _copy_all(dsts, srcs if srcs is not None else [tensor(i) for i in idx])


def _mismatch(msg: str, path: str, step: int | None) -> StateMismatchError:
    return StateMismatchError(f"{msg} at {path}", step=step)


def _is_tag(node: Any, tag: str) -> bool:
    return isinstance(node, dict) and tag in node


def plan_restore(
    state: MutableMapping[str, Any], tree: Any, records: tuple[TensorRecord, ...], *, strict: bool, step: int | None,
    in_place: bool = False,
) -> RestorePlan:
    """Check ``tree`` against the live ``state`` and return the actions that load it in place.

    ``in_place``: also collect :attr:`RestorePlan.direct` (see the module docstring)."""
    if not isinstance(state, MutableMapping):
        raise TypeError(f"state must be a mutable mapping, got {type(state).__name__}")
    if not _is_tag(tree, "$dict") and not _is_tag(tree, "$odict"):
        raise CorruptCheckpointError("malformed state tree: root is not a mapping", step=step)
    plan = RestorePlan()
    checker = _Checker(records, strict, step, plan, in_place=in_place)
    checker.mapping(state, tree, "state", 0)
    return plan


def direct_target(t: Any, rec: TensorRecord, *, layout_checked: bool = False) -> torch.Tensor | None:
    """``t`` as a plain tensor the reader can fill with ``rec``'s bytes, or None where it must be staged.

    ``layout_checked``: the caller found ``t``'s dtype and shape equal to the record's (so neither is read again,
    nor the conjugate bit: torch sets it on complex tensors only, and no saved dtype is complex)."""
    if (
        type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)
        or not t.is_cpu
        or not rec.nbytes
        or rec.kind != "torch"
        or rec.shard is not None
        or not layout_checked and (t.dtype is not CODE_TO_TORCH.get(rec.dtype) or tuple(t.shape) != rec.shape
                                   or t.is_conj())
        or not t.is_contiguous()
        or t.is_neg()
    ):
        return None
    return t.detach()


class _Checker:
    def __init__(self, records: tuple[TensorRecord, ...], strict: bool, step: int | None, plan: RestorePlan, *,
                 in_place: bool = False) -> None:
        self.records, self.strict, self.step, self.plan = records, strict, step, plan
        self.in_place = in_place
        self._keys = Decoder(records, _no_tensor, step=step)

    def key(self, node: Any) -> Any:
        """A saved dict key (str and int keys are stored as themselves)."""
        tk = type(node)
        return node if tk is str or tk is int else self._keys.key(node)

    def add_direct(self, live: Any, rec: TensorRecord, *, checked: bool = False) -> bool:
        """Make ``live`` the record's direct target where it can be (``checked``: see :func:`direct_target`);
        return whether it became that."""
        if self.in_place and rec.index not in self.plan.direct:
            t = direct_target(live, rec, layout_checked=checked)
            if t is not None:
                self.plan.direct[rec.index] = t
                return True
        return False

    def add_tensors(self, live: list[torch.Tensor], recs: list[TensorRecord], *, copy_rest: bool = True) -> None:
        """What :meth:`value` does for each plain tensor item, for a batch from :func:`plain_tensor_items`: make it
        its record's direct target where it can be, else (``copy_rest``) list it as a copy. ``copy_rest=False``:
        what :meth:`add_direct` alone does (a module whose ``load_state_dict`` copies the others)."""
        direct, copies = self.plan.direct, self.plan.copies
        if not self.in_place:
            if copy_rest:
                copies.extend(zip(live, map(_INDEX, recs)))
            return
        for t, rec, ok, target in zip(live, recs, direct_flags(live, recs), detached(live)):
            i = rec.index
            if ok and i not in direct:
                direct[i] = target
            elif copy_rest and not _same_view(direct.get(i), t):
                copies.append((t, i))

    def direct_in_object(self, live: Any, node: Any, depth: int = 0) -> None:
        """Pair the saved tree of a non-module object (an optimizer) with its live ``state_dict()`` and collect the
        tensors found at the same places. Live tensors there are either the object's own (an optimizer's moments) or
        fresh copies; either way ``load_state_dict`` gets the very memory the bytes were read into."""
        if depth > MAX_DEPTH:
            return
        if _is_tag(node, "$tensor") and isinstance(live, torch.Tensor):
            try:
                rec = self.record(node, "$tensor", "torch", "state")
            except CorruptCheckpointError:
                return  # a bad reference is raised by decoding, with the state untouched
            self.add_direct(live, rec)
        elif (_is_tag(node, "$dict") or _is_tag(node, "$odict")) and isinstance(live, Mapping):
            pairs = node.get("$dict", node.get("$odict"))
            if not isinstance(pairs, list):
                return
            for pair in pairs:
                if not isinstance(pair, list) or len(pair) != 2:
                    return
                try:
                    key = self.key(pair[0])
                    sub = live.get(key) if isinstance(key, Hashable) else None
                except (CorruptCheckpointError, TypeError):
                    return
                if sub is not None:
                    self.direct_in_object(sub, pair[1], depth + 1)
        elif isinstance(node, list) and isinstance(live, (list, tuple)) and len(live) == len(node):
            for sub_live, sub in zip(live, node):
                self.direct_in_object(sub_live, sub, depth + 1)

    def record(self, node: dict, tag: str, kind: str, path: str) -> TensorRecord:
        i = node[tag]
        if type(i) is not int or not 0 <= i < len(self.records) or self.records[i].kind != kind:
            raise CorruptCheckpointError(f"malformed state tree: bad tensor reference at {path}", step=self.step)
        return self.records[i]

    def mapping(self, cur: MutableMapping, node: dict, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError("malformed state tree: too deep", step=self.step)
        tag = "$dict" if "$dict" in node else "$odict"
        pairs = node[tag]
        if not isinstance(pairs, list):
            raise CorruptCheckpointError(f"malformed state tree at {path}", step=self.step)
        batch = plain_tensor_items(cur, pairs, self.records, strict=self.strict)
        if batch is not None:  # a dict of plain tensors that all match: checked in one batch
            self.add_tensors(*batch)
            return
        saved_keys = []
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2:
                raise CorruptCheckpointError(f"malformed state tree at {path}", step=self.step)
            key = self.key(pair[0])
            saved_keys.append(key)
            sub = f"{path}[{key!r}]"
            if key not in cur:
                if self.strict:
                    raise _mismatch("unexpected key in checkpoint (not in the state; strict=False allows it)",
                                    sub, self.step)
                self.free_dtensors(pair[1], sub)
                self.plan.actions.append(_setter(cur, key, pair[1]))
                continue
            self.value(cur, key, pair[1], sub, depth + 1)
        if self.strict:
            saved_set = set(saved_keys)
            missing = [k for k in cur if k not in saved_set]
            if missing:
                raise _mismatch(f"key {missing[0]!r} missing from the checkpoint (strict=False allows it)",
                                path, self.step)

    def value(self, parent: Any, key: Any, node: Any, path: str, depth: int) -> None:
        cur = parent[key]
        if _is_tag(node, "$stateful"):
            if not is_stateful(cur):
                raise _mismatch(f"checkpoint holds an object with state_dict() but the state has {type(cur).__name__}",
                                path, self.step)
            self.stateful(cur, node["$stateful"], path)
        elif _is_tag(node, "$dtensor"):
            if not isinstance(cur, torch.Tensor):
                raise _mismatch(f"checkpoint holds a distributed tensor but the state has {type(cur).__name__}",
                                path, self.step)
            self.check_dtensor(cur, node, path)
            self.plan.actions.append(_dtensor_copier(cur, node["$dtensor"]))
        elif _is_tag(node, "$tensor"):
            rec = self.record(node, "$tensor", "torch", path)
            if not isinstance(cur, torch.Tensor):
                raise _mismatch(f"checkpoint holds a tensor but the state has {type(cur).__name__}", path, self.step)
            self.check_tensor(cur, rec, path)
            if overlaps_itself(cur):  # nothing can be copied into it: a tensor of the saved values replaces it
                self.plan.actions.append(_tensor_replacer(parent, key, rec.index, cur))
            # a tensor that is its record's direct target holds its bytes once read; another (tied) needs a copy
            elif not self.add_direct(cur, rec, checked=True) and not _same_view(self.plan.direct.get(rec.index), cur):
                self.plan.copies.append((cur, rec.index))
        elif isinstance(cur, torch.Tensor):
            raise _mismatch("state holds a tensor but the checkpoint does not", path, self.step)
        elif (_is_tag(node, "$ndarray") and isinstance(cur, np.ndarray) and cur.flags.writeable
              and not any(st == 0 and n > 1 for n, st in zip(cur.shape, cur.strides))):
            rec = self.record(node, "$ndarray", "numpy", path)
            if tuple(cur.shape) != rec.shape or NUMPY_TO_CODE.get(cur.dtype) != rec.dtype:
                raise _mismatch(
                    f"numpy array mismatch: checkpoint {rec.dtype}{list(rec.shape)}, "
                    f"state {cur.dtype}{list(cur.shape)}", path, self.step
                )
            self.plan.actions.append(_np_copier(cur, node["$ndarray"]))
        elif _is_tag(node, "$generator") and isinstance(cur, torch.Generator):
            self.record(node, "$generator", "torch", path)
            self.plan.actions.append(_gen_setter(cur, node["$generator"]))
        elif (_is_tag(node, "$dict") or _is_tag(node, "$odict")) and isinstance(cur, MutableMapping):
            self.mapping(cur, node, path, depth)
        elif isinstance(node, list) and isinstance(cur, list) and len(cur) == len(node):
            for i, sub in enumerate(node):
                self.value(cur, i, sub, f"{path}[{i}]", depth + 1)
        else:
            self.plan.actions.append(_setter(parent, key, node))

    def stateful(self, obj: Any, node: Any, path: str) -> None:
        if isinstance(obj, torch.nn.Module):
            live = obj.state_dict()
            pairs = node.get("$dict", node.get("$odict")) if isinstance(node, dict) else None
            batch = plain_tensor_items(live, pairs, self.records, strict=self.strict) if isinstance(pairs, list) \
                else None
            if batch is not None and plain_tree(obj, SAVING, LOADING):
                # load_state_dict() would only copy each entry into the parameter or buffer the live entry is a view
                # of: the entries are read in place or copied in with the plain tensors (one native call), without
                # torch's walk (which filters the whole state dict once per child module)
                self.add_tensors(*batch)
                return
            if batch is not None:  # every saved entry a plain tensor matching its live one: checked in one batch
                self.add_tensors(*batch, copy_rest=False)
            else:
                self.module_item_by_item(live, self.module_entries(node, path), path)
            strict = self.strict

            def load_module(dec: Decoder) -> Callable[[], None]:
                sd = dec.decode(node, own=False)
                return lambda: _load_module(obj, sd, strict, path, dec.step)

            self.plan.actions.append(load_module)
        else:
            if _contains_tag(node, "$dtensor"):
                raise _mismatch(
                    f"{type(obj).__name__} state holds distributed tensors (DTensor) but nothing live to load them "
                    "into; checkpoint get_optimizer_state_dict(model, optimizer) instead and load it back with "
                    "set_optimizer_state_dict", path, self.step)

            if self.in_place:
                self.direct_in_object(obj.state_dict(), node)

            def load_object(dec: Decoder) -> Callable[[], None]:
                sd = dec.decode(node, own=True)
                return lambda: _load_object(obj, sd, path, dec.step)

            self.plan.actions.append(load_object)

    def module_item_by_item(self, live: Mapping[str, Any], saved: dict[str, TensorRecord | dict | None],
                            path: str) -> None:
        """A module's saved entries against its live ``state_dict()``, one by one (what a batch does not cover:
        distributed tensors, extra state, a mismatch to name)."""
        if self.strict:
            extra = [k for k in saved if k not in live]
            if extra:
                raise _mismatch(f"unexpected key {extra[0]!r} in checkpoint for module", path, self.step)
            missing = [k for k in live if k not in saved]
            if missing:
                raise _mismatch(f"key {missing[0]!r} of module missing from checkpoint", path, self.step)
        for k, rec in saved.items():
            if k not in live and isinstance(rec, dict):
                self.free_dtensors(rec, f"{path}[{k!r}]")
        for k, rec in saved.items():
            if k in live and isinstance(live[k], torch.Tensor) and isinstance(rec, dict):
                self.check_dtensor(live[k], rec, f"{path}[{k!r}]")
            elif k in live and isinstance(live[k], torch.Tensor) and rec is not None:
                self.check_tensor(live[k], rec, f"{path}[{k!r}]")
                if overlaps_itself(live[k]):
                    raise _mismatch(
                        f"the module's tensor (stride {list(live[k].stride())}) is an expand()ed view whose elements "
                        "share memory, which load_state_dict cannot copy into: register a tensor of its own memory "
                        "there (.clone())", f"{path}[{k!r}]", self.step)
                self.add_direct(live[k], rec, checked=True)

    def module_entries(self, node: Any, path: str) -> dict[str, TensorRecord | dict | None]:
        if not (_is_tag(node, "$dict") or _is_tag(node, "$odict")):
            raise CorruptCheckpointError(f"malformed state tree: module state at {path} is not a mapping",
                                         step=self.step)
        out: dict[str, TensorRecord | dict | None] = {}
        for pair in node.get("$dict", node.get("$odict")):
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                raise CorruptCheckpointError(f"malformed module state at {path}", step=self.step)
            k, v = pair
            if _is_tag(v, "$dtensor"):
                out[k] = v
            else:
                out[k] = self.record(v, "$tensor", "torch", path) if _is_tag(v, "$tensor") else None
        return out

    def free_dtensors(self, node: Any, path: str, depth: int = 0) -> None:
        """Distributed tensors with no live counterpart (strict=False) come back as full plain tensors."""
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError("malformed state tree: too deep", step=self.step)
        if _is_tag(node, "$dtensor"):
            gshape, code, key = node.get("global_shape"), node.get("dtype"), node.get("$dtensor")
            if (not isinstance(gshape, list) or not all(type(d) is int and 0 <= d < (1 << 40) for d in gshape)
                    or not isinstance(key, str) or code not in CODE_TO_TORCH):
                raise CorruptCheckpointError(f"malformed distributed tensor at {path}", step=self.step)
            self.plan.dtensor_targets[key] = (torch.empty(gshape, dtype=CODE_TO_TORCH[code]), code, tuple(gshape))
        elif isinstance(node, dict):
            for v in node.values():
                self.free_dtensors(v, path, depth + 1)
        elif isinstance(node, list):
            for v in node:
                self.free_dtensors(v, path, depth + 1)

    def check_dtensor(self, cur: torch.Tensor, node: dict, path: str) -> None:
        gshape, code, key = node.get("global_shape"), node.get("dtype"), node.get("$dtensor")
        if not isinstance(gshape, list) or not isinstance(key, str) or code not in CODE_TO_TORCH:
            raise CorruptCheckpointError(f"malformed distributed tensor at {path}", step=self.step)
        live_shape, _off, _shape = target_box(cur)
        if tuple(live_shape) != tuple(gshape):
            raise _mismatch(f"global shape mismatch: checkpoint {gshape}, state {list(live_shape)}", path, self.step)
        if TORCH_TO_CODE.get(cur.dtype) != code:
            raise _mismatch(f"dtype mismatch: checkpoint {CODE_TO_TORCH[code]}, state {cur.dtype}", path, self.step)
        self.plan.dtensor_targets[key] = (cur, code, tuple(gshape))

    def check_tensor(self, cur: torch.Tensor, rec: TensorRecord, path: str) -> None:
        kind = _unloadable(cur)
        if kind is not None:
            hint = "; it holds no memory: materialise it first (module.to_empty(device=...))" if cur.is_meta else ""
            raise _mismatch(f"cannot load the checkpoint's {CODE_TO_TORCH.get(rec.dtype)}{list(rec.shape)} into the "
                            f"state's {kind}{hint}", path, self.step)
        if tuple(cur.shape) != rec.shape:
            raise _mismatch(f"shape mismatch: checkpoint {list(rec.shape)}, state {list(cur.shape)}", path, self.step)
        if TORCH_TO_CODE.get(cur.dtype) != rec.dtype:
            raise _mismatch(f"dtype mismatch: checkpoint {CODE_TO_TORCH.get(rec.dtype)}, state {cur.dtype}",
                            path, self.step)


def _unloadable(t: torch.Tensor) -> str | None:
    """What ``t`` is when no saved tensor can be loaded into it (a nested or sparse tensor, whose memory is not one
    dense block; a quantized one, whose dtype none is saved as; a meta tensor, which has no memory: a copy into it
    does nothing), else None."""
    if t.is_nested:
        return f"nested tensor ({t.layout})"
    if t.layout is not torch.strided:
        return f"sparse tensor ({t.layout})"
    if t.is_quantized:
        return f"quantized tensor ({t.dtype})"
    if t.is_meta:
        return "meta tensor"
    return None


def _contains_tag(node: Any, tag: str, depth: int = 0) -> bool:
    if depth > MAX_DEPTH:
        return False
    if isinstance(node, dict):
        return tag in node or any(_contains_tag(v, tag, depth + 1) for v in node.values())
    if isinstance(node, list):
        return any(_contains_tag(v, tag, depth + 1) for v in node)
    return False


def _no_tensor(i: int) -> torch.Tensor:
    raise CorruptCheckpointError("malformed state tree: tensor used as a dict key")


def _dtensor_copier(dst: torch.Tensor, key: str) -> Callable[[Decoder], Callable[[], None]]:
    def prepare(dec: Decoder) -> Callable[[], None]:
        assert dec.dtensor is not None
        value = dec.dtensor(key)
        src = value.to_local() if is_dtensor(value) else value

        def commit() -> None:
            with torch.no_grad():
                (dst.to_local() if is_dtensor(dst) else dst).copy_(src)

        return commit

    return prepare


def _same_view(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (then copying one into the other is moot)."""
    return (a is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i: host tensors in one C++ call, others one by one."""
    host = [(d, s) for d, s in zip(dsts, srcs) if d.is_cpu and s.is_cpu]
    rest = [(d, s) for d, s in zip(dsts, srcs) if not (d.is_cpu and s.is_cpu)] if len(host) < len(dsts) else []
    copy_tensors([d for d, _ in host], [s for _, s in host])
    with torch.no_grad():
        for d, s in rest:
            d.copy_(s)


def _np_copier(dst: np.ndarray, i: int) -> Callable[[Decoder], Callable[[], None]]:
    def prepare(dec: Decoder) -> Callable[[], None]:
        arr = dec.array(i)
        return lambda: np.copyto(dst, arr)

    return prepare


def _gen_setter(gen: torch.Generator, i: int) -> Callable[[Decoder], Callable[[], None]]:
    def prepare(dec: Decoder) -> Callable[[], None]:
        st = dec.tensor(i).clone()
        return lambda: gen.set_state(st)

    return prepare


def _tensor_replacer(parent: Any, key: Any, i: int, live: torch.Tensor) -> Callable[[Decoder], Callable[[], None]]:
    """Put a fresh tensor holding record ``i``'s values at ``parent[key]``, in place of ``live``, whose elements share
    memory: on ``live``'s device, a ``Parameter`` again if ``live`` is one, requiring grad where ``live`` does."""
    def prepare(dec: Decoder) -> Callable[[], None]:
        value = dec.tensor(i).to(device=live.device, copy=True)
        if isinstance(live, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=live.requires_grad)
        elif live.requires_grad:
            value.requires_grad_(True)

        def commit() -> None:
            parent[key] = value

        return commit

    return prepare


def _setter(parent: Any, key: Any, node: Any) -> Callable[[Decoder], Callable[[], None]]:
    def prepare(dec: Decoder) -> Callable[[], None]:
        value = dec.decode(node, own=True)

        def commit() -> None:
            parent[key] = value

        return commit

    return prepare


def _load_module(module: torch.nn.Module, sd: Any, strict: bool, path: str, step: int | None) -> None:
    try:
        module.load_state_dict(sd, strict=strict)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise StateMismatchError(f"load_state_dict failed at {path}: {exc}", step=step) from exc


def _load_object(obj: Any, sd: Any, path: str, step: int | None) -> None:
    try:
        obj.load_state_dict(sd)
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise StateMismatchError(f"{type(obj).__name__}.load_state_dict failed at {path}: {exc}", step=step) from exc
