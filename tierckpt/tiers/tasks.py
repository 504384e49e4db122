"""Running one task per file on the manager's io threads, with no task outliving the call.

``Executor.map`` raises at the first failed task while the others keep running. Here that is not allowed: the
tasks read from a staging buffer or write into one (or, for an in-place restore, into the caller's tensors), and
the caller releases or reuses that memory as soon as the call returns. So every task is waited for, and only then
is the first error (in submission order) raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_all(executor: Executor, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``fn`` over ``items`` on ``executor``; returns the results in order once every task has ended."""
    futures = [executor.submit(fn, item) for item in items]
    wait(futures)
    return [f.result() for f in futures]
