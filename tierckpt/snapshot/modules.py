"""Whether an ``nn.Module`` tree saves and loads its state the way ``nn.Module`` itself does, so that the library may
stand in for part of that work: call ``state_dict()`` later (a lazy snapshot, :mod:`.capture`), or copy the saved
tensors into the parameters and buffers itself instead of calling ``load_state_dict()`` (:mod:`.load`).

Invariant: a tree qualifies only if no module in it has hooks on the methods concerned and no module's class
defines its own version of them (nor extra state), so what is skipped or moved could only have been
``nn.Module``'s own code, which returns (or copies into) views of the module's own parameters and buffers.
"""

from __future__ import annotations

import torch

#: The methods and hook tables of saving a module's state.
SAVING = (("state_dict", "_save_to_state_dict", "get_extra_state"), ("_state_dict_hooks", "_state_dict_pre_hooks"))
#: The same for loading it.
LOADING = (("load_state_dict", "_load_from_state_dict", "set_extra_state"),
           ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"))
_plain_classes: dict[tuple[type, tuple[str, ...]], bool] = {}


def plain_tree(module: torch.nn.Module, *aspects: tuple[tuple[str, ...], tuple[str, ...]]) -> bool:
    """Whether every module of ``module``'s tree keeps ``nn.Module``'s own methods and has no hooks, for each of
    ``aspects`` (:data:`SAVING`, :data:`LOADING`)."""
    methods = tuple(m for aspect in aspects for m in aspect[0])
    hooks = tuple(h for aspect in aspects for h in aspect[1])
    base = torch.nn.Module
    todo, seen = [module], set()
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        key = (type(m), methods)
        plain = _plain_classes.get(key)
        if plain is None:
            plain = _plain_classes[key] = all(getattr(type(m), name) is getattr(base, name) for name in methods)
        if not plain or any(getattr(m, h, None) for h in hooks):
            return False
        todo.extend(c for c in m._modules.values() if c is not None)
    return True


__all__ = ["LOADING", "SAVING", "plain_tree"]
