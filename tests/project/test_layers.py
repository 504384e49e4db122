"""The package's layering, read from the source (AST) and checked by running the CLI without torch.

Rules (every runtime import counts, at module level or inside a function; imports under ``if TYPE_CHECKING:`` do
not; the implicit import of a module's parent packages is not an edge):

- no import cycle among tierckpt's modules;
- ``tierckpt.format`` imports nothing of tierckpt outside ``format`` but the leaves in :data:`FORMAT_LEAVES`;
- ``tierckpt.storage`` imports only ``storage``, ``format`` and the torch-free helpers in :data:`STORAGE_LEAVES`;
- ``tierckpt.tiers`` never imports the engine (:data:`ENGINE`) or the CLI;
- only the engine and :data:`ENGINE_USERS` import ``tierckpt.engine``, the manager's private components;
- the package's top level holds public modules only (and :data:`TOP_LEVEL_PRIVATE`): the private pieces
  live in the folders of their layer;
- nothing outside ``tierckpt.cli`` imports the CLI, except the ``python -m tierckpt`` entry point;
- ``format``, ``storage``, ``tiers`` and ``cli``, and every module they import, directly or not, import no torch;
- ``tierckpt ls`` and ``tierckpt verify`` run in a process where ``import torch`` fails.

A failure names the module, the file and line, and the import statement at fault.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests._support.helpers import REPO_ROOT, subprocess_env
from tierckpt import CheckpointManager

PACKAGE = REPO_ROOT / "tierckpt"

#: What ``tierckpt.format`` may import of tierckpt outside itself: leaves, which import nothing of tierckpt.
FORMAT_LEAVES = frozenset({"tierckpt.errors", "tierckpt._version"})
#: What ``tierckpt.storage`` may import of tierckpt outside ``storage`` and ``format``: torch-free helpers that import
#: nothing of tierckpt but each other.
STORAGE_LEAVES = FORMAT_LEAVES | {"tierckpt.faults", "tierckpt.host.memory", "tierckpt.host.libc"}
#: The engine: what drives tiers, never driven by them (packages include their modules).
ENGINE = ("tierckpt.manager", "tierckpt.engine", "tierckpt.replication", "tierckpt.distributed")
#: What may import the manager's private components (``tierckpt.engine``) besides the engine itself: the package's
#: lazy exports and the public modules that read steps without a manager of their own.
ENGINE_USERS = frozenset({"tierckpt", "tierckpt.manager", "tierckpt.distributed", "tierckpt.export",
                          "tierckpt.readonly", "tierckpt.dcp._reader"})
#: The only private modules at the package's top level: the version and the ``python -m tierckpt`` entry point.
TOP_LEVEL_PRIVATE = frozenset({"tierckpt._version", "tierckpt.__main__"})
#: Packages that never load torch, nor does anything they import.
TORCH_FREE = ("tierckpt.format", "tierckpt.storage", "tierckpt.tiers", "tierckpt.cli")
#: CLI commands that work on tensors (``export`` casts and writes them): the parser imports them only when that
#: command runs (:func:`test_ls_and_verify_run_without_torch` runs the others with torch unimportable).
TORCH_COMMANDS = frozenset({"tierckpt.cli.export"})
#: Modules outside ``tierckpt.cli`` that may import it: the ``python -m tierckpt`` entry point.
CLI_ENTRY_POINTS = frozenset({"tierckpt.__main__"})


@dataclass(frozen=True)
class Import:
    """One import statement of a module, resolved to the names it imports."""

    module: str  # the importing module
    target: str  # a tierckpt module, or the top-level name of another package ("torch", "json")
    line: int
    source: str

    def __str__(self) -> str:
        path = MODULES[self.module].relative_to(REPO_ROOT) if self.module in MODULES else "<source>"
        return f"{self.module} ({path}:{self.line}): `{self.source}` imports {self.target}"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
#: Compiled modules (built or not: the C source stands for the optional build), which import nothing of tierckpt.
EXTENSIONS = frozenset(
    ".".join(p.relative_to(REPO_ROOT).parts[:-1] + (p.name.split(".")[0],))
    for pattern in ("*.c", "*.so", "*.pyd") for p in PACKAGE.rglob(pattern)
)


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement run at some point: anywhere in the tree, but not in an ``if TYPE_CHECKING:`` body
    (its ``else`` branch runs)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules ``node`` (in ``module``) imports: a tierckpt module by its full name (``from pkg import name``
    names ``pkg.name`` when that is a module, else ``pkg``), any other package by its top-level name."""
    if isinstance(node, ast.Import):
        return [a.name if _in(a.name, "tierckpt") else a.name.split(".")[0] for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    if not _in(pkg, "tierckpt"):
        return [pkg.split(".")[0]]
    return [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in known else pkg for a in node.names]


def _imports_of(module: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    lines = source.splitlines()
    out = []
    for node in _runtime_imports(ast.parse(source)):
        text = " ".join(line.strip() for line in lines[node.lineno - 1 : (node.end_lineno or node.lineno)])
        for target in dict.fromkeys(_resolve(module, is_package, node, known)):
            out.append(Import(module, target, node.lineno, text))
    return out


def _graph() -> dict[str, list[Import]]:
    known = set(MODULES) | EXTENSIONS
    return {m: _imports_of(m, p.read_text(), p.name == "__init__.py", known) for m, p in MODULES.items()}


GRAPH = _graph()


def _internal(module: str) -> list[Import]:
    return [i for i in GRAPH[module] if i.target in MODULES and i.target != module]


def _fail(title: str, offenders: list[str]) -> None:
    if offenders:
        pytest.fail(title + ":\n  " + "\n  ".join(offenders), pytrace=False)


# ------------------------------------------------------------------------------------------------- the reader itself
def test_the_import_reader_sees_every_runtime_import() -> None:
    source = textwrap.dedent("""
        from __future__ import annotations
        import json, tierckpt.storage.local
        from . import base
        from ..format import layout, checks as c
        from .. import errors
        from ..storage import Store
        if TYPE_CHECKING:
            from ..manager import CheckpointManager
        else:
            from .. import faults
        def f():
            import torch.cuda
            from ..tiers.reader import read_manifests
    """)
    known = set(MODULES) | EXTENSIONS
    got = [(i.target, i.line) for i in _imports_of("tierckpt.storage.x", source, False, known)]
    assert got == [("__future__", 2), ("json", 3), ("tierckpt.storage.local", 3), ("tierckpt.storage.base", 4),
                   ("tierckpt.format.layout", 5), ("tierckpt.format.checks", 5), ("tierckpt.errors", 6),
                   ("tierckpt.storage", 7), ("tierckpt.faults", 11), ("torch", 13), ("tierckpt.tiers.reader", 14)]
    # and on the real package: a function-level import counts, a TYPE_CHECKING one does not
    assert "tierckpt.manager" in {i.target for i in GRAPH["tierckpt"]}  # the lazy ``__getattr__``
    assert any(i.target == "tierckpt.tiers.reader" for i in GRAPH["tierckpt.tiers.uploader"])
    assert len(MODULES) > 60 and "tierckpt.cli._common" in MODULES and "tierckpt.host._hostcopy" in EXTENSIONS
    assert any(i.target == "tierckpt.host._hostcopy" for i in GRAPH["tierckpt.snapshot.hostcopy"])


# ----------------------------------------------------------------------------------------------------------- cycles
def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for imp in _internal(v):
            w = imp.target
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES)))
    try:
        for m in MODULES:
            if m not in index:
                connect(m)
    finally:
        sys.setrecursionlimit(limit)
    offenders = []
    for comp in components:
        members = set(comp)
        offenders.append("cycle among " + ", ".join(comp))
        offenders += [f"  {i}" for m in comp for i in _internal(m) if i.target in members]
    _fail("import cycles among tierckpt's modules", offenders)


