"""MkDocs hook: links from the docs to the repository's examples work on the site.

The pages link example scripts as repository files (``[examples/slurm.sbatch](../examples/slurm.sbatch)``), which
reads right on a code host. The site publishes every file of ``examples/`` at the same path (``examples/...``) and
rewrites such links to it. A link that leaves the docs folder for anything else is a warning (an error under
``mkdocs build --strict``), as a link to a missing page is.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.repo_links")

#: repository folders published on the site as they are
PUBLISHED = ("examples",)
_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _repo(config: Any) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files: Files, *, config: Any) -> Files:
    repo = _repo(config)
    for folder in PUBLISHED:
        for path in sorted((repo / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                rel = path.relative_to(repo).as_posix()
                files.append(File.generated(config, rel, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Files) -> str:
    repo = _repo(config)
    docs = Path(config.docs_dir).resolve()
    page_dir = posixpath.dirname(page.file.src_uri)

    def fix(m: re.Match[str]) -> str:
        target = m.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return m.group(0)
        resolved = (docs / page_dir / target).resolve()
        if resolved.is_relative_to(docs):
            return m.group(0)  # a page or file of the site: MkDocs checks it
        rel = resolved.relative_to(repo).as_posix() if resolved.is_relative_to(repo) else None
        if rel is None or not rel.startswith(tuple(f"{f}/" for f in PUBLISHED)) or not resolved.is_file():
            log.warning("Doc file '%s' links '%s', outside the docs folder and not a file of %s",
                        page.file.src_uri, target, ", ".join(f"{f}/" for f in PUBLISHED))
            return m.group(0)
        return f"{m.group(1)}{posixpath.relpath(rel, page_dir or '.')}{m.group(3)}"

    return _LINK.sub(fix, markdown)
