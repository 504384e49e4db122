"""The native host copy (``tierckpt/host/_hostcopy.c`` through :mod:`tierckpt.snapshot.hostcopy`): every byte of every
range lands, nothing around a range changes, whatever the sizes, alignments and thread counts; tensors it must not
copy byte for byte go back to torch; and tierckpt works, falling back to torch, where the extension is missing.

``scripts/test.sh`` sets ``TIERCKPT_EXPECT_NATIVE=1``: there a missing build fails :func:`test_the_native_copy_is_built`
instead of skipping the rest.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._support.procs import run_python
from tierckpt.snapshot import hostcopy

needs_native = pytest.mark.skipif(not hostcopy.available, reason="the native host copy is not built")

#: Sizes around the thresholds in _hostcopy.c: the 64-byte stream blocks, STREAM_MIN (16 KiB), a thread's minimum.
SIZES = [0, 1, 63, 64, 65, 4095, 16383, 16384, 16385, (1 << 20) + 13, (4 << 20) - 1, (9 << 20) + 7]


def test_the_native_copy_is_built() -> None:
    if os.environ.get("TIERCKPT_EXPECT_NATIVE") != "1":
        pytest.skip("TIERCKPT_EXPECT_NATIVE is not set (scripts/test.sh sets it)")
    assert hostcopy.available, "tierckpt.host._hostcopy was not built: is a C compiler installed?"
    if platform.machine() in ("x86_64", "AMD64"):
        assert hostcopy.streaming


def _ranges(seed: int, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """A source arena of random bytes and a destination arena of 0xA5, with (dst offset, src offset, size) triples
    at odd alignments and gaps between them (the gaps must stay 0xA5)."""
    rng = np.random.default_rng(seed)
    total = sum(sizes) + 256 * len(sizes) + 4096
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.full(total, 0xA5, dtype=np.uint8)
    triples = []
    d = s = 0
    for i, n in enumerate(sizes):
        d += 1 + (i * 37) % 97  # destinations and sources misaligned differently
        s += 3 + (i * 53) % 89
        triples.append((d, s, n))
        d += n
        s += n
    return src, dst, triples


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_ranges_copied_exactly_with_any_thread_count(threads: int) -> None:
    src, dst, triples = _ranges(threads, SIZES * 2)
    base_d, base_s = dst.ctypes.data, src.ctypes.data
    assert hostcopy._hostcopy is not None
    hostcopy._hostcopy.copy(np.array([base_d + d for d, _, _ in triples], dtype=np.uint64),
                            np.array([base_s + s for _, s, _ in triples], dtype=np.uint64),
                            np.array([n for _, _, n in triples], dtype=np.uint64), threads, True)
    want = np.full_like(dst, 0xA5)
    for d, s, n in triples:
        want[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, want), "a byte was lost, misplaced, or written outside a range"


@needs_native
def test_plain_stores_and_empty_lists() -> None:
    src, dst, triples = _ranges(7, SIZES)
    assert hostcopy._hostcopy is not None
    args = (np.array([dst.ctypes.data + d for d, _, _ in triples], dtype=np.uint64),
            np.array([src.ctypes.data + s for _, s, _ in triples], dtype=np.uint64),
            np.array([n for _, _, n in triples], dtype=np.uint64))
    hostcopy._hostcopy.copy(*args, 2, False)  # memcpy on two threads
    for d, s, n in triples:
        assert np.array_equal(dst[d : d + n], src[s : s + n])
    empty = np.zeros(0, dtype=np.uint64)
    hostcopy._hostcopy.copy(empty, empty, empty, 4, True)


@needs_native
def test_bad_arguments_are_refused() -> None:
    assert hostcopy._hostcopy is not None
    one, two = np.zeros(1, dtype=np.uint64), np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="same length"):
        hostcopy._hostcopy.copy(one, two, one, 1, True)
    with pytest.raises(ValueError, match="8-byte"):
        hostcopy._hostcopy.copy(np.zeros(1, dtype=np.uint32), one, one, 1, True)
    with pytest.raises(TypeError):
        hostcopy._hostcopy.copy([0], one, one)


@needs_native
def test_copy_pairs_leaves_what_is_not_a_plain_byte_copy_to_torch() -> None:
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(300_000, generator=g)
    bf16 = torch.randn(70_001, generator=g).to(torch.bfloat16)
    strided = torch.randn(64, 128, generator=g).t()
    conj = torch.randn(100, dtype=torch.complex64, generator=g).conj()  # a lazy conjugate view
    neg = torch._neg_view(torch.randn(100, generator=g))
    empty = torch.empty(0)
    srcs = [plain, bf16, strided, conj, neg, empty]
    dsts = [torch.zeros_like(t, memory_format=torch.contiguous_format).resolve_conj().resolve_neg() for t in srcs]
    assert neg.is_neg() and conj.is_conj() and not strided.is_contiguous()
    rest_d, rest_s = hostcopy.copy_pairs(dsts, srcs, threads=2, min_bytes=0)
    assert [id(t) for t in rest_s] == [id(strided), id(conj), id(neg)]
    assert [id(t) for t in rest_d] == [id(dsts[2]), id(dsts[3]), id(dsts[4])]
    assert torch.equal(dsts[0], plain) and torch.equal(dsts[1], bf16)
    assert not torch.equal(dsts[2], strided.contiguous())  # untouched: torch copies it
    for d, s in zip(rest_d, rest_s, strict=True):
        d.copy_(s)
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s.resolve_conj().resolve_neg())


@needs_native
def test_small_tensors_stay_with_torch() -> None:
    """Below ``MIN_BYTES`` the per-tensor checks would cost more than streaming saves: torch copies them."""
    big, small = torch.randn(hostcopy.MIN_BYTES // 4), torch.randn(hostcopy.MIN_BYTES // 4 - 1)
    dsts = [torch.zeros_like(big), torch.zeros_like(small)]
    rest_d, rest_s = hostcopy.copy_pairs(dsts, [big, small])
    assert rest_s == [small] and rest_d[0] is dsts[1] and torch.equal(dsts[0], big) and not dsts[1].any()
    only_small = [torch.zeros(10)]
    rest_d, rest_s = hostcopy.copy_pairs(only_small, [torch.ones(10)])
    assert rest_d is only_small and not only_small[0].any()


@needs_native
def test_a_batch_copies_everything_or_nothing() -> None:
    """``copy_batch``: every source into its fixed destination in one call, or (any source not a plain match for
    its destination) not a byte, so the caller can take the other path."""
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(5000, generator=g), torch.randn(3, 7, generator=g).to(torch.bfloat16),
            torch.randint(0, 9, (1,), generator=g), torch.randn(300_001, generator=g)]
    dsts = [torch.zeros_like(t) for t in srcs]
    batch = hostcopy.Batch(dsts)
    bad = {
        "strided": [srcs[0], srcs[1].t().contiguous().t(), srcs[2], srcs[3]],
        "dtype": [srcs[0], srcs[1].float(), srcs[2], srcs[3]],
        "shape": [srcs[0], srcs[1].reshape(7, 3), srcs[2], srcs[3]],
        "size": [srcs[0][:-1], srcs[1], srcs[2], srcs[3]],
        "neg": [torch._neg_view(srcs[0]), srcs[1], srcs[2], srcs[3]],
        "count": srcs[:3],
    }
    for why, others in bad.items():
        assert hostcopy.copy_batch(batch, others) is False, why
        assert not any(d.any() for d in dsts), f"{why}: a byte was copied"
    assert hostcopy.copy_batch(batch, srcs, threads=2) is True
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    assert hostcopy.copy_batch(hostcopy.Batch([]), []) is True
    with pytest.raises(ValueError, match="contiguous"):
        hostcopy.Batch([torch.zeros(4, 4).t()])


@needs_native
def test_a_checked_batch_reads_only_the_lazy_bits_and_contiguity() -> None:
    """``layout_checked``: the caller vouches for device, dtype and shape (and may pass the addresses it read); the
    batch still refuses strided sources and lazy bits, and copies from the given addresses."""
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(700, generator=g), torch.randn(5, 9, generator=g).to(torch.bfloat16)]
    dsts = [torch.zeros_like(t) for t in srcs]
    batch = hostcopy.Batch(dsts)
    for why, others in {"strided": [srcs[0], srcs[1].t().contiguous().t()],
                        "neg": [srcs[0], torch._neg_view(srcs[1])]}.items():
        assert hostcopy.copy_batch(batch, others, layout_checked=True) is False, why
        assert not any(d.any() for d in dsts), f"{why}: a byte was copied"
    # the addresses given are the ones read: here those of other tensors of the same layout
    others = [torch.randn(700, generator=g), torch.randn(5, 9, generator=g).to(torch.bfloat16)]
    addr = np.array([t.data_ptr() for t in others], dtype=np.uint64)
    assert hostcopy.copy_batch(batch, srcs, layout_checked=True, src_addr=addr) is True
    assert all(torch.equal(d, s) for d, s in zip(dsts, others, strict=True))
    assert hostcopy.copy_batch(batch, srcs, layout_checked=True) is True
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    for bad in (addr[:1], addr.astype(np.int64)):
        with pytest.raises(ValueError, match="src_addr"):
            hostcopy.copy_batch(batch, srcs, layout_checked=True, src_addr=bad)


@needs_native
def test_a_complex_batch_still_checks_the_conjugate_bit() -> None:
    """Only complex tensors carry a lazy conjugate bit, so a batch reads it only where a destination is complex."""
    src = torch.randn(64, dtype=torch.complex64, generator=torch.Generator().manual_seed(5))
    dst = torch.zeros_like(src)
    batch = hostcopy.Batch([dst])
    assert batch.complex and not hostcopy.Batch([torch.zeros(3)]).complex
    for checked in (False, True):
        assert hostcopy.copy_batch(batch, [src.conj()], layout_checked=checked) is False
        assert not dst.any()
    assert hostcopy.copy_batch(batch, [src], layout_checked=True) is True
    assert torch.equal(dst, src)


@needs_native
def test_copying_from_addresses_into_live_tensors_all_or_nothing() -> None:
    """``copy_from_addresses``: buffer ranges into plain, non-overlapping live tensors of exactly those lengths, in
    one call; any doubt about a destination copies nothing."""
    g = torch.Generator().manual_seed(6)
    buf = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=g)
    base = buf.data_ptr()
    spans = [(0, 400), (400, 4), (1000, 8000), (9000, 0)]
    addr = np.array([base + a for a, _ in spans], dtype=np.uint64)
    lengths = np.array([n for _, n in spans], dtype=np.uint64)

    def fresh() -> list[torch.Tensor]:
        return [torch.zeros(100), torch.zeros(2, dtype=torch.int16), torch.zeros(4000, dtype=torch.bfloat16),
                torch.zeros(0)]

    whole = torch.zeros(200)
    bad = {
        "strided": [torch.zeros(10, 10).t(), *fresh()[1:]],
        "neg": [torch._neg_view(torch.zeros(100)), *fresh()[1:]],
        "size": [torch.zeros(99), *fresh()[1:]],
        "overlap": [whole[:100], whole[50:51].view(torch.int16), *fresh()[2:]],
    }
    for why, dsts in bad.items():
        assert hostcopy.copy_from_addresses(dsts, addr, lengths) is False, why
        assert not any(d.any() for d in dsts), f"{why}: a byte was copied"
    assert not whole.any()
    for wrong in ((addr[:2], lengths), (addr, lengths.astype(np.int64))):
        assert hostcopy.copy_from_addresses(fresh(), *wrong) is False
    dsts = fresh()
    assert hostcopy.copy_from_addresses(dsts, addr, lengths, threads=2) is True
    for d, (a, n) in zip(dsts, spans, strict=True):
        assert torch.equal(d.view(torch.uint8).reshape(-1), buf[a : a + n])
    assert hostcopy.copy_from_addresses([], addr[:0], lengths[:0]) is True


def test_copy_pairs_hands_everything_back_when_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "available", False)
    dsts, srcs = [torch.zeros(4)], [torch.ones(4)]
    rest_d, rest_s = hostcopy.copy_pairs(dsts, srcs)
    assert rest_d is dsts and rest_s is srcs and not dsts[0].any()


_ROUND_TRIP = """
import sys
{block}
import torch
from tierckpt import CheckpointManager
from tierckpt.snapshot import hostcopy
assert hostcopy.available is False, hostcopy.available
g = torch.Generator().manual_seed(1)
state = {{"w": torch.randn(512, 1024, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)}}
with CheckpointManager(sys.argv[1]) as m:
    m.save(1, state)
    m.wait()
    fresh = {{k: torch.zeros_like(v) for k, v in state.items()}}
    assert m.restore(fresh) == 1
    assert all(torch.equal(fresh[k], state[k]) for k in state)
print("ok")
"""


@pytest.mark.parametrize("how", ["not_built", "env_off"])
def test_save_and_restore_fall_back_to_torch(tmp_path: Path, how: str) -> None:
    """Without the extension (not built, or ``TIERCKPT_HOSTCOPY=0``) a save and a restore go through torch."""
    block = "sys.modules['tierckpt.host._hostcopy'] = None  # as if the build had failed" if how == "not_built" else ""
    env = dict(os.environ, TIERCKPT_HOSTCOPY="0" if how == "env_off" else "1")
    out = run_python(["-c", _ROUND_TRIP.format(block=block), str(tmp_path / "c")], timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
