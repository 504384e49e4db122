"""What a lazy ``save()`` takes from the state at once (``lazy_snapshot=True``); the snapshot thread flattens the
rest (:func:`.tree.flatten`) and copies the tensors while training goes on.

A lazy snapshot's contract: the state's tensors do not change until the barrier before the next optimizer step;
everything else may change the moment ``save()`` returns. So :func:`capture` takes now:

- every container (dict, list, tuple, set) as a new one: items added, removed or replaced later do not count;
- every Python value (numbers, strings, bytes, dtypes, devices, sizes, numpy scalars) as it is: they cannot change;
- every stateful object's ``state_dict()`` (an optimizer's hyper-parameters, a scheduler's epoch, a user's data
  position: Python values that change), captured in turn, marked :class:`.tree.StateDictOf`;
- every ``torch.Generator``'s state (:class:`.tree.GeneratorState`): drawing random numbers changes it;
- tensors and numpy arrays by reference (their bytes are the snapshot thread's to copy, before the barrier);
- an ``nn.Module`` by reference, its ``state_dict()`` left to the snapshot thread, when that can only return the
  module's parameters and buffers: neither it nor a submodule has state-dict hooks, extra state
  (``get_extra_state``) or its own ``state_dict`` / ``_save_to_state_dict``. Parameters are not replaced between an
  optimizer step and the next one, so the later call sees the same tensors. Other modules give their
  ``state_dict()`` now.

Cost: what stays on the caller's thread is a walk over the containers (dicts of plain tensors copied whole, at C
speed) and the non-module ``state_dict()`` calls, not the flatten's reads of every tensor's dtype, shape, layout
and address, which on a state just pushed out of the caches by a training step cost a few microseconds a tensor.
A value that cannot be checkpointed by its type raises ``TypeError`` naming its key path here, as an eager save's
flatten would; what only the flatten sees (a nested, sparse, quantized or meta tensor) is reported by the next call.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .modules import SAVING, plain_tree
from .tree import (
    MAX_DEPTH,
    PLAIN_KEY_TYPES,
    PLAIN_TENSOR_TYPES,
    GeneratorState,
    StateDictOf,
    is_stateful,
    state_dict_of,
    type_name,
    unsupported,
)

_ATOMS = frozenset({int, str, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size})


def capture(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as the snapshot thread will flatten it (see the module docstring). Raises ``TypeError`` naming the
    key path of a value no checkpoint can hold."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    try:
        return _mapping(state, "state", 0)
    except RecursionError:
        raise TypeError("state is too deeply nested or contains a reference cycle") from None


def deferrable(module: torch.nn.Module) -> bool:
    """Whether ``module.state_dict()`` can only return its (and its submodules') parameters and buffers."""
    return plain_tree(module, SAVING)


def _mapping(obj: Mapping, path: str, depth: int) -> dict[str, Any]:
    out: dict[Any, Any] = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
    if (type(obj) is dict or type(obj) is collections.OrderedDict) and set(map(type, obj)) <= PLAIN_KEY_TYPES:
        types = set(map(type, obj.values()))
        if types <= PLAIN_TENSOR_TYPES:  # a dict of plain tensors (a module's): copied whole
            out.update(obj)
            return out
        if types == {dict} and all(map(_plain_tensor_dict, obj.values())):  # an optimizer's per-parameter state
            out.update(zip(obj, map(dict, obj.values())))
            return out
    for k, v in obj.items():
        tk = type(k)
        if tk is not str and tk is not int and not (k is None or isinstance(k, (bool, int, float, str, tuple))):
            raise TypeError(f"cannot checkpoint dict key of type {tk.__name__} at {path}")
        tv = type(v)
        out[k] = v if tv in PLAIN_TENSOR_TYPES or tv in _ATOMS else _value(v, f"{path}[{k!r}]", depth + 1)
    return out


def _plain_tensor_dict(d: dict) -> bool:
    return set(map(type, d.values())) <= PLAIN_TENSOR_TYPES and set(map(type, d)) <= PLAIN_KEY_TYPES


def _value(obj: Any, path: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TypeError(f"state nested deeper than {MAX_DEPTH} levels at {path}")
    tp = type(obj)
    if tp in PLAIN_TENSOR_TYPES or tp in _ATOMS:
        return obj
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj  # subclasses (DTensor...) and arrays: the flatten decides
    if isinstance(obj, Mapping):
        return _mapping(obj, path, depth)
    if isinstance(obj, list):
        if tp is list and set(map(type, obj)) <= _ATOMS:  # a list of numbers, strings...: copied whole
            return list(obj)
        return [_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, (bool, int, float, str, bytes)) or obj is None:
        return obj
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, tuple):
        return tuple(_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(obj))
    if isinstance(obj, (set, frozenset)):
        items = [_value(v, path, depth + 1) for v in obj]
        return frozenset(items) if isinstance(obj, frozenset) else set(items)
    if isinstance(obj, bytearray):
        return bytes(obj)
    if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
        return obj
    if isinstance(obj, (torch.dtype, torch.device)):
        return obj
    if isinstance(obj, torch.Generator):
        return GeneratorState(obj.get_state(), str(obj.device))
    if is_stateful(obj):
        if isinstance(obj, torch.nn.Module) and deferrable(obj):
            return obj  # its state_dict() on the snapshot thread
        return StateDictOf(type_name(obj), _value(state_dict_of(obj, path), path, depth + 1))
    raise unsupported(obj, path)


__all__ = ["capture", "deferrable"]
