"""Fault injection for tests: a :class:`Store` wrapper and an fsspec filesystem wrapper that fail, stall or truncate.

Both count the calls of every named operation (thread-safe) and, before delegating a call, apply the plan:

- ``fail={"open_write": [3]}``: the 3rd call (1-based) of ``open_write`` raises ``error_factory(op, n)``;
  ``fail={"write": "all"}`` fails every call of ``write``;
- ``fail_fraction=0.2``: each call of any operation (or only those in ``fraction_ops``) fails with that
  probability, drawn from a ``random.Random(seed)`` so a test is repeatable;
- ``stall={"write_bytes": 5.0}``: every call of ``write_bytes`` first sleeps 5 s (a hung request); a stall may also be
  limited to some calls with ``stall={"write_bytes": (5.0, [2])}``;
- ``short_writes=True``: stream writes and ``write_bytes`` silently store only the first half of the bytes (a
  lying backend), which size checks must catch.

The default error is ``ConnectionError`` (transient, so retries apply); pass an ``error_factory`` returning, say,
``PermissionError`` for a permanent fault. Operation names of :class:`FaultyStore` are the Store methods
(``list exists size read_bytes readinto open_read makedirs open_write write_bytes remove replace_dir sync_dir``)
plus ``write``/``close`` of write streams and ``read`` of read streams. :class:`FaultyFileSystem` uses the fsspec
method names (``cat_file pipe_file open info ls rm makedirs ...``) plus ``write``/``close`` on files opened to write.
Each wrapper's ``OPS`` holds its names; a plan that names any other operation raises ``ValueError``.
"""

from __future__ import annotations

import builtins
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, BinaryIO

from .base import Store, WriteStream

ErrorFactory = Callable[[str, int], BaseException]


def default_error(op: str, n: int) -> BaseException:
    return ConnectionError(f"injected fault: {op} call {n}")