# ----------------------------------------------------------------------------------------------------------- layers
def test_format_imports_only_format_and_leaves() -> None:
    offenders = [str(i) for m in MODULES if _in(m, "tierckpt.format") for i in _internal(m)
                 if not _in(i.target, "tierckpt.format") and i.target not in FORMAT_LEAVES]
    _fail("tierckpt.format imports outside format and " + ", ".join(sorted(FORMAT_LEAVES)), offenders)


def test_storage_imports_only_storage_format_and_leaves() -> None:
    offenders = [str(i) for m in MODULES if _in(m, "tierckpt.storage") for i in _internal(m)
                 if not (_in(i.target, "tierckpt.storage") or _in(i.target, "tierckpt.format"))
                 and i.target not in STORAGE_LEAVES]
    _fail("tierckpt.storage imports outside storage, format and " + ", ".join(sorted(STORAGE_LEAVES)), offenders)


def test_the_allowed_leaves_are_leaves() -> None:
    """The helpers format and storage may use import nothing of tierckpt but each other (format's: nothing)."""
    offenders = [str(i) for m in FORMAT_LEAVES for i in _internal(m)]
    offenders += [str(i) for m in STORAGE_LEAVES for i in _internal(m) if i.target not in STORAGE_LEAVES]
    _fail("a leaf module imports more of tierckpt", offenders)


