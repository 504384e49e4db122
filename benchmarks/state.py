"""A realistic training state for the benchmarks: a GPT-like model's bf16 parameters plus fp32 AdamW state.

For every parameter of a GPT-2-shaped decoder (token and position embeddings, per-layer LayerNorms, fused QKV,
attention projection, 4x MLP, final LayerNorm) the state holds:

- ``model[name]``: the bf16 weight the forward pass uses (2 bytes per element);
- ``optimizer.master[name]``: the fp32 master copy (4 bytes);
- ``optimizer.exp_avg[name]`` and ``optimizer.exp_avg_sq[name]``: AdamW's fp32 moments (4 + 4 bytes).

That is 14 bytes per parameter and ``4 * (3 + 12 * n_layer)`` tensors of very mixed sizes (from a few hundred bytes
for a bias to hundreds of MiB for the embedding). The hidden size is chosen from the requested total bytes and layer
count, and the vocabulary size is then adjusted so the total lands within one embedding row of the request.

All keys are strings so that every peer (torch.save, safetensors, DCP) can store the same state unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

#: bytes per parameter: bf16 weight + fp32 master + fp32 exp_avg + fp32 exp_avg_sq
BYTES_PER_PARAM = 2 + 4 + 4 + 4
CONTEXT = 1024
BASE_VOCAB = 32000


def layers_for_tensor_count(n_tensors: int) -> int:
    """The layer count whose state has about ``n_tensors`` tensors (4 tensors per parameter)."""
    return max(1, round((n_tensors / 4 - 3) / 12))


def _shapes(d: int, n_layer: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (vocab, d)), ("wpe.weight", (CONTEXT, d))]
    for i in range(n_layer):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (d, 4 * d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def plan_shapes(total_bytes: int, n_layer: int = 12) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a GPT-like model whose full training state is about ``total_bytes``."""
    params = total_bytes / BYTES_PER_PARAM
    # per layer 12 d^2 + 13 d; outside layers (vocab + context + 2) d
    a, b = 12 * n_layer, 13 * n_layer + BASE_VOCAB + CONTEXT + 2
    d = int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a))
    d = max(64, d // 64 * 64)
    while True:
        rest = params - (12 * n_layer * d * d + (13 * n_layer + CONTEXT + 2) * d)
        vocab = int(rest // d)
        if vocab >= 256 or d == 64:
            break
        d -= 64
    return _shapes(d, n_layer, max(vocab, 1))


def gpt_state(
    total_bytes: int, *, n_layer: int | None = None, n_tensors: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """Generate the benchmark state (random values, fixed seed) of about ``total_bytes`` bytes.

    Pass ``n_layer`` (default 12: about 600 tensors) or ``n_tensors`` (the layer count is derived from it).
    """
    if n_layer is None:
        n_layer = layers_for_tensor_count(n_tensors) if n_tensors else 12
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    master: dict[str, torch.Tensor] = {}
    exp_avg: dict[str, torch.Tensor] = {}
    exp_avg_sq: dict[str, torch.Tensor] = {}
    for name, shape in plan_shapes(total_bytes, n_layer):
        w = torch.randn(shape, generator=gen) * 0.02
        master[name] = w
        model[name] = w.to(torch.bfloat16)
        exp_avg[name] = torch.randn(shape, generator=gen) * 1e-3
        exp_avg_sq[name] = torch.rand(shape, generator=gen) * 1e-6
    return _tree(model, master, exp_avg, exp_avg_sq)


def zero_state(total_bytes: int, *, n_layer: int = 12) -> dict[str, Any]:
    """A state of :func:`gpt_state`'s keys, shapes and dtypes, zero-filled (its pages touched): what a restarted
    job holds before it restores, its freshly built model and optimizer, made in a fraction of the time."""
    model: dict[str, torch.Tensor] = {}
    master: dict[str, torch.Tensor] = {}
    exp_avg: dict[str, torch.Tensor] = {}
    exp_avg_sq: dict[str, torch.Tensor] = {}
    for name, shape in plan_shapes(total_bytes, n_layer):
        model[name] = torch.zeros(shape, dtype=torch.bfloat16)
        master[name], exp_avg[name], exp_avg_sq[name] = (torch.zeros(shape) for _ in range(3))
    return _tree(model, master, exp_avg, exp_avg_sq)


def _tree(model: dict[str, torch.Tensor], master: dict[str, torch.Tensor], exp_avg: dict[str, torch.Tensor],
          exp_avg_sq: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "model": model,
        "optimizer": {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
    }


def iter_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(dotted_key, tensor)`` for every tensor in a nested dict, in insertion order."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        raise TypeError(f"unexpected {type(tree).__name__} at {prefix!r}")


def flatten(tree: Any) -> dict[str, torch.Tensor]:
    """The state as one flat ``{dotted_key: tensor}`` dict (what safetensors stores)."""
    return dict(iter_tensors(tree))


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of the state, in a fixed order."""
    return [t for _, t in iter_tensors(tree)]


def empty_like_state(tree: Any) -> Any:
    """A preallocated state of the same structure, zero-filled (pages touched, so no page faults when timed)."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    return {k: empty_like_state(v) for k, v in tree.items()}


def copy_into(dst: Any, src: Any) -> None:
    """Copy a nested state (or a flat dotted dict for ``src``) into the preallocated ``dst`` in place."""
    if (
        isinstance(src, dict)
        and src
        and all(isinstance(v, torch.Tensor) for v in src.values())
        and "." in next(iter(src))
    ):
        for k, t in iter_tensors(dst):
            t.copy_(src[k])
        return
    for (k1, d), (k2, s) in zip(iter_tensors(dst), iter_tensors(src), strict=True):
        if k1 != k2:
            raise KeyError(f"{k1} != {k2}")
        d.copy_(s)


def state_bytes(tree: Any) -> int:
    """Total tensor bytes of the state."""
    return sum(t.nbytes for t in tensors(tree))


def states_equal(a: Any, b: Any) -> bool:
    """Whether two states hold bit-identical tensors under the same keys."""
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def describe(tree: Any) -> dict[str, Any]:
    """Summary for reports: bytes, tensor count, dtype mix and size spread."""
    ts = tensors(tree)
    sizes = sorted(t.nbytes for t in ts)
    dtypes: dict[str, int] = {}
    for t in ts:
        dtypes[str(t.dtype).replace("torch.", "")] = (
            dtypes.get(str(t.dtype).replace("torch.", ""), 0) + t.nbytes
        )
    return {
        "bytes": sum(sizes),
        "gib": sum(sizes) / (1 << 30),
        "tensors": len(ts),
        "bytes_by_dtype": dtypes,
        "smallest_tensor_bytes": sizes[0],
        "median_tensor_bytes": sizes[len(sizes) // 2],
        "largest_tensor_bytes": sizes[-1],
    }
