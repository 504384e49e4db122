"""Reading checkpoints without owning them: :func:`load` from a root that a running job (or another rank of this
job) holds, with no folder lock, no recovery and no background threads left behind.

A :class:`~tierckpt.CheckpointManager` takes its local folder's lock and cleans up after crashed saves when it
starts, so only one process may own a root. Evaluation jobs, exporters and the other ranks of a data-parallel job
that must read what rank 0 saved use this module instead: it opens the tiers read-only (nothing is created or
deleted), lists them within a deadline and reads a step with the same verification and fallback as
:meth:`CheckpointManager.load`. A step being committed meanwhile is either complete (its manifest is written last)
or not listed; a step deleted by the owner's retention while it is read is skipped like a missing copy.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .engine import load as _load
from .errors import CheckpointNotFoundError
from .storage.base import Store
from .storage.open import is_url, open_store
from .tiers.listing import TierListings, list_tiers

__all__ = ["Reader", "committed_steps", "load", "open_tier"]


class Reader:
    """What the loader's readers need of a manager: the rank whose part is read and the io and hashing threads.
    Close it (or use it as a context manager) to stop the threads."""

    def __init__(self, *, rank: int = 0, threads: int = 4) -> None:
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.rank = rank
        self.io = ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-read-io")
        self.hash = ThreadPoolExecutor(threads, thread_name_prefix="tierckpt-read-hash")

    def close(self) -> None:
        """Stop the threads, once their work is done."""
        self.io.shutdown(wait=True)
        self.hash.shutdown(wait=True)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tier(where: str | os.PathLike[str], *, tier: str, storage_options: dict[str, Any] | None = None) -> Store:
    """A checkpoint root (a path or a URL) opened read-only as tier ``tier``. Raises
    :class:`CheckpointNotFoundError` for a path that is not a folder."""
    target = os.fspath(where)
    if is_url(target):
        return open_store(target, storage_options=storage_options, tier=tier, create=False)
    if not os.path.isdir(target.removeprefix("file://")):
        raise CheckpointNotFoundError("no such checkpoint folder", tier=tier, path=target)
    return open_store(target, tier=tier, create=False)


def load(local_dir: str | os.PathLike[str] | None, *, remote: str | os.PathLike[str] | None = None,
         step: int | None = None, keys: Sequence[str] | None = None, source: str = "auto",
         storage_options: dict[str, Any] | None = None, rank: int = 0, timeout_s: float | None = 30.0,
         threads: int = 4) -> _load.LoadResult:
    """The newest intact step (or exactly ``step``) of the checkpoint at ``local_dir`` and/or ``remote`` as plain
    values, exactly as :meth:`CheckpointManager.load` returns it, without taking the folder's lock: safe beside the
    job that owns the folder. ``rank``: whose saved part to read (a multi-rank checkpoint holds one per rank).
    ``local_dir`` that does not exist (a fresh node) is skipped when ``remote`` is given. ``timeout_s``: how long
    listing a tier may take, retries included.

    Raises :class:`CheckpointNotFoundError` (nothing committed, or not ``step``), :class:`CorruptCheckpointError`
    (copies exist, none verifies), :class:`StorageError` (a tier could not be listed and no other holds the step),
    :class:`StateMismatchError` (a key of ``keys`` the step does not hold), ``ValueError`` for bad arguments."""
    if step is not None and (type(step) is not int or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    if source not in ("auto", "local", "remote"):
        raise ValueError(f"source must be 'auto', 'local' or 'remote', got {source!r}")
    if keys is not None and (not isinstance(keys, (list, tuple)) or not keys
                             or not all(isinstance(k, str) for k in keys)):
        raise ValueError(f"keys must be None or a non-empty list or tuple of str, got {keys!r}")
    with _listed(local_dir, remote, source=source, storage_options=storage_options, timeout_s=timeout_s) as (
            stores, listing):
        if not stores:
            raise ValueError("nothing to read: give local_dir and/or remote (as source allows)")
        listing.require(step, ", ".join(s.url for s in stores))
        with Reader(rank=rank, threads=threads) as reader:
            return _load.load(reader, step, stores, keys=None if keys is None else list(keys), listing=listing)


def committed_steps(local_dir: str | os.PathLike[str] | None, *, remote: str | os.PathLike[str] | None = None,
                    storage_options: dict[str, Any] | None = None, timeout_s: float | None = 30.0) -> list[int]:
    """The steps committed in any of the given tiers, newest first (read-only; a missing ``local_dir`` is skipped
    when ``remote`` is given). Raises :class:`StorageError` when a tier could not be listed and no other holds a
    step, :class:`CheckpointNotFoundError` for a missing ``local_dir`` with no ``remote``."""
    with _listed(local_dir, remote, source="auto", storage_options=storage_options, timeout_s=timeout_s) as (
            stores, listing):
        listing.require(None, ", ".join(s.url for s in stores))
        return sorted(listing.known(), reverse=True)


@contextlib.contextmanager
def _listed(local_dir: str | os.PathLike[str] | None, remote: str | os.PathLike[str] | None, *, source: str,
            storage_options: dict[str, Any] | None,
            timeout_s: float | None) -> Iterator[tuple[list[Store], TierListings]]:
    """The tiers ``source`` allows, opened read-only (a missing ``local_dir`` is skipped when ``remote`` may be
    read instead), and their listing within ``timeout_s``; the stores are closed on exit."""
    stores: list[Store] = []
    try:
        if local_dir is not None and source in ("auto", "local"):
            try:
                stores.append(open_tier(local_dir, tier="local"))
            except CheckpointNotFoundError:
                if remote is None or source == "local":
                    raise
        if remote is not None and source in ("auto", "remote"):
            stores.append(open_tier(remote, tier="remote", storage_options=storage_options))
        yield stores, list_tiers(stores, deadline_s=timeout_s)
    finally:
        for s in stores:
            s.close()