def test_tiers_never_import_the_engine_or_the_cli() -> None:
    forbidden = (*ENGINE, "tierckpt.cli")
    offenders = [str(i) for m in MODULES if _in(m, "tierckpt.tiers") for i in _internal(m)
                 if any(_in(i.target, f) for f in forbidden)]
    _fail("tierckpt.tiers imports the engine or the CLI", offenders)


def test_only_the_manager_and_its_readers_import_the_engine() -> None:
    offenders = [str(i) for m in MODULES if not _in(m, "tierckpt.engine") and m not in ENGINE_USERS
                 for i in _internal(m) if _in(i.target, "tierckpt.engine")]
    _fail("a module outside the engine and its users imports tierckpt.engine", offenders)


def test_the_top_level_holds_public_modules() -> None:
    """The folder listing shows the architecture: a private module at the top belongs in its layer's folder."""
    loose = [f"{m} ({MODULES[m].relative_to(REPO_ROOT)})" for m in MODULES
             if m.count(".") == 1 and m.split(".")[1].startswith("_") and m not in TOP_LEVEL_PRIVATE]
    loose += [f"{e} (compiled)" for e in EXTENSIONS if e.count(".") == 1]
    _fail("private modules at the package's top level", loose)


def test_only_the_cli_imports_the_cli() -> None:
    offenders = [str(i) for m in MODULES if not _in(m, "tierckpt.cli") and m not in CLI_ENTRY_POINTS
                 for i in _internal(m) if _in(i.target, "tierckpt.cli")]
    _fail("a module outside tierckpt.cli imports the CLI", offenders)


def test_torch_free_layers_never_reach_torch() -> None:
    """No module of :data:`TORCH_FREE`, nor any module they import (transitively), imports torch."""
    reached_by: dict[str, Import | None] = {m: None for m in MODULES
                                            if any(_in(m, p) for p in TORCH_FREE) and m not in TORCH_COMMANDS}
    todo = list(reached_by)
    while todo:
        m = todo.pop()
        for i in _internal(m):
            if i.target not in reached_by and i.target not in TORCH_COMMANDS:
                reached_by[i.target] = i
                todo.append(i.target)
    offenders = []
    for m in sorted(reached_by):
        for i in GRAPH[m]:
            if i.target == "torch":
                chain, via = [], reached_by[m]
                while via is not None:
                    chain.append(str(via))
                    via = reached_by[via.module]
                offenders.append(str(i) + "".join(f"\n    reached through {c}" for c in chain))
    _fail(f"torch imported by {', '.join(TORCH_FREE)} or what they import", offenders)


#: Modules that rebuild objects by running what the bytes name: nothing tierckpt reads (a checkpoint, a message from
#: another rank) ever goes through them.
UNPICKLERS = frozenset({"pickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"})


