"""What a newcomer meets first: ``tierckpt --version``, ``tierckpt`` alone, ``--help`` texts, and the command tables
of docs/cli.md and the README, checked against the parser: every command with its positional arguments, every
option in the reference, the README's rows the reference's."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tierckpt import cli
from tierckpt._version import __version__
from tierckpt.cli._common import add_common_options

ROOT = Path(__file__).resolve().parents[2]
DOCS = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")

#: A table row's command: ``| `tierckpt CMD ...` |``.
_ROW = re.compile(r"^\| `(tierckpt [^`]+)` \|", re.M)


def _commands() -> dict[str, argparse.ArgumentParser]:
    return cli.commands(cli.build_parser())


def _common_options() -> set[str]:
    p = argparse.ArgumentParser()
    add_common_options(p)
    return {o for a in p._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _positionals(sp: argparse.ArgumentParser) -> list[str]:
    return [str(a.metavar or a.dest).upper() for a in sp._actions if not a.option_strings]


def _options(sp: argparse.ArgumentParser) -> set[str]:
    """The command's long options, less ``--help`` and those every command takes."""
    return {o for a in sp._actions for o in a.option_strings if o.startswith("--")} - {"--help"} - _common_options()


def _table(text: str, where: str) -> dict[str, tuple[str, list[str], set[str]]]:
    """The command table of ``text``: each command's row as (the row's code, its positional forms, its options)."""
    rows: dict[str, tuple[str, list[str], set[str]]] = {}
    for code in _ROW.findall(text):
        words = code.split()
        cmd = words[1]
        positionals = []
        for w in words[2:]:
            if not re.fullmatch(r"[A-Z][A-Z_]*", w):
                break
            positionals.append(w)
        assert cmd not in rows, f"{where}: two rows for {cmd}"
        rows[cmd] = (code, positionals, set(re.findall(r"--[a-z][a-z-]*", code)))
    return rows


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(capsys, "--version")
    assert rc == 0 and out.strip() == f"tierckpt {__version__}" and not err, (out, err)


@pytest.mark.parametrize("argv", [[], ["-v"]])
def test_no_command_lists_the_commands_and_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and not out, out
    assert "usage: tierckpt" in err and "cmd" not in err.replace("COMMAND", ""), err
    for name in _commands():
        line = next((ln for ln in err.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None and len(line.split()) > 1, f"{name} not listed with its help:\n{err}"
    assert "tierckpt COMMAND --help" in err, err


def test_every_argument_has_help_text() -> None:
    parser = cli.build_parser()
    missing = [f"tierckpt {a.dest}" for a in parser._actions if not a.help]
    for name, sp in cli.commands(parser).items():
        missing += [f"tierckpt {name} {'/'.join(a.option_strings) or a.dest}" for a in sp._actions if not a.help]
    assert missing == [], f"no --help text: {missing}"


def test_verify_help_explains_step(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "verify", "--help")
    assert rc == 0
    step = re.search(r"^\s+--step N\s+(\S.*)$", out, re.M)
    assert step is not None and "only" in step.group(1), out


def test_the_reference_table_matches_the_parser() -> None:
    rows = _table(DOCS, "docs/cli.md")
    commands = _commands()
    assert list(rows) == list(commands), "docs/cli.md's table lists other commands than the parser"
    for name, sp in commands.items():
        code, positionals, options = rows[name]
        assert positionals == _positionals(sp), f"docs/cli.md: {code!r}: the parser takes {_positionals(sp)}"
        assert options == _options(sp), (f"docs/cli.md: {code!r}: missing {sorted(_options(sp) - options)}, "
                                         f"unknown {sorted(options - _options(sp))}")
        assert f"**`{name}" in DOCS, f"docs/cli.md describes no {name}"


def test_the_reference_names_every_option_the_parser_has() -> None:
    parser = cli.build_parser()
    everywhere = {o for a in parser._actions for o in a.option_strings}
    for sp in cli.commands(parser).values():
        everywhere |= {o for a in sp._actions for o in a.option_strings if o.startswith("--")}
    everywhere -= {"-h", "--help"}
    missing = sorted(o for o in everywhere if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", DOCS))
    assert missing == [], f"docs/cli.md does not mention {missing}"


def test_the_readme_table_is_the_references() -> None:
    """The README's rows are docs/cli.md's (so the parser's): the same commands, the same positional forms and
    options, in the same words."""
    readme = _table(README.split("## Operators' CLI", 1)[1], "README.md")
    docs = _table(DOCS, "docs/cli.md")
    assert list(readme) == list(_commands()), "README.md's CLI table lists other commands than the parser"
    for name, (code, positionals, _) in readme.items():
        assert positionals == _positionals(_commands()[name]), f"README.md: {code!r}"
        assert code == docs[name][0], f"README.md says {code!r}, docs/cli.md {docs[name][0]!r}"
    for option in sorted(_common_options()):
        assert f"`{option}" in README.split("## Operators' CLI", 1)[1].split("\n## ", 1)[0], option
