"""The messages ranks hand each other through the job's c10d store (:mod:`.distributed`), as JSON.

A message is data. JSON's own values (None, booleans, numbers, strings, lists) stand for themselves; every other
value is a JSON object of one key, its tag:

- ``{"tuple": [...]}``, ``{"set": [...]}``, and ``{"dict": [[key, value], ...]}`` (keys of any encodable kind);
- ``{"error": [class, message, step, tier, path, transient]}``, a :class:`~tierckpt.errors.StorageError` of one of
  the classes in :data:`ERRORS` (a tier listing carries the error of each tier it could not list);
- ``{"<Class>": [[field, value], ...]}``, a frozen dataclass of the types a :class:`Codec` is built with (a step
  manifest and its rank references, a tier listing, a failed agreement).

Nothing is unpickled, and no name in a message is looked up anywhere but in those fixed tables: a value that
another program wrote into the store can make an agreement fail (:class:`MessageError`), never run code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from ..errors import (
    StorageAccessError,
    StorageError,
    StorageTimeoutError,
    StorageUnavailableError,
    UploadError,
)

#: The error classes a message may carry, by name.
ERRORS: dict[str, type[StorageError]] = {
    cls.__name__: cls
    for cls in (StorageError, StorageAccessError, StorageUnavailableError, StorageTimeoutError, UploadError)
}
_NATIVE = (bool, int, float, str)


class MessageError(ValueError):
    """A message that this module did not write: not JSON, an unknown tag, or a value of the wrong shape."""


class Codec:
    """Encodes and decodes messages whose dataclasses are among ``types`` (frozen dataclasses, rebuilt from their
    fields by keyword, so their own checks run)."""

    def __init__(self, types: Iterable[type]) -> None:
        self._types: dict[str, type] = {}
        for cls in types:
            if not dataclasses.is_dataclass(cls) or cls.__name__ in self._types or cls.__name__ in _TAGS:
                raise TypeError(f"{cls!r} cannot be a message type: a dataclass, named once, not a tag")
            self._types[cls.__name__] = cls

    def encode(self, obj: Any) -> bytes:
        """``obj`` as the bytes of one message. Raises TypeError for a value no message carries."""
        return json.dumps(self._to(obj), separators=(",", ":")).encode()

    def decode(self, raw: bytes) -> Any:
        """The value :meth:`encode` made ``raw`` of. Raises :class:`MessageError` for anything else."""
        try:
            return self._from(json.loads(raw))
        except MessageError:
            raise
        except (ValueError, TypeError, RecursionError) as exc:  # not JSON; an unhashable key; a rejected field
            raise MessageError(f"not a coordination message: {type(exc).__name__}: {exc}") from None

    # ------------------------------------------------------------------------------------------------ encoding
    def _to(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, _NATIVE):  # bool, int and str subclasses (enums) as JSON writes them
            return obj
        if ERRORS.get(type(obj).__name__) is type(obj):
            return {"error": [type(obj).__name__, obj.detail, obj.step, obj.tier, obj.path, obj.transient]}
        if self._types.get(type(obj).__name__) is type(obj):
            fields = [f.name for f in dataclasses.fields(obj) if f.init]
            return {type(obj).__name__: [[name, self._to(getattr(obj, name))] for name in fields]}
        if isinstance(obj, list):
            return [self._to(x) for x in obj]
        if isinstance(obj, tuple):
            return {"tuple": [self._to(x) for x in obj]}
        if isinstance(obj, (set, frozenset)):
            return {"set": [self._to(x) for x in obj]}
        if isinstance(obj, dict):
            return {"dict": [[self._to(k), self._to(v)] for k, v in obj.items()]}
        raise TypeError(f"a coordination message cannot carry a {type(obj).__qualname__}")

    # ------------------------------------------------------------------------------------------------ decoding
    def _from(self, v: Any) -> Any:
        if v is None or type(v) in _NATIVE:
            return v
        if type(v) is list:
            return [self._from(x) for x in v]
        if type(v) is not dict or len(v) != 1:
            raise MessageError("a tagged value is an object of one key")
        ((tag, body),) = v.items()
        if tag == "tuple":
            return tuple(self._from(x) for x in _array(body, tag))
        if tag == "set":
            return {self._from(x) for x in _array(body, tag)}
        if tag == "dict":
            return {self._from(k): self._from(x) for k, x in _pairs(body, tag)}
        if tag == "error":
            return _error(_array(body, tag))
        cls = self._types.get(tag)
        if cls is None:
            raise MessageError(f"unknown tag {tag[:64]!r}")
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {}
        for name, x in _pairs(body, tag):
            if type(name) is not str or name not in names or name in kwargs:
                raise MessageError(f"{tag}: unexpected field {str(name)[:64]!r}")
            kwargs[name] = self._from(x)
        return cls(**kwargs)


_TAGS = frozenset({"tuple", "set", "dict", "error"})


def _array(body: Any, tag: str) -> list[Any]:
    if type(body) is not list:
        raise MessageError(f"{tag}: not an array")
    return body


def _pairs(body: Any, tag: str) -> list[list[Any]]:
    pairs = _array(body, tag)
    if not all(type(p) is list and len(p) == 2 for p in pairs):
        raise MessageError(f"{tag}: not an array of pairs")
    return pairs


def _error(fields: list[Any]) -> StorageError:
    if len(fields) != 6:
        raise MessageError("error: six fields expected")
    name, message, step, tier, path, transient = fields
    cls = ERRORS.get(name) if type(name) is str else None
    ok = (cls is not None and type(message) is str and (step is None or type(step) is int)
          and all(x is None or type(x) is str for x in (tier, path)) and (transient is None or type(transient) is bool))
    if not ok:
        raise MessageError("error: malformed")
    assert cls is not None
    return cls(message, step=step, tier=tier, path=path, transient=transient)
