"""Bounded requests to the job's c10d store (TCPStore or FileStore), and what a failing store becomes.

An agreement among thousands of ranks must not cost the store more than linear time: libuv's TCPStore server (torch's
default) reads a request 4 KiB at a time and parses an unfinished request again from its start, so one request of
S bytes costs it O(S^2 / 4 KiB), and it refuses a value over 8 MiB. Every request made here therefore carries at
most :data:`BATCH_KEYS` keys and about :data:`BATCH_BYTES` bytes (a multi-key get, set, check or wait is split into
such batches), and no value over :data:`MAX_VALUE_BYTES` is ever set.

:class:`StoreOps` makes those requests for one rank and turns every failure of the store itself (a connection
reset, the store's host gone: ``torch.distributed.DistNetworkError`` and kin) into an :class:`AgreementError` that
names the rank and the store. :class:`StoreTraffic` counts what a rank sends and receives (requests and bytes), for
tests and ``benchmarks/restart_sim.py``.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import CheckpointError

T = TypeVar("T")

#: The largest value an agreement sets in the store (libuv's TCPStore refuses values over 8 MiB).
MAX_VALUE_BYTES = 1 << 20
#: The most keys one multi-key request carries.
BATCH_KEYS = 512
#: The bytes (keys and values) after which a multi-key request is cut; a single larger value goes alone.
BATCH_BYTES = 64 << 10


class AgreementError(CheckpointError):
    """The ranks could not agree: a rank never reached the agreement (it died or hung), rank 0 never answered, or
    the job's store failed. ``ranks`` names the ranks that never arrived, where rank 0 could tell (at most
    :data:`tierckpt.distributed.LISTED_RANKS` of them; the message gives the count of the rest)."""

    def __init__(self, message: str, *, ranks: list[int] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.ranks = ranks or []


def batches(items: Sequence[T], size: Callable[[T], int] = lambda _x: 0) -> Iterator[list[T]]:
    """``items`` in order, cut into lists of at most :data:`BATCH_KEYS` items and about :data:`BATCH_BYTES` bytes
    (``size`` of each item; an item larger than that alone)."""
    batch: list[T] = []
    nbytes = 0
    for item in items:
        n = size(item)
        if batch and (len(batch) >= BATCH_KEYS or nbytes + n > BATCH_BYTES):
            yield batch
            batch, nbytes = [], 0
        batch.append(item)
        nbytes += n
    if batch:
        yield batch


def describe_store(store: Any) -> str:
    """Where ``store`` is, for messages: ``host:port`` of a TCPStore, else its class."""
    inner = getattr(store, "inner", store)
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"the job's store at {host}:{port}" if host is not None else f"the job's store ({type(inner).__name__})"


class StoreOps:
    """One rank's requests to ``store`` (see the module docstring). Every method raises :class:`AgreementError`
    naming ``rank`` and the store when the store fails; ``what`` and ``step`` go into that error."""

    def __init__(self, store: Any, rank: int, *, what: str, step: int | None = None) -> None:
        self.store, self.rank, self.what, self.step = store, rank, what, step

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except AgreementError:
            raise
        except Exception as exc:  # DistNetworkError (reset, host gone), DistStoreError, OSError
            raise AgreementError(f"rank {self.rank}: {describe_store(self.store)} failed during {op} ({self.what}): "
                                 f"{type(exc).__name__}: {exc}", ranks=[], step=self.step) from exc

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE_BYTES:  # a bug: callers bound what they send
            raise ValueError(f"a store value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
        self._call("set", lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", lambda: self.store.get(key)))

    def get_now(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it is not set: one request. A store's ``get`` first waits for the key
        (a request of its own, and up to the store's timeout for a key that is gone); a compare-and-set whose
        expected value no value equals answers the value at once, or that expected value where there is none
        (every c10d store's ``compare_set``: TCPStore, both backends, FileStore, HashStore, PrefixStore)."""
        if not hasattr(self.store, "compare_set"):  # a store wrapper without it
            return self.get(key) if self.check([key]) else None
        value = bytes(self._call("get", lambda: self.store.compare_set(key, _ABSENT, _ABSENT)))
        return None if value == _ABSENT else value

    def add(self, key: str, n: int) -> int:
        return int(self._call("add", lambda: self.store.add(key, n)))

    def delete(self, *keys: str) -> None:
        for key in keys:
            self._call("delete", lambda k=key: self.store.delete_key(k))  # type: ignore[misc]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", lambda: self.store.check(keys)))

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key of ``keys`` is set within ``timeout_s`` (in batches, all within that time)."""
        deadline = _now() + timeout_s
        for batch in batches(keys, len):
            left = deadline - _now()
            try:
                self.store.wait(batch, datetime.timedelta(seconds=max(0.001, left)))
            except Exception as exc:  # the store's timeout error (DistStoreError), or the store failing
                if not isinstance(exc, RuntimeError) or "timeout" not in str(exc).lower():
                    self._call("wait", lambda e=exc: _reraise(e))  # type: ignore[misc]
                return False
        return True

    def absent(self, keys: list[str]) -> list[int]:
        """The indices of ``keys`` not set now: one check per batch, halved where one is missing (O(m log n)
        requests for m absent keys of n)."""
        out: list[int] = []
        todo = [(lo, min(lo + BATCH_KEYS, len(keys))) for lo in range(0, len(keys), BATCH_KEYS)]
        while todo:
            lo, hi = todo.pop()
            if self.check(keys[lo:hi]):
                continue
            if hi - lo == 1:
                out.append(lo)
            else:
                mid = (lo + hi) // 2
                todo += [(mid, hi), (lo, mid)]
        return sorted(out)

    def get_many(self, keys: list[str]) -> list[bytes]:
        out: list[bytes] = []
        for batch in batches(keys, len):
            out += [bytes(v) for v in self._call("multi_get", lambda b=batch: _multi_get(self.store, b))]  # type: ignore[misc]
        return out

    def set_many(self, items: list[tuple[str, bytes]]) -> None:
        for batch in batches(items, lambda kv: len(kv[0]) + len(kv[1])):
            keys, values = [k for k, _ in batch], [v for _, v in batch]
            if any(len(v) > MAX_VALUE_BYTES for v in values):
                raise ValueError(f"a store value exceeds {MAX_VALUE_BYTES} bytes")
            self._call("multi_set", lambda k=keys, v=values: _multi_set(self.store, k, v))  # type: ignore[misc]


#: What :meth:`StoreOps.get_now` expects a key to hold: no value an agreement sets starts with a NUL byte.
_ABSENT = b"\x00none"


def _now() -> float:
    import time

    return time.monotonic()


def _reraise(exc: Exception) -> None:
    raise exc


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    try:
        return list(store.multi_get(keys))
    except AttributeError:  # torch < 2.4
        return [store.get(k) for k in keys]


def _multi_set(store: Any, keys: list[str], values: list[bytes]) -> None:
    try:
        store.multi_set(keys, values)
    except AttributeError:  # torch < 2.4
        for k, v in zip(keys, values):
            store.set(k, v)


@dataclass
class Traffic:
    """What one rank sent to and received from the store: requests, and bytes of keys and values."""

    requests: int = 0
    sent: int = 0
    received: int = 0
    #: the largest single request sent, in bytes
    largest: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, op: str, sent: int, received: int) -> None:
        with self._lock:  # the connections of one rank's lanes count into one Traffic from their threads
            self.requests += 1
            self.sent += sent
            self.received += received
            self.largest = max(self.largest, sent)
            self.by_op[op] = self.by_op.get(op, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        return {"requests": self.requests, "sent": self.sent, "received": self.received, "largest": self.largest,
                "by_op": dict(self.by_op)}


class StoreTraffic:
    """A c10d store that counts the requests and bytes that go through it into :attr:`traffic` (a rank's view of
    its store traffic); every other call goes to ``inner``. :meth:`clone` returns a counter of a clone of
    ``inner`` sharing the same :attr:`traffic` (``share_connection``: the same ``inner``, for simulations that
    cannot open a connection per lane)."""

    def __init__(self, inner: Any, traffic: Traffic | None = None, *, share_connection: bool = False) -> None:
        self.inner = inner
        self.traffic = traffic if traffic is not None else Traffic()
        self._share = share_connection

    def _count(self, op: str, sent: int, received: int, key: str) -> None:
        """Count one request (``key``: its first key, for subclasses that count by key)."""
        self.traffic.add(op, sent, received)

    def clone(self) -> StoreTraffic:
        inner = self.inner if self._share else self.inner.clone()
        return StoreTraffic(inner, self.traffic, share_connection=self._share)

    def set(self, key: str, value: bytes | str) -> None:
        self._count("set", len(key) + len(value), 0, key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", len(key), len(value), key)
        return value

    def add(self, key: str, n: int) -> int:
        self._count("add", len(key) + 8, 8, key)
        return self.inner.add(key, n)

    def delete_key(self, key: str) -> bool:
        self._count("delete", len(key), 1, key)
        return self.inner.delete_key(key)

    def check(self, keys: list[str]) -> bool:
        self._count("check", sum(map(len, keys)), 1, keys[0] if keys else "")
        return self.inner.check(keys)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self._count("wait", sum(map(len, keys)), 1, keys[0] if keys else "")
        self.inner.wait(keys, *timeout)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self._count("compare_set", len(key) + len(expected) + len(desired), len(value), key)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self._count("multi_get", sum(map(len, keys)), sum(map(len, values)), keys[0] if keys else "")
        return values

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._count("multi_set", sum(map(len, keys)) + sum(map(len, values)), 0, keys[0] if keys else "")
        self.inner.multi_set(keys, values)

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
