"""Running one task per file on the manager's io threads, with no task outliving the call.

``Executor.map`` raises at the first failed task while the others keep running. Here that is not allowed: the
tasks read from a staging buffer or write into one (or, for an in-place restore, into the caller's tensors), and
the caller releases or reuses that memory as soon as the call returns. So every task is waited for, and only then
is the first error (in submission order) raised.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_all(executor: Executor, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``fn`` over ``items`` on ``executor``; returns the results in order once every task has ended."""
    return results(submit_all(executor, fn, items))


def submit_all(executor: Executor, fn: Callable[[T], R], items: Iterable[T]) -> list[Future[R]]:
    """One task per item; pass the futures (of one or several executors) to :func:`results`."""
    return [executor.submit(fn, item) for item in items]


def results(futures: list[Future[R]]) -> list[R]:
    """The futures' results in order, once every one has ended (then the first error, in order, is raised)."""
    wait(futures)
    return [f.result() for f in futures]
