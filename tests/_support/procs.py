"""Python child processes started from a forkserver that has already imported torch.

``import torch`` costs every new interpreter about 1.5 s of CPU; the suite starts a few hundred children (ranks,
CLI runs, killed savers, memory probes). Forked from a server that imported torch once (:data:`PRELOAD`), each
starts in a fraction of a second. They are separate OS processes all the same: their own memory and file
descriptors, killed by SIGKILL, exiting with the status a fresh interpreter would (``sys.exit`` codes, 1 for an
uncaught exception, minus the signal's number when killed). Nothing of tierckpt is preloaded: it reads its
environment (fault points, switches) when imported, so each child imports it under its own environment.

Not for what needs a fresh interpreter: checks that something is *not* imported, and children whose interpreter
options or malloc settings must differ from the server's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: what the forkserver imports once; every child starts with these in ``sys.modules`` (s3fs: 0.3 s of CPU for each
#: child that reaches an S3 remote otherwise; it reads its environment and credentials only when used)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy", "s3fs"]
_context: Any = None


def forkserver() -> Any:
    """The multiprocessing context whose forkserver starts the children (started on first use, one per test
    process)."""
    global _context
    if _context is None:
        import multiprocessing

        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_as_main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str | None = None,
                stdin: str | None = None) -> None:
    """In a child forked from the server: ``python ARGS`` in ``cwd`` with ``env`` (a script, ``-m module`` or
    ``-c code``, then its arguments), stdout to the file ``out``, stderr to ``err`` (or ``out``), stdin from the
    file ``stdin`` (or /dev/null), run as a fresh interpreter would run it: as ``__main__``, the script's folder (or
    the working folder) first on ``sys.path``, non-daemon threads joined and exit handlers run at the end."""
    import atexit
    import runpy
    import threading

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    streams = [os.open(stdin or os.devnull, os.O_RDONLY),
               os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)]
    streams.append(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if err else os.dup(streams[1]))
    for fd, stream in enumerate(streams):
        os.dup2(stream, fd)
        os.close(stream)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - multiprocessing replaced sys.stdin with /dev/null
    buffered = not env.get("PYTHONUNBUFFERED")  # read only by a new interpreter: applied here
    sys.stdout.reconfigure(line_buffering=not buffered, write_through=not buffered)
    sys.stderr.reconfigure(line_buffering=True)
    if env.get("OMP_NUM_THREADS"):  # read by OpenMP when the server loaded it: torch's own setting instead
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0:0] = [os.getcwd(), *extra]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0:0] = ["", *extra]
            code = compile(args[1], "<string>", "exec")
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 - the test's own code
        else:
            sys.argv = list(args)
            sys.path[0:0] = [os.path.dirname(os.path.abspath(args[0])), *extra]
            runpy.run_path(args[0], run_name="__main__")
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit: non-daemon threads first,
        atexit._run_exitfuncs()  # then the exit handlers (multiprocessing's child exit skips both)
        sys.stdout.flush()
        sys.stderr.flush()


class Child:
    """A running child (:func:`start_python`): ``pid``, ``poll()``, ``wait()``, ``kill()``, ``send_signal()``,
    ``returncode`` as on a :class:`subprocess.Popen`; its output is in the files :attr:`out` and :attr:`err`."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None, cwd: str | os.PathLike[str] | None,
                 out: Path, err: Path | None, stdin: Path | None) -> None:
        self.args = [sys.executable, *args]
        self.out, self.err = out, err
        #: a temporary folder of its output that :meth:`communicate` removes
        self.folder: Path | None = None
        self._read = 0  # of its stdout, by readline()
        self._proc = forkserver().Process(
            target=run_as_main,
            args=(list(args), dict(os.environ if env is None else env), os.fspath(cwd or os.getcwd()), str(out),
                  None if err is None else str(err), None if stdin is None else str(stdin)),
            name=f"child-{Path(str(args[1] if args[0] in ('-m', '-c') else args[0])).name[:40]}")
        self._proc.start()
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode  # type: ignore[no-any-return]

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its output and errors once it has exited (as ``Popen.communicate`` with ``text=True``)."""
        self.wait(timeout)
        out, err = self.output(), self.errors()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        return out, err

    def readline(self, timeout: float = 60) -> str:
        """The next line it writes to stdout (as ``Popen.stdout.readline()``): waits up to ``timeout`` s for it;
        what is there (possibly "") once it has exited or the time ran out."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.out, "rb") as f:
                f.seek(self._read)
                data = f.read()
            end = data.find(b"\n")
            if end >= 0 or self.poll() is not None or time.monotonic() > deadline:
                line = data if end < 0 else data[:end + 1]
                self._read += len(line)
                return line.decode(errors="replace")
            time.sleep(0.02)

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def errors(self) -> str:
        """What it wrote to stderr (empty where that was not a file of its own)."""
        return self.err.read_text(errors="replace") if self.err is not None and self.err.is_file() else ""


def start_python(args: list[str], *, folder: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, stdout: str | os.PathLike[str] | None = None,
                 stderr: str | os.PathLike[str] | None = None, stdin: str | os.PathLike[str] | None = None) -> Child:
    """Start ``python ARGS`` as a :class:`Child`, its output in new files under ``folder`` (by default a temporary
    folder removed by :meth:`Child.communicate`); ``stdout`` names a file for its output instead (its errors then
    go there too unless ``stderr`` is given), ``stderr`` where its errors go (e.g. a pseudo-terminal's device),
    ``stdin`` a file or a FIFO to read from."""
    if stdout is not None:
        return Child(args, env=env, cwd=cwd, out=Path(stdout), err=None if stderr is None else Path(stderr),
                     stdin=None if stdin is None else Path(stdin))
    own = folder is None
    folder = tempfile.mkdtemp(prefix="child-") if folder is None else folder
    fd, out = tempfile.mkstemp(prefix="out-", suffix=".txt", dir=folder)
    os.close(fd)
    if stderr is None:
        fd, stderr = tempfile.mkstemp(prefix="err-", suffix=".txt", dir=folder)
        os.close(fd)
    child = Child(args, env=env, cwd=cwd, out=Path(out), err=Path(stderr), stdin=None if stdin is None else Path(stdin))
    child.folder = Path(folder) if own else None
    return child


def run_python(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
               timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` with the child forked from
    the server; a child still running after ``timeout`` s is killed and :class:`subprocess.TimeoutExpired`
    raised."""
    stdin = None
    if input is not None:
        fd, name = tempfile.mkstemp(prefix="stdin-")
        os.write(fd, input.encode())
        os.close(fd)
        stdin = Path(name)
    try:
        child = start_python(args, env=env, cwd=cwd, stdin=stdin)
        try:
            out, err = child.communicate(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            raise subprocess.TimeoutExpired(child.args, timeout, out, err) from None
        return subprocess.CompletedProcess(child.args, child.wait(), out, err)
    finally:
        if stdin is not None:
            stdin.unlink()