def _torch_loads(tree: ast.AST) -> list[int]:
    """Lines that call ``torch.load`` without ``weights_only=True`` (torch's restricted loader, which rebuilds
    tensors and plain values only: the one way DCP's byte items are read, :mod:`tierckpt.dcp`)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "load" and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"
            and not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                        for k in n.keywords)]


def test_nothing_is_unpickled() -> None:
    """No module imports an unpickler or calls ``torch.load`` but with ``weights_only=True``: checkpoints are
    safetensors and JSON, and the ranks' agreements are JSON of a fixed set of types
    (:mod:`tierckpt.engine.messages`)."""
    assert _torch_loads(ast.parse("x = torch.load(f)\ny = json.load(f)\nz = torch.load(f, weights_only=False)\n"
                                  "w = torch.load(f, weights_only=True)")) == [1, 3]
    offenders = [str(i) for m in MODULES for i in GRAPH[m] if i.target in UNPICKLERS]
    offenders += [f"{m} ({MODULES[m].relative_to(REPO_ROOT)}:{line}): calls torch.load" for m in MODULES
                  for line in _torch_loads(ast.parse(MODULES[m].read_text()))]
    _fail("tierckpt unpickles", offenders)


def _private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``mgr._x`` / ``self.mgr._x`` / ``manager._x`` attribute uses (line, text) in a module's syntax tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("mgr", "manager"):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_only_the_manager_touches_its_private_state() -> None:
    """Components get what they need from the manager through interfaces it builds (the engine, hooks, public
    methods), never by reaching into ``mgr._anything``."""
    assert _private_reaches(ast.parse("x = mgr._pool\ny = self.mgr._io\nz = mgr.local")) == [
        (1, "mgr._pool"), (2, "self.mgr._io")]
    offenders = [f"{module} ({MODULES[module].relative_to(REPO_ROOT)}:{line}): {text}"
                 for module in sorted(MODULES) if module != "tierckpt.manager"
                 for line, text in _private_reaches(ast.parse(MODULES[module].read_text()))]
    assert not offenders, "private state of the manager used outside manager.py:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------------------------------- the CLI, for real
_NO_TORCH = """
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import of {name} refused (torch-free test)")
        return None


sys.meta_path.insert(0, NoTorch())
from tierckpt.cli import main

root = sys.argv[1]
codes = [main(["ls", root]), main(["verify", root]), main(["ls", root, "--json"])]
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("RESULT", codes, loaded)
"""


def test_ls_and_verify_run_without_torch(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(3, {"w": torch.arange(12, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int64)})
        mgr.wait()
    proc = subprocess.run([sys.executable, "-c", _NO_TORCH, str(root)], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=str(tmp_path), stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT [0, 0, 0] []" in proc.stdout, out
    lines = proc.stdout.splitlines()
    assert any(line.split()[:2] == ["3", "committed"] for line in lines), out  # ls
    assert "step 3: OK" in proc.stdout and "1 of 1 steps intact" in proc.stdout, out  # verify
    doc = json.loads(next(line for line in lines if line.startswith("{")))  # ls --json
    assert doc["ok"] and [s["step"] for s in doc["steps"]] == [3], out


_NO_DTENSOR = textwrap.dedent("""
    import sys
    import torch
    from tierckpt import CheckpointManager
    state = {"w": torch.arange(12, dtype=torch.float32), "opt": {"step": 3}}
    with CheckpointManager(sys.argv[1]) as mgr:
        mgr.save(1, state)
        mgr.wait()
        state["w"].zero_()
        assert mgr.restore(state) == 1 and state["w"][5] == 5
    print("LOADED", sorted(m for m in sys.modules if m.startswith("torch.distributed.tensor")))
""")


def test_a_job_without_dtensors_never_imports_them(tmp_path: Path) -> None:
    """Importing ``torch.distributed.tensor`` costs each rank 0.8 s at start: tierckpt recognises DTensors once the
    job has imported them itself, and a save and a restore of plain tensors never import them."""
    proc = subprocess.run([sys.executable, "-c", _NO_DTENSOR, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, env=subprocess_env(), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout + proc.stderr
