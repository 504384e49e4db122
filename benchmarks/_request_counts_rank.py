"""One rank of the request-count benchmark (``benchmarks/request_counts.py``):
``python _request_counts_rank.py RANK CONFIG_JSON``.

The rank joins a gloo process group through a FileStore (``file://``, no ports), runs one phase and writes what it
saw to ``<result_dir>/result-r<rank>.json``; it exits non-zero when the phase failed or restored wrong bytes.
SIGUSR1 prints every thread's stack to stderr (the launcher sends it to a rank that outlived its timeout).

- ``save``: a manager on this rank's own local folder (one rank per "node") with the S3 remote saves steps
  1..S of a per-rank state, waiting after each save until it is durable and committed on every tier, then closes;
- ``restart``: a new manager on the same local folder restores into zeros; the bytes must be step S's;
- ``restart-wiped``: the same after deleting the local folder first (every shard comes from the remote).

While the phase runs (the deletion of ``restart-wiped`` left out), :class:`LocalOps` counts the filesystem metadata
calls (open, fsync, rename, mkdir, unlink/rmdir, listdir/scandir, stat) that this process makes under its local
folder, and the bytes it reads there; the record's ``local_ops`` holds them (:meth:`LocalOps.snapshot`).

Every S3 request of this rank carries ``tierckpt-rank/<rank>`` in its User-Agent (botocore's ``user_agent_extra``,
which changes nothing else), so that the counting server can tell the ranks apart.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import faulthandler
import io
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("save", "restart", "restart-wiped")
#: what the counting server looks for in the User-Agent header
USER_AGENT_TAG = "tierckpt-rank"

# ------------------------------------------------------------------------------------------------ local-tier calls
#: the filesystem metadata calls counted on the local tier, by category: the names under which :class:`LocalOps`
#: counts each wrapped function (``os.open(dir_fd)``: an ``os.open`` of a name relative to a folder's descriptor, as
#: ``shutil.rmtree`` makes them; ``renameat2``: tierckpt's atomic exchange of two step folders, through ctypes)
LOCAL_OP_CATEGORIES: dict[str, tuple[str, ...]] = {
    "open": ("open", "os.open", "os.open(dir_fd)"),
    "fsync": ("os.fsync", "os.fdatasync"),
    "rename": ("os.rename", "os.replace", "renameat2"),
    "mkdir": ("os.mkdir",),
    "unlink": ("os.unlink", "os.remove", "os.rmdir"),
    "listdir": ("os.listdir", "os.scandir"),
    "stat": ("os.stat", "os.lstat", "os.fstat"),
}
#: the audit events (:func:`sys.addaudithook`) that CPython raises for the calls of a category, whatever code makes
#: them: an independent count of those categories (``fsync`` and ``stat`` raise none)
AUDIT_CATEGORIES: dict[str, str] = {
    "open": "open", "os.rename": "rename", "os.remove": "unlink", "os.rmdir": "unlink", "os.mkdir": "mkdir",
    "os.listdir": "listdir", "os.scandir": "listdir",
}
#: the wrapped calls that raise one of :data:`AUDIT_CATEGORIES`' events each, by category. ``os.open(dir_fd)`` and
#: ``renameat2`` are left out: the audit event of an ``os.open`` does not carry its ``dir_fd`` (so the name cannot be
#: placed), and a ctypes call raises no rename event
AUDITED_CALLS: dict[str, tuple[str, ...]] = {
    "open": ("open", "os.open"), "rename": ("os.rename", "os.replace"), "mkdir": ("os.mkdir",),
    "unlink": ("os.unlink", "os.remove", "os.rmdir"), "listdir": ("os.listdir", "os.scandir"),
}
_READ_CALLS = ("read", "pread", "readv", "preadv")


def local_op_categories(calls: dict[str, int]) -> dict[str, int]:
    """Counts by function name (:attr:`LocalOps.calls`) summed into :data:`LOCAL_OP_CATEGORIES`, every category
    present (0 when none)."""
    return {cat: sum(calls.get(name, 0) for name in names) for cat, names in LOCAL_OP_CATEGORIES.items()}


class _CountingFile:
    """A file object opened for reading under the counted folder: every call goes to ``f``; what the read methods
    return is added to ``ops``'s :attr:`LocalOps.read_bytes` (bytes; characters for a file opened in text mode)."""

    def __init__(self, f: Any, ops: LocalOps) -> None:
        self._f = f
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CountingFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        for line in self._f:
            self._ops.add_read(len(line))
            yield line

    def _counted(self, data: Any) -> Any:
        if data is not None:
            self._ops.add_read(len(data))
        return data

    def read(self, *args: Any) -> Any:
        return self._counted(self._f.read(*args))

    def read1(self, *args: Any) -> Any:
        return self._counted(self._f.read1(*args))

    def readall(self) -> Any:
        return self._counted(self._f.readall())

    def readline(self, *args: Any) -> Any:
        return self._counted(self._f.readline(*args))

    def readinto(self, buf: Any) -> Any:
        n = self._f.readinto(buf)
        self._ops.add_read(n or 0)
        return n

    def readinto1(self, buf: Any) -> Any:
        n = self._f.readinto1(buf)
        self._ops.add_read(n or 0)
        return n


