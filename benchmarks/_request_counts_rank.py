"""One rank of ``request_counts.py``: ``python _request_counts_rank.py RANK CONFIG_JSON``.

The rank runs the configured phases in turn, each in a gloo process group of its own (a FileStore, no ports), as a
restarted job would: ``save`` (a manager on this rank's own local folder, one rank per "node", saves steps 1..S to
the S3 remote, each awaited until durable and committed on every tier), ``restart`` (a new manager restores into
zeros; the bytes must be step S's) and ``restart-wiped`` (the same after deleting the local folder: every shard comes
from the remote). Each phase's record goes to ``<run_dir>/result-r<rank>-<phase>.json``; the rank stops and exits 1
at the first phase that fails or restores wrong bytes. SIGUSR1 prints every thread's stack (the launcher sends it to
a rank that outlived its timeout). Every S3 request carries ``tierckpt-rank/<rank> tierckpt-phase/<phase>`` in its
User-Agent (botocore's ``user_agent_extra``), so that the counting server tells ranks and phases apart.

While a phase runs (the wipe left out), :class:`LocalOps` counts the file system calls this process makes under its
local folder, and the bytes it reads there.
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

#: the calls counted on the local tier by category, under the names :class:`LocalOps` counts each wrapped function
#: (``os.open(dir_fd)``: relative to a folder's descriptor, as ``shutil.rmtree`` opens; ``renameat2``: tierckpt's
#: atomic exchange of two step folders, through ctypes)
LOCAL_OP_CATEGORIES: dict[str, tuple[str, ...]] = {
    "open": ("open", "os.open", "os.open(dir_fd)"), "fsync": ("os.fsync", "os.fdatasync"),
    "rename": ("os.rename", "os.replace", "renameat2"), "mkdir": ("os.mkdir",),
    "unlink": ("os.unlink", "os.remove", "os.rmdir"), "listdir": ("os.listdir", "os.scandir"),
    "stat": ("os.stat", "os.lstat", "os.fstat"),
}
#: CPython's audit events (:func:`sys.addaudithook`) of a category's calls, whatever code makes them: a second,
#: independent count (``fsync`` and ``stat`` raise none)
AUDIT_CATEGORIES = {"open": "open", "os.rename": "rename", "os.remove": "unlink", "os.rmdir": "unlink",
                    "os.mkdir": "mkdir", "os.listdir": "listdir", "os.scandir": "listdir"}
#: the wrapped calls that raise those events, by category (``os.open(dir_fd)``: its event lacks the ``dir_fd``, so
#: the name cannot be placed; ``renameat2``: a ctypes call raises none)
AUDITED_CALLS = {"open": ("open", "os.open"), "rename": ("os.rename", "os.replace"), "mkdir": ("os.mkdir",),
                 "unlink": ("os.unlink", "os.remove", "os.rmdir"), "listdir": ("os.listdir", "os.scandir")}


class _CountingFile:
    """A file opened for reading under the counted folder: what its read methods return is counted as read."""

    def __init__(self, f: Any, ops: LocalOps) -> None:
        self._f, self._ops = f, ops

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._f, name)
        if name in ("read", "read1", "readall", "readline"):
            return lambda *a: self._count(attr(*a), len)
        if name in ("readinto", "readinto1"):
            return lambda buf: self._count(attr(buf), int)
        return attr

    def _count(self, data: Any, size: Callable[[Any], int]) -> Any:
        self._ops.add_read(size(data) if data is not None else 0)
        return data

    def __enter__(self) -> _CountingFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __iter__(self) -> Iterator[Any]:
        for line in self._f:
            yield self._count(line, len)


class LocalOps:
    """Counts the file system calls this process makes on paths under ``root`` (the rank's local tier) and the bytes
    it reads from files there, while :meth:`counting` is entered.

    The ``os`` functions of :data:`LOCAL_OP_CATEGORIES` (and ``open``, ``io.open``) are replaced by wrappers that
    count a call when its path (resolved against ``dir_fd`` and the working folder) lies under ``root``, or, for a
    call on a descriptor (``fsync``, ``fstat``, ``scandir(fd)``, the ``os`` reads), when its file does
    (``/proc/self/fd``); failed calls too (also in ``failed``). They reach code that looks the functions up on ``os``
    when it calls (``os.path.exists`` calls ``os.stat``, ``shutil.rmtree`` ``os.scandir``/``os.unlink``/``os.rmdir``),
    not a C library call nor a name bound earlier (``from os import stat``): an audit hook counts the same calls from
    CPython's own events (``audit``), and where the two differ some call went around the wrappers."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.roots = tuple({os.path.abspath(root), os.path.realpath(root)})
        self.calls: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.audit: dict[str, int] = {}
        self.creates = self.read_bytes = 0
        self._lock = threading.Lock()
        self._active = self._hooked = False
        self._saved: list[tuple[Any, str, Any]] = []
        self._readlink = os.readlink

    def _fd_path(self, fd: int) -> str | None:
        try:
            return self._readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None

    def mine(self, path: Any, dir_fd: int | None = None) -> bool:
        """Whether ``path`` (a path, bytes or a descriptor; relative to ``dir_fd`` when given) lies under the folder."""
        if isinstance(path, int):
            where = self._fd_path(path)
        else:
            try:
                where = os.fsdecode(os.fspath("." if path is None else path))
            except TypeError:
                return False
            if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(where):
                base = self._fd_path(dir_fd)
                where = None if base is None else os.path.join(base, where)
            where = None if where is None else os.path.abspath(where)
        return where is not None and any(where == r or where.startswith(r + os.sep) for r in self.roots)

    def _fd_mine(self, fd: Any) -> bool:
        fd = fd if isinstance(fd, int) else getattr(fd, "fileno", lambda: None)()
        return fd is not None and self.mine(fd)

    def _add(self, name: str, failed: bool = False) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            if failed:
                self.failed[name] = self.failed.get(name, 0) + 1

    def add_read(self, n: int) -> None:
        with self._lock:
            self.read_bytes += n

    def _created(self) -> None:
        with self._lock:
            self.creates += 1

    def _wrap(self, name: str, fn: Callable[..., Any], mine: Callable[..., bool],
              before: Callable[..., str | None] | None = None) -> Callable[..., Any]:
        """``fn`` counting its calls under ``name`` where ``mine(*args, **kwargs)``; ``before`` may rename the call."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._active or not mine(*args, **kwargs):
                return fn(*args, **kwargs)
            called = (before(*args, **kwargs) if before else None) or name
            try:
                out = fn(*args, **kwargs)
            except OSError:
                self._add(called, failed=True)
                raise
            self._add(called)
            return out

        return wrapper

    def _path_arg(self, *args: Any, **kwargs: Any) -> bool:
        return self.mine(args[0] if args else kwargs.get("path"), kwargs.get("dir_fd"))

    def _fd_arg(self, fd: Any, *args: Any, **kwargs: Any) -> bool:
        return self._fd_mine(fd)

    def _os_open_call(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> str:
        if flags & os.O_CREAT:
            self._created()
        relative = kwargs.get("dir_fd") is not None and not os.path.isabs(os.fsdecode(os.fspath(path)))
        return "os.open(dir_fd)" if relative else "os.open"

    def _open(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        counted = self._wrap("open", fn, lambda file, *a, **k: not isinstance(file, int) and self.mine(file))

        def wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if not self._active or isinstance(file, int) or not self.mine(file):
                return fn(file, mode, *args, **kwargs)
            if any(c in mode for c in "wxa"):
                self._created()
            f = counted(file, mode, *args, **kwargs)
            return _CountingFile(f, self) if "r" in mode and "+" not in mode else f

        return wrapper

    def _read_fn(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """An ``os`` read (``read``/``pread`` return bytes, ``readv``/``preadv`` a count): its bytes counted."""

        def wrapper(fd: int, *args: Any, **kwargs: Any) -> Any:
            out = fn(fd, *args, **kwargs)
            if self._active and self._fd_mine(fd):
                self.add_read(out if isinstance(out, int) else len(out))
            return out

        return wrapper

    def _renameat2(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """tierckpt's ``renameat2`` through ctypes (``dirfd, path, dirfd, path, flags``; returns 0 or -1)."""

        def wrapper(dfd1: int, a: bytes, dfd2: int, b: bytes, flags: int) -> Any:
            rc = fn(dfd1, a, dfd2, b, flags)
            if self._active and (self.mine(a) or self.mine(b)):
                self._add("renameat2", failed=rc != 0)
            return rc

        return wrapper

    def _audit_hook(self, event: str, args: tuple[Any, ...]) -> None:
        cat = AUDIT_CATEGORIES.get(event)
        if cat is None or not self._active:
            return
        if event == "os.rename":
            mine = self.mine(args[0], args[2]) or self.mine(args[1], args[3])
        elif event in ("os.remove", "os.rmdir"):
            mine = self.mine(args[0], args[1])
        elif event == "os.mkdir":
            mine = self.mine(args[0], args[2])
        elif event == "open":  # open(fd) is not counted as a call either
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
        """Count while inside: the wrappers installed (and, once, the audit hook, which stays but stops counting),
        the original functions put back on the way out."""
        from tierckpt.storage import local as local_store

        if not self._hooked:
            sys.addaudithook(self._audit_hook)
            self._hooked = True
        for name in ("stat", "lstat", "mkdir", "unlink", "remove", "rmdir", "listdir", "scandir"):
            self._patch(os, name, self._wrap(f"os.{name}", getattr(os, name), self._path_arg))
        for name in ("fsync", "fdatasync", "fstat"):
            if hasattr(os, name):
                self._patch(os, name, self._wrap(f"os.{name}", getattr(os, name), self._fd_arg))
        for name in ("read", "pread", "readv", "preadv"):
            if hasattr(os, name):
                self._patch(os, name, self._read_fn(getattr(os, name)))
        for name in ("rename", "replace"):
            self._patch(os, name, self._wrap(f"os.{name}", getattr(os, name), lambda src, dst, *a, **k: (
                self.mine(src, k.get("src_dir_fd")) or self.mine(dst, k.get("dst_dir_fd")))))
        self._patch(os, "open", self._wrap("os.open", os.open, self._path_arg, self._os_open_call))
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
        """The counts (JSON-able): ``calls`` and ``failed`` by function, ``categories``, ``creates`` (opens that may
        create a file: ``O_CREAT``, or a ``w``/``x``/``a`` mode), ``read_bytes``, and ``audit`` (the audit events by
        category) beside ``audit_wrapped`` (the wrapped calls that raise them), which it must equal."""
        with self._lock:
            calls = dict(sorted(self.calls.items()))
            return {"calls": calls, "failed": dict(sorted(self.failed.items())),
                    "categories": {c: sum(calls.get(n, 0) for n in names) for c, names in LOCAL_OP_CATEGORIES.items()},
                    "creates": self.creates, "read_bytes": self.read_bytes,
                    "audit": {c: self.audit.get(c, 0) for c in AUDITED_CALLS},
                    "audit_wrapped": {c: sum(calls.get(k, 0) for k in names) for c, names in AUDITED_CALLS.items()}}


# ------------------------------------------------------------------------------------------ phases
def make_state(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    """This rank's state at ``step``: ``numel`` float32 values that differ across ranks and steps."""
    return {"w": torch.randn(numel, generator=torch.Generator().manual_seed(1_000_003 * (rank + 1) + step))}


def open_manager(cfg: dict[str, Any], rank: int, phase: str, local: Path) -> Any:
    """A manager with the benchmark's settings, its S3 requests tagged with the rank and the phase."""
    import tierckpt

    opts = json.loads(json.dumps(cfg["storage_options"]))
    opts.setdefault("config_kwargs", {})["user_agent_extra"] = f"tierckpt-rank/{rank} tierckpt-phase/{phase}"
    return tierckpt.CheckpointManager(local, remote=cfg["remote"], storage_options=opts, keep_local=2,
                                      keep_remote=3, collective_timeout_s=cfg["collective_timeout_s"])


def phase_save(cfg: dict[str, Any], rank: int, phase: str, local: Path) -> dict[str, Any]:
    """Save steps 1..S, each awaited (durable locally, uploaded and committed remotely) before the next. A save still
    not done after ``collective_timeout_s`` fails the phase with its state and ``mgr.health()``, rather than hang."""
    mgr, limit, times = open_manager(cfg, rank, phase, local), cfg["collective_timeout_s"], []
    try:
        for step in range(1, cfg["steps"] + 1):
            t0 = time.perf_counter()
            handle = mgr.save(step, make_state(rank, step, cfg["numel"]))
            try:
                mgr.wait(timeout=limit)
            except TimeoutError as exc:
                raise RuntimeError(f"rank {rank}: save of step {step} not done after {limit:.0f} s (persisted: "
                                   f"{handle.persisted.done()}, uploaded: {handle.uploaded.done()}); health: "
                                   f"{mgr.health()}") from exc
            times.append(time.perf_counter() - t0)
    except BaseException:
        with contextlib.suppress(Exception):  # the save's error is the one to report; the other ranks wait for us
            mgr.close(timeout=5.0)
        raise
    mgr.close(timeout=limit)
    return {"save_s": times, "ok": True}


def phase_restart(cfg: dict[str, Any], rank: int, phase: str, local: Path) -> dict[str, Any]:
    """Restore the newest step into zeros from a fresh manager; the bytes must be step S's."""
    state = {"w": torch.zeros(cfg["numel"])}
    with open_manager(cfg, rank, phase, local) as mgr:
        t0 = time.perf_counter()
        step = mgr.restore(state)
        restore_s = time.perf_counter() - t0
    want = make_state(rank, cfg["steps"], cfg["numel"])["w"]
    equal = step == cfg["steps"] and torch.equal(state["w"], want)
    out: dict[str, Any] = {"restored": step, "equal": bool(equal), "ok": bool(equal), "restore_s": restore_s}
    if not equal:
        out["mismatch"] = (f"rank {rank}: restored step {step}, expected {cfg['steps']}; "
                           f"{int((state['w'] != want).sum())} of {want.numel()} values differ")
    return out


PHASES = {"save": phase_save, "restart": phase_restart, "restart-wiped": phase_restart}


def run_phase(cfg: dict[str, Any], rank: int, phase: str, local: Path) -> dict[str, Any]:
    """One phase in a process group of its own, its local calls counted: the record (``ok``; ``stage`` says where an
    error came from: the phase itself, or the barrier after it, which follows another rank's error)."""
    record: dict[str, Any] = {"rank": rank, "phase": phase, "ok": False, "wall_start": time.time()}
    t_start = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{cfg['run_dir']}/store-{phase}", rank=rank,
                                world_size=cfg["world"],
                                timeout=datetime.timedelta(seconds=cfg["collective_timeout_s"] * 2))
        dist.barrier()
        record["stage"] = "phase"
        if phase == "restart-wiped":  # the benchmark's own deletion: not counted
            shutil.rmtree(local, ignore_errors=True)
        ops = LocalOps(local)
        t0 = time.perf_counter()
        try:
            with ops.counting():
                record.update(PHASES[phase](cfg, rank, phase, local))
        finally:
            record["local_ops"] = ops.snapshot()
        record["phase_s"] = time.perf_counter() - t0
        record["stage"] = "barrier"
        dist.barrier()
        if record["ok"]:
            dist.destroy_process_group()
    except Exception as exc:
        record.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    record["process_s"], record["wall_end"] = time.perf_counter() - t_start, time.time()
    return record


def main() -> int:
    """Run the configured phases as rank ``argv[1]``; 0 when all succeeded and restored the right bytes."""
    rank, cfg = int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(format=f"%(asctime)s r{rank} %(threadName)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("tierckpt").setLevel(cfg.get("log_level", "WARNING"))
    torch.set_num_threads(1)
    local = Path(cfg["local_root"]) / f"node{rank:05d}"
    for phase in cfg["phases"]:
        record = run_phase(cfg, rank, phase, local)
        path = Path(cfg["run_dir"]) / f"result-r{rank:05d}-{phase}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)
        if not record["ok"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
