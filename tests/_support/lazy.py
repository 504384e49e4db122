"""Names from heavy frameworks (Lightning, transformers), imported on first use rather than when a test file is
collected.

Every pytest-xdist worker collects every test file, so a framework imported at a file's top is imported by every
worker (Lightning with torchmetrics costs about 4 s of CPU), while only the worker that runs the file uses it. A test
file names what it needs with :func:`lazy` and marks itself with :func:`requires`; a class that derives from a
framework's class is written without that base and built with it by :func:`subclass` where a test uses it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import pytest


def requires(*modules: str) -> pytest.MarkDecorator:
    """A mark that skips the file's tests when one of ``modules`` is not installed (as ``pytest.importorskip``
    would, without importing it)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


class lazy:  # noqa: N801 - used like the module or class it stands for
    """``lazy("lightning.pytorch")`` stands for the module, ``lazy("lightning.pytorch.callbacks",
    "ModelCheckpoint")`` for one of its attributes: imported on the first attribute access or call."""

    def __init__(self, module: str, attr: str | None = None) -> None:
        self._module, self._attr = module, attr
        self._target: Any = None

    def resolve(self) -> Any:
        if self._target is None:
            target = importlib.import_module(self._module)
            self._target = target if self._attr is None else getattr(target, self._attr)
        return self._target

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


@functools.cache
def subclass(methods: type, module: str, base: str) -> type:
    """``methods`` (a plain class) on top of the class ``base`` of ``module``, named as ``methods``: built once,
    on first use. ``super()`` in ``methods`` reaches ``base``."""
    return type(methods.__name__, (methods, getattr(importlib.import_module(module), base)), {})
