"""Large host buffers for I/O: private anonymous memory, page-aligned, on transparent huge pages where asked; and
the address of a buffer (:func:`buffer_address`), which alignment checks and ``ctypes`` copies need.

Why huge pages: a direct read or write moves a buffer's bytes by DMA, one segment per physically contiguous run. In
4 KiB pages a run is one page, and a request carries at most the device's segment limit of them (254 on the
reference VM's virtual disk: about 1 MiB a request instead of its 4 MiB limit); in 2 MiB pages a run is 2 MiB. A
2 GiB ``O_DIRECT`` write from a buffer on huge pages took 0.65x the time of the same write from 4 KiB pages there,
a direct read into one 0.49x (8 interleaved rounds; docs/benchmarks.md, "huge_pages on and off"); copies into it
run at the same speed. Fewer pages also mean less work pinning them for each request and fewer TLB misses on any
machine.

What it costs: a huge page is faulted in whole. On bare metal that is faster per byte than small pages; on a VM
whose balloon reports free memory to the host (free page reporting works on 2 MiB blocks) a fresh huge page may
have to be faulted in by the host too: 4-8 ms each on the reference VM, seconds for a fresh 2 GiB buffer, where
small pages (taken from smaller free blocks the host still backs) cost 0.4-0.6 s. So huge pages suit buffers that
are kept and reused (the staging slots, the bounce buffers) or small (an upload's read buffer), and the caller
decides (the manager's ``huge_pages`` option).

Invariants: the returned view starts on a :data:`HUGE_PAGE` boundary when ``huge`` (else on a page), is zero-filled
until written, and keeps its mapping alive for as long as it or any view of it exists; nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from functools import cache

from .libc import libc_function

log = logging.getLogger(__name__)

_THP = "/sys/kernel/mm/transparent_hugepage/"
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)


def _pmd_size() -> int:
    """The kernel's transparent huge page size: 2 MiB with 4 KiB base pages (x86-64, most aarch64 kernels), larger
    with larger base pages; 2 MiB where the kernel does not say."""
    try:
        with open(_THP + "hpage_pmd_size") as f:
            size = int(f.read())
    except (OSError, ValueError):
        return 2 << 20
    return size if size >= mmap.PAGESIZE and size & (size - 1) == 0 else 2 << 20


#: Size (and alignment) of a transparent huge page here.
HUGE_PAGE = _pmd_size()

_madvise = (libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
            if sys.platform.startswith("linux") else None)


@cache
def huge_pages_available() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can put a mapping on transparent huge pages here (Linux, THP mode
    ``always`` or ``madvise``; not ``never``, not other systems)."""
    if _madvise is None:
        return False
    try:
        with open(_THP + "enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode and "[" in mode


def buffer_address(view: memoryview) -> int | None:
    """Address of a writable contiguous buffer's first byte; None where it cannot be known (read-only ``bytes``)."""
    if view.readonly or not view.c_contiguous or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def anonymous_buffer(size: int, *, huge: bool = False) -> memoryview:
    """A writable, zero-filled buffer of ``size`` bytes in private anonymous memory, page-aligned, and with ``huge``
    (where :func:`huge_pages_available`) aligned to :data:`HUGE_PAGE` and advised onto huge pages. Without
    ``huge`` it is advised off them (``MADV_NOHUGEPAGE``), so that neither a system-wide ``always`` mode nor another
    library's advice on a reused address range puts it there.

    Private, not Python's default shared mapping: shared anonymous memory is shmem, whose pages came out in
    descending physical order here, each its own DMA segment."""
    if size < 0:
        raise ValueError(f"buffer size must be >= 0, got {size}")
    huge = huge and size >= HUGE_PAGE and huge_pages_available()
    spare = HUGE_PAGE if huge else 0
    whole = mmap.mmap(-1, max(1, size + spare), flags=mmap.MAP_PRIVATE)
    view = memoryview(whole)
    if not huge:
        if _madvise is not None and size >= HUGE_PAGE:
            _madvise(ctypes.addressof(ctypes.c_char.from_buffer(view)), size - size % mmap.PAGESIZE, _MADV_NOHUGEPAGE)
        return view[:size]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    skip = -addr % HUGE_PAGE
    view = view[skip : skip + size]
    length = size - size % HUGE_PAGE  # a partial huge page at the end stays on small pages
    assert _madvise is not None
    if _madvise(addr + skip, length, _MADV_HUGEPAGE) != 0:
        log.debug("memory: madvise(MADV_HUGEPAGE) failed (errno %d): %d bytes stay on small pages",
                  ctypes.get_errno(), size)
    return view


__all__ = ["HUGE_PAGE", "anonymous_buffer", "buffer_address", "huge_pages_available"]
