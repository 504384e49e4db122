"""A griffe extension that reads tierckpt's docstrings as the API reference renders them.

Two conventions of the code base that Google-style parsing does not know:

- one entry documenting several parameters, ``keep_local / keep_remote / keep_every: retention ...`` (names joined
  by `` / `` or ``, ``, possibly wrapped over lines): split into one entry per name, each with the description;
- Sphinx roles (``:class:`~tierckpt.CheckpointManager```, ``:meth:`restore```): shown as code, ``~`` keeping the
  last component only, as Sphinx shows it;
- ``#:`` comments right above a module or class attribute (the code base's attribute docs): the attribute's
  docstring;
- parameters whose default is ``Options.<name>`` (the manager's keywords, whose defaults live in
  :mod:`tierckpt.options`): shown with the value, ``2`` rather than ``Options.keep_local``.

Registered in ``mkdocs.yml`` under the python handler's ``extensions``.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|mod|attr|exc|data|obj|py:\w+):`(~?)([^`]+)`")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Keyword Args|Other Parameters):\s*$")
_NAME = r"\**[A-Za-z_][A-Za-z0-9_]*"
_NAMES = re.compile(rf"^(?P<names>{_NAME}(?:\s*(?:/|,)\s*{_NAME})+)\s*:(?P<rest>.*)$")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def split_multi_names(text: str) -> str:
    """``text`` with every ``a / b: description`` entry of an arguments or attributes section written as one
    entry per name, each with the whole description."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        head = _SECTION.match(line)
        i += 1
        if not head:
            continue
        indent = None
        while i < len(lines):
            line = lines[i]
            if line.strip() and len(line) - len(line.lstrip()) <= len(head.group(1)):
                break  # the section ended
            if not line.strip():
                out.append(line)
                i += 1
                continue
            own = len(line) - len(line.lstrip())
            if indent is None:
                indent = own
            if own != indent:  # a continuation line of the previous entry
                out.append(line)
                i += 1
                continue
            entry = line.strip()
            j = i + 1
            while entry.endswith(("/", ",")) and ":" not in entry and j < len(lines):  # names wrapped over lines
                entry = f"{entry} {lines[j].strip()}"
                j += 1
            body = []
            while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
                body.append(lines[j])
                j += 1
            m = _NAMES.match(entry)
            if m is None:
                out.append(line)
                out.extend(lines[i + 1 : j])
            else:
                for name in re.split(r"\s*[/,]\s*", m.group("names")):
                    out.append(" " * indent + f"{name}:{m.group('rest')}")
                    out.extend(body)
            i = j
    return "\n".join(out)


_BINOPS = {ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.Mult: operator.mul, ast.Add: operator.add,
           ast.Sub: operator.sub, ast.FloorDiv: operator.floordiv}


def _value(expr: str, scope: griffe.Object, depth: int = 0) -> Any:
    """The value of the constant expression ``expr`` written in ``scope`` (literals, integer arithmetic, and
    names of module constants, looked up through griffe); raises ``ValueError`` for anything else."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Name) and depth < 4:
            target = scope.module[node.id]
            if target.is_alias:
                target = target.final_target
            if not target.is_attribute or target.value is None:
                raise ValueError(node.id)
            return _value(str(target.value), target, depth + 1)
        raise ValueError(ast.dump(node))

    return ev(ast.parse(expr, mode="eval").body)


def comment_doc(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above attribute ``obj``, as text; None when there are none."""
    if obj.lineno is None or obj.filepath is None or isinstance(obj.filepath, list):
        return None
    lines = obj.lines_collection[obj.filepath]
    found: list[str] = []
    i = obj.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        found.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(found) or None


class TierckptDocstrings(griffe.Extension):
    """Rewrites docstrings and defaults as described in the module docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            text = comment_doc(obj)
            if text:
                obj.docstring = griffe.Docstring(_ROLE.sub(_role, text), lineno=obj.lineno, parent=obj)
            return
        if obj.docstring is None:
            return
        obj.docstring.value = split_multi_names(_ROLE.sub(_role, obj.docstring.value))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "tierckpt":
            return
        options = pkg["options.Options"]
        for attr in options.members.values():  # the dataclass's fields, as values
            if attr.is_attribute and attr.value is not None:
                try:
                    attr.value = repr(_value(str(attr.value), attr))
                except (ValueError, KeyError, griffe.AliasResolutionError):
                    pass
        for path in ("manager.CheckpointManager.__init__",):
            func = pkg[path]
            for param in func.parameters:
                default = str(param.default) if param.default is not None else ""
                if default.startswith("Options.") and default[8:] in options.members:
                    attr = options.members[default[8:]]
                    try:
                        param.default = repr(_value(str(attr.value), attr))
                    except (ValueError, KeyError, griffe.AliasResolutionError):
                        param.default = str(attr.value)
