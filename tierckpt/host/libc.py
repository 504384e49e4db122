"""The C library's functions that Python's ``os`` module lacks (``renameat2``, ``madvise`` on an address).

One loader for every caller: libc is opened once, with ``errno`` kept for :func:`ctypes.get_errno`, and a platform
without the library or the function gets None, so that each caller falls back its own way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def libc_function(name: str, argtypes: list[Any] | None, restype: Any) -> Any:
    """libc's ``name`` with its C signature set, or None where there is no such function."""
    lib = _libc()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