class FaultPlan:
    """Which calls fail or stall; shared by the wrappers below. ``calls`` counts every operation by name.

    ``ops``: the operation names the plan may name (a wrapper passes its own :attr:`~FaultyStore.OPS`); by default
    those of either wrapper (:func:`known_ops`). A name in ``fail``, ``stall`` or ``fraction_ops`` outside them
    raises ``ValueError``: a misspelt operation would otherwise never fail, and the test would pass for nothing.
    """

    def __init__(
        self,
        *,
        fail: Mapping[str, Iterable[int] | str] | None = None,
        fail_fraction: float = 0.0,
        fraction_ops: Iterable[str] | None = None,
        seed: int = 0,
        stall: Mapping[str, float | tuple[float, Iterable[int]]] | None = None,
        short_writes: bool = False,
        error_factory: ErrorFactory = default_error,
        sleep: Callable[[float], None] = time.sleep,
        ops: Iterable[str] | None = None,
    ) -> None:
        if not 0.0 <= fail_fraction <= 1.0:
            raise ValueError(f"fail_fraction must be in [0, 1], got {fail_fraction}")
        known = frozenset(ops) if ops is not None else known_ops()
        for what, names in (("fail", fail), ("stall", stall), ("fraction_ops", fraction_ops)):
            unknown = sorted(set(names or ()) - known)
            if unknown:
                raise ValueError(f"{what} names an unknown operation {', '.join(map(repr, unknown))}; "
                                 f"known: {', '.join(sorted(known))}")
        self.fail: dict[str, set[int] | str] = {}
        for op, which in (fail or {}).items():
            self.fail[op] = "all" if which == "all" else {int(n) for n in which}
        self.fail_fraction = fail_fraction
        self.fraction_ops = set(fraction_ops) if fraction_ops is not None else None
        self.stall: dict[str, tuple[float, set[int] | None]] = {}
        for op, spec in (stall or {}).items():
            if isinstance(spec, tuple):
                self.stall[op] = (float(spec[0]), {int(n) for n in spec[1]})
            else:
                self.stall[op] = (float(spec), None)
        self.short_writes = short_writes
        self.error_factory = error_factory
        self.sleep = sleep
        self.calls: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def hit(self, op: str) -> int:
        """Count a call of ``op``; stall and/or raise as planned. Returns the call's 1-based number."""
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
            which = self.fail.get(op)
            failing = which == "all" or (isinstance(which, set) and n in which)
            if not failing and self.fail_fraction and (self.fraction_ops is None or op in self.fraction_ops):
                failing = self._rng.random() < self.fail_fraction
            if failing:
                self.failures[op] += 1
        stall = self.stall.get(op)
        if stall is not None and (stall[1] is None or n in stall[1]):
            self.sleep(stall[0])
        if failing:
            raise self.error_factory(op, n)
        return n

    def clip(self, data: Any) -> memoryview:
        """The part of ``data`` a short-writing backend keeps."""
        view = memoryview(data).cast("B")
        return view[: len(view) // 2] if self.short_writes else view


class _FaultyWriteStream(WriteStream):
    def __init__(self, inner: WriteStream, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def write(self, data: memoryview | bytes) -> None:
        try:
            self.plan.hit("write")
        except BaseException:
            self.inner.abort()
            raise
        self.inner.write(self.plan.clip(data))

    def close(self) -> None:
        try:
            self.plan.hit("close")
        except BaseException:
            self.inner.abort()
            raise
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class _FaultyReader:
    """Wraps a binary reader so that ``read``/``readinto`` go through the plan as op ``read``."""

    def __init__(self, inner: BinaryIO, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def read(self, n: int = -1) -> bytes:
        self._plan.hit("read")
        return self._inner.read(n)

    def readinto(self, b: Any) -> int:
        self._plan.hit("read")
        n: int = self._inner.readinto(b)  # type: ignore[attr-defined]
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> _FaultyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


class FaultyStore(Store):
    """A :class:`Store` that delegates to ``inner`` after applying a :class:`FaultPlan` (see the module docstring).

    Capabilities are ``inner``'s, except ``local_path`` (None unless ``keep_local_path``), so that callers never
    bypass the faults with OS calls, and ``read_concurrency`` (1 unless given: concurrent reads would make which
    chunk is "the n-th ``readinto``" a race). ``plan.calls`` counts the calls per operation.
    """

    #: The operations a plan may name: every method the :class:`Store` interface requires and its
    #: ``replace_dir``/``sync_dir`` hooks, each counted under its own name (``sizes`` counts as ``list``), plus
    #: ``write``/``close`` of write streams and ``read`` of read streams. Other methods are delegated unchecked.
    OPS: frozenset[str] = frozenset(Store.__abstractmethods__) | {"replace_dir", "sync_dir", "write", "close", "read"}

    def __init__(
        self,
        inner: Store,
        *,
        fail: Mapping[str, Iterable[int] | str] | None = None,
        fail_fraction: float = 0.0,
        fraction_ops: Iterable[str] | None = None,
        seed: int = 0,
        stall: Mapping[str, float | tuple[float, Iterable[int]]] | None = None,
        short_writes: bool = False,
        error_factory: ErrorFactory = default_error,
        keep_local_path: bool = False,
        read_concurrency: int = 1,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.inner = inner
        self.read_concurrency = read_concurrency
        self.plan = FaultPlan(
            fail=fail,
            fail_fraction=fail_fraction,
            fraction_ops=fraction_ops,
            seed=seed,
            stall=stall,
            short_writes=short_writes,
            error_factory=error_factory,
            sleep=sleep,
            ops=self.OPS,
        )
        self.url = inner.url
        self.tier = inner.tier
        self.atomic_rename = inner.atomic_rename
        self.parallel_writes = inner.parallel_writes
        self.exclusive_create = inner.exclusive_create
        self.spread_keys = inner.spread_keys
        self.local_path = inner.local_path if keep_local_path else None

    @property
    def calls(self) -> Counter[str]:
        return self.plan.calls

    def list(self, rel: str = "") -> list[str]:
        self.plan.hit("list")
        return self.inner.list(rel)

    def sizes(self, rel: str = "") -> dict[str, int]:
        self.plan.hit("list")
        return self.inner.sizes(rel)

    def exists(self, rel: str) -> bool:
        self.plan.hit("exists")
        return self.inner.exists(rel)

    def size(self, rel: str) -> int:
        self.plan.hit("size")
        return self.inner.size(rel)

    def read_bytes(self, rel: str, *, max_size: int) -> bytes:
        self.plan.hit("read_bytes")
        return self.inner.read_bytes(rel, max_size=max_size)

    def readinto(self, rel: str, offset: int, buf: memoryview) -> int:
        self.plan.hit("readinto")
        return self.inner.readinto(rel, offset, buf)

    def open_read(self, rel: str) -> BinaryIO:
        self.plan.hit("open_read")
        return _FaultyReader(self.inner.open_read(rel), self.plan)  # type: ignore[return-value]

    def makedirs(self, rel: str) -> None:
        self.plan.hit("makedirs")
        self.inner.makedirs(rel)

    def open_write(self, rel: str, *, size_hint: int | None = None) -> WriteStream:
        self.plan.hit("open_write")
        return _FaultyWriteStream(self.inner.open_write(rel, size_hint=size_hint), self.plan)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.plan.hit("write_bytes")
        self.inner.write_bytes(rel, bytes(self.plan.clip(data)))

    def diagnose(self) -> BaseException | None:
        return self.inner.diagnose()

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        self.plan.hit("write_bytes")  # the same request as a write, conditional
        return self.inner.create_exclusive(rel, bytes(self.plan.clip(data)))

    def remove(self, rel: str) -> None:
        self.plan.hit("remove")
        self.inner.remove(rel)

    def replace_dir(self, src: str, dst: str) -> None:
        self.plan.hit("replace_dir")
        self.inner.replace_dir(src, dst)

    def sync_dir(self, rel: str) -> None:
        self.plan.hit("sync_dir")
        self.inner.sync_dir(rel)

    def discard_unfinished_uploads(self, *, dry_run: bool = False,
                                   older_than_s: float | None = None) -> builtins.list[str]:
        return self.inner.discard_unfinished_uploads(dry_run=dry_run, older_than_s=older_than_s)

    def modified_times(self) -> dict[str, float | None]:
        return self.inner.modified_times()

    def close(self) -> None:
        self.inner.close()


class _FaultyFile:
    """A file opened for writing through :class:`FaultyFileSystem`: ``write``/``close`` go through the plan."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    def write(self, data: Any) -> int:
        self._plan.hit("write")
        kept = self._plan.clip(data)
        self._inner.write(kept)
        return len(memoryview(data).cast("B"))

    def close(self) -> None:
        self._plan.hit("close")
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_inner", "_plan"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __enter__(self) -> _FaultyFile:
        return self

    def __exit__(self, exc_type: Any, *rest: object) -> None:
        if exc_type is None:
            self.close()


class FaultyFileSystem:
    """An fsspec filesystem proxy that applies a :class:`FaultPlan` to the calls named in it.

    Every public method of the wrapped filesystem is reachable; a call of a method named in ``fail``/``stall`` (or
    any, with ``fail_fraction``) is counted and may fail or stall first. Files opened with a ``w`` mode come back
    wrapped, so their ``write``/``close`` calls go through the plan too. Use it with
    ``FsspecStore(url, fs=FaultyFileSystem(real_fs, fail={"cat_file": [2]}))``.
    """

    _HOOKED = frozenset(
        {
            "ls",
            "info",
            "exists",
            "size",
            "cat_file",
            "pipe_file",
            "open",
            "rm",
            "rm_file",
            "makedirs",
            "mkdir",
            "mv",
            "copy",
            "put_file",
            "get_file",
        }
    )

    #: The operations a plan may name: the hooked methods, plus ``write``/``close`` of files opened to write.
    OPS: frozenset[str] = _HOOKED | {"write", "close"}

    def __init__(self, fs: Any, **plan: Any) -> None:
        self.fs = fs
        self.plan = FaultPlan(**plan, ops=self.OPS)

    @property
    def calls(self) -> Counter[str]:
        return self.plan.calls

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        self.plan.hit("open")
        f = self.fs.open(path, mode, **kwargs)
        return _FaultyFile(f, self.plan) if any(c in mode for c in "wax") else f

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> Any:
        self.plan.hit("pipe_file")
        return self.fs.pipe_file(path, bytes(self.plan.clip(value)), **kwargs)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.fs, name)
        if name not in self._HOOKED or not callable(attr):
            return attr
        plan = self.plan

        def hooked(*args: Any, **kwargs: Any) -> Any:
            plan.hit(name)
            return attr(*args, **kwargs)

        return hooked


def known_ops() -> frozenset[str]:
    """Every operation name some wrapper here counts: the default vocabulary of a :class:`FaultPlan`."""
    return FaultyStore.OPS | FaultyFileSystem.OPS