class LocalOps:
    """Counts the filesystem metadata calls this process makes on the paths under ``root`` (the rank's local tier),
    and the bytes it reads from files there, while :meth:`counting` is entered.

    The ``os`` functions of :data:`LOCAL_OP_CATEGORIES` (and ``open``, ``io.open``) are replaced by wrappers that
    count a call when its path (resolved against ``dir_fd`` and the working folder) lies under ``root``, or, for a
    call on a file descriptor (``fsync``, ``fstat``, ``scandir(fd)``, the ``os`` reads), when the descriptor's file
    does (``/proc/self/fd``). Every call is counted, those that raise ``OSError`` too (also in :attr:`failed`). The
    wrappers reach the code that looks the functions up on ``os`` when it calls (``os.path.exists`` calls
    ``os.stat``, ``os.makedirs`` ``os.mkdir``, ``shutil.rmtree`` ``os.scandir``/``os.unlink``/``os.rmdir``),
    not a C library call nor a name bound before :meth:`counting` (``from os import stat``). An audit hook counts
    the same calls a second way (:attr:`audit`, by :data:`AUDIT_CATEGORIES`), from CPython's own events, which are
    raised whichever way a call is reached: where the two differ, some call went around the wrappers.

    Returns nothing itself: :meth:`snapshot` gives the counts (JSON-able).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        """``root``: the folder whose calls are counted (it need not exist yet)."""
        self.roots = tuple({os.path.abspath(root), os.path.realpath(root)})
        self.calls: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.audit: dict[str, int] = {}
        self.creates = 0
        self.read_bytes = 0
        self._lock = threading.Lock()
        self._active = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._readlink = os.readlink
        self._hooked = False

    # --- which paths count
    def _under(self, path: str) -> bool:
        return any(path == r or path.startswith(r + os.sep) for r in self.roots)

    def _fd_path(self, fd: int) -> str | None:
        try:
            return self._readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None

    def _resolve(self, path: Any, dir_fd: int | None = None) -> str | None:
        """The absolute path that ``path`` (a path, bytes, or a file descriptor) names; None where unknown."""
        if path is None:
            path = "."
        if isinstance(path, int):
            return self._fd_path(path)
        try:
            p = os.fsdecode(os.fspath(path))
        except TypeError:
            return None
        if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(p):
            base = self._fd_path(dir_fd)
            if base is None:
                return None
            p = os.path.join(base, p)
        return os.path.abspath(p)

    def mine(self, path: Any, dir_fd: int | None = None) -> bool:
        """Whether ``path`` (relative to ``dir_fd`` when given) lies under the counted folder."""
        where = self._resolve(path, dir_fd)
        return where is not None and self._under(where)

    def _fd_mine(self, fd: Any) -> bool:
        if not isinstance(fd, int):
            fileno = getattr(fd, "fileno", None)
            if fileno is None:
                return False
            fd = fileno()
        where = self._fd_path(fd)
        return where is not None and self._under(where)

    # --- counting
    def _add(self, name: str, *, failed: bool = False) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            if failed:
                self.failed[name] = self.failed.get(name, 0) + 1

    def add_read(self, n: int) -> None:
        """``n`` bytes were read from a file under the counted folder."""
        with self._lock:
            self.read_bytes += n

    def _call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            out = fn(*args, **kwargs)
        except OSError:
            self._add(name, failed=True)
            raise
        self._add(name)
        return out

    def _path_fn(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A wrapper of ``fn(path, ..., dir_fd=None)`` (``path`` may be a descriptor; absent: the working folder)."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            path = args[0] if args else kwargs.get("path")
            if not self._active or not self.mine(path, kwargs.get("dir_fd")):
                return fn(*args, **kwargs)
            return self._call(name, fn, args, kwargs)

        return wrapper

    def _fd_fn(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A wrapper of ``fn(fd, ...)`` (``fsync``, ``fdatasync``, ``fstat``)."""

        def wrapper(fd: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active or not self._fd_mine(fd):
                return fn(fd, *args, **kwargs)
            return self._call(name, fn, (fd, *args), kwargs)

        return wrapper

    def _read_fn(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A wrapper of an ``os`` read (``read``/``pread`` return bytes, ``readv``/``preadv`` a count)."""

        def wrapper(fd: int, *args: Any, **kwargs: Any) -> Any:
            out = fn(fd, *args, **kwargs)
            if self._active and self._fd_mine(fd):
                self.add_read(out if isinstance(out, int) else len(out))
            return out

        return wrapper

    def _os_open(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
            dir_fd = kwargs.get("dir_fd")
            if not self._active or not self.mine(path, dir_fd):
                return fn(path, flags, *args, **kwargs)
            relative = dir_fd is not None and not os.path.isabs(os.fsdecode(os.fspath(path)))
            if flags & os.O_CREAT:
                with self._lock:
                    self.creates += 1
            return self._call("os.open(dir_fd)" if relative else "os.open", fn, (path, flags, *args), kwargs)

        return wrapper

    def _open(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if not self._active or isinstance(file, int) or not self.mine(file):
                return fn(file, mode, *args, **kwargs)
            if any(c in mode for c in "wxa"):
                with self._lock:
                    self.creates += 1
            f = self._call("open", fn, (file, mode, *args), kwargs)
            return _CountingFile(f, self) if "r" in mode and "+" not in mode else f

        return wrapper

    def _rename_fn(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active or not (self.mine(src, kwargs.get("src_dir_fd"))
                                        or self.mine(dst, kwargs.get("dst_dir_fd"))):
                return fn(src, dst, *args, **kwargs)
            return self._call(name, fn, (src, dst, *args), kwargs)

        return wrapper

    def _renameat2(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """tierckpt's ``renameat2`` through ctypes (``dirfd, path, dirfd, path, flags``; the return code: 0 or -1)."""

        def wrapper(dfd1: int, a: bytes, dfd2: int, b: bytes, flags: int) -> Any:
            rc = fn(dfd1, a, dfd2, b, flags)
            if self._active and (self.mine(a) or self.mine(b)):
                self._add("renameat2", failed=rc != 0)
            return rc

        return wrapper

    def _audit_hook(self, event: str, args: tuple[Any, ...]) -> None:
        """Counts CPython's audit events of calls under the counted folder (:data:`AUDIT_CATEGORIES`)."""
        cat = AUDIT_CATEGORIES.get(event)
        if cat is None or not self._active:
            return
        if event == "os.rename":
            mine = self.mine(args[0], args[2]) or self.mine(args[1], args[3])
        elif event in ("os.remove", "os.rmdir"):
            mine = self.mine(args[0], args[1])
        elif event == "os.mkdir":
            mine = self.mine(args[0], args[2])
        elif event == "open":
            mine = not isinstance(args[0], int) and self.mine(args[0])
        else:
            mine = self.mine(args[0])
        if mine:
            with self._lock:
                self.audit[cat] = self.audit.get(cat, 0) + 1

    def _patch(self, owner: Any, attr: str, wrapper: Callable[..., Any]) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, wrapper)

    @contextlib.contextmanager
    def counting(self) -> Iterator[LocalOps]:
        """Count while inside: installs the wrappers (and, once per process, the audit hook), and puts the original
        functions back on the way out. Yields this counter."""
        from tierckpt.storage import local as local_store

        if not self._hooked:  # an audit hook cannot be removed: it stops counting with the rest
            sys.addaudithook(self._audit_hook)
            self._hooked = True
        for name in ("stat", "lstat", "mkdir", "unlink", "remove", "rmdir", "listdir", "scandir"):
            self._patch(os, name, self._path_fn(f"os.{name}", getattr(os, name)))
        for name in ("fsync", "fdatasync", "fstat"):
            if hasattr(os, name):
                self._patch(os, name, self._fd_fn(f"os.{name}", getattr(os, name)))
        for name in _READ_CALLS:
            if hasattr(os, name):
                self._patch(os, name, self._read_fn(getattr(os, name)))
        for name in ("rename", "replace"):
            self._patch(os, name, self._rename_fn(f"os.{name}", getattr(os, name)))
        self._patch(os, "open", self._os_open(os.open))
        opener = self._open(builtins.open)
        self._patch(builtins, "open", opener)
        self._patch(io, "open", opener)
        if local_store._renameat2 is not None:
            self._patch(local_store, "_renameat2", self._renameat2(local_store._renameat2))
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            while self._saved:
                owner, attr, original = self._saved.pop()
                setattr(owner, attr, original)

    def snapshot(self) -> dict[str, Any]:
        """The counts so far: ``calls`` and ``failed`` by function name, ``categories``
        (:func:`local_op_categories`), ``creates`` (opens that may create a file: ``O_CREAT``, or a ``w``/``x``/``a``
        mode), ``read_bytes``; ``audit``: the audit events by category, and ``audit_wrapped``: the wrapped calls
        that raise them (:data:`AUDITED_CALLS`), which ``audit`` must equal."""
        with self._lock:
            calls = dict(sorted(self.calls.items()))
            return {"calls": calls, "failed": dict(sorted(self.failed.items())),
                    "categories": local_op_categories(calls), "creates": self.creates,
                    "read_bytes": self.read_bytes, "audit": {c: self.audit.get(c, 0) for c in AUDITED_CALLS},
                    "audit_wrapped": {c: sum(calls.get(k, 0) for k in names) for c, names in AUDITED_CALLS.items()}}


# ------------------------------------------------------------------------------------------------ phases


def make_state(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    """This rank's state at ``step``: ``numel`` float32 values that differ across ranks and steps."""
    gen = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    return {"w": torch.randn(numel, generator=gen)}


def storage_options(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """The job's storage options plus this rank's User-Agent tag."""
    opts = json.loads(json.dumps(cfg["storage_options"]))
    opts.setdefault("config_kwargs", {})["user_agent_extra"] = f"{USER_AGENT_TAG}/{rank}"
    return opts


def open_manager(cfg: dict[str, Any], rank: int, local: Path) -> Any:
    """A manager with the benchmark's settings (the same on every rank)."""
    import tierckpt

    return tierckpt.CheckpointManager(
        local, remote=cfg["remote"], storage_options=storage_options(cfg, rank), keep_local=2, keep_remote=3,
        collective_timeout_s=cfg["collective_timeout_s"])


def phase_save(cfg: dict[str, Any], rank: int, local: Path) -> dict[str, Any]:
    """Save steps 1..S, each awaited (durable locally, uploaded and committed remotely) before the next. A save
    still not done after ``collective_timeout_s`` fails the phase with the save's state and ``mgr.health()`` (no
    remote request), instead of hanging until the launcher kills the rank."""
    mgr = open_manager(cfg, rank, local)
    limit = cfg["collective_timeout_s"]
    times = []
    try:
        for step in range(1, cfg["steps"] + 1):
            t0 = time.perf_counter()
            handle = mgr.save(step, make_state(rank, step, cfg["numel"]))
            try:
                mgr.wait(timeout=limit)
            except TimeoutError as exc:
                raise RuntimeError(
                    f"rank {rank}: save of step {step} not done after {limit:.0f} s (persisted: "
                    f"{handle.persisted.done()}, uploaded: {handle.uploaded.done()}); health: {mgr.health()}"
                ) from exc
            times.append(time.perf_counter() - t0)
    except BaseException:
        with contextlib.suppress(Exception):  # the save's error is the one to report; the others wait for us
            mgr.close(timeout=5.0)
        raise
    mgr.close(timeout=limit)
    return {"save_s": times}


def phase_restart(cfg: dict[str, Any], rank: int, local: Path) -> dict[str, Any]:
    """Restore the newest step into zeros from a fresh manager and compare the bytes with step S's."""
    state = {"w": torch.zeros(cfg["numel"])}
    mgr = open_manager(cfg, rank, local)
    try:
        t0 = time.perf_counter()
        step = mgr.restore(state)
        restore_s = time.perf_counter() - t0
    finally:
        mgr.close()
    want = make_state(rank, cfg["steps"], cfg["numel"])["w"]
    equal = step == cfg["steps"] and torch.equal(state["w"], want)
    out: dict[str, Any] = {"restored": step, "equal": bool(equal), "restore_s": restore_s}
    if not equal:
        diff = (state["w"] != want).nonzero()
        out["mismatch"] = (f"rank {rank}: restored step {step}, expected {cfg['steps']}; "
                           f"{diff.numel()} of {want.numel()} values differ")
    return out


def main() -> int:
    """Run the configured phase as rank ``argv[1]``; 0 when it succeeded and restored the right bytes."""
    rank, cfg = int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for stacks before it kills
    logging.basicConfig(format=f"%(asctime)s r{rank} %(threadName)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("tierckpt").setLevel(cfg.get("log_level", "WARNING"))
    torch.set_num_threads(1)
    phase = cfg["phase"]
    if phase not in PHASES:
        raise SystemExit(f"unknown phase {phase!r}")
    t_start = time.perf_counter()
    dist.init_process_group("gloo", init_method=cfg["init_method"], rank=rank, world_size=cfg["world"],
                            timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"] * 2))
    local = Path(cfg["local_root"]) / f"node{rank:05d}"
    record: dict[str, Any] = {"rank": rank, "phase": phase, "ok": False}
    ops = LocalOps(local)
    try:
        dist.barrier()
        record["stage"] = "phase"  # where an error came from: the phase itself, or the barrier after it
        if phase == "restart-wiped":  # the benchmark's own deletion: not counted
            shutil.rmtree(local, ignore_errors=True)
        t0 = time.perf_counter()
        try:
            with ops.counting():
                if phase == "save":
                    record.update(phase_save(cfg, rank, local))
                    record["ok"] = True
                else:
                    record.update(phase_restart(cfg, rank, local))
                    record["ok"] = record["equal"]
        finally:
            record["local_ops"] = ops.snapshot()
        record["phase_s"] = time.perf_counter() - t0
        record["stage"] = "barrier"
        dist.barrier()
    except Exception as exc:
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    record["process_s"] = time.perf_counter() - t_start
    path = Path(cfg["result_dir"]) / f"result-r{rank:05d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    if record["ok"]:
        dist.destroy_process_group()
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
