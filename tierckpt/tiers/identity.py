"""Which run a tier's root belongs to: ``run.json``, written once, exclusively, so that two jobs pointed at one
remote never mix or replace each other's checkpoints.

A *run* is the sequence of checkpoints that restarts continue. Its identity is created with the first manager on an
empty local folder and recorded in that folder's ``run.json``; the remote root records the identity of the first
run that uploaded to it, created atomically (:meth:`~tierckpt.storage.base.Store.create_exclusive`: a hard link on
POSIX, a conditional PUT on S3), so of two jobs racing for an empty root exactly one wins.

Before its first upload a manager checks the remote (:func:`check_remote`):

- the remote holds no identity and no committed step: this run claims it;
- the remote holds this run's identity: uploads go on;
- the remote holds another run's identity, or committed steps of a run with none recorded (an older tierckpt), and
  this run's local tier holds no save of the remote's steps (the same save id: its steps were pulled from there,
  or uploaded from here by an older tierckpt): :class:`~tierckpt.errors.RunConflictError` and nothing is uploaded,
  unless the job continues that run on purpose: it restored from that remote (the manager then adopts the
  remote's identity) or was given ``continue_remote_run=True``. A local tier that shares a save with the remote
  adopts the remote's identity.

Nothing here imports torch; a root's ``run.json`` is at most :data:`MAX_RUN_BYTES` and is parsed as plain JSON.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CorruptCheckpointError, RunConflictError
from ..format import layout
from ..storage.base import Store
from .listing import list_root

log = logging.getLogger(__name__)

#: the largest ``run.json`` read (a real one is about 150 bytes)
MAX_RUN_BYTES = 4096
_FORMAT = 1


@dataclass(frozen=True)
class RunIdentity:
    """A run's identity: a random id, when it was created (seconds since the epoch) and on which host."""

    run_id: str
    created: float
    host: str

    @classmethod
    def new(cls) -> RunIdentity:
        return cls(secrets.token_hex(8), time.time(), socket.gethostname()[:255])

    def to_bytes(self) -> bytes:
        return json.dumps({"format": _FORMAT, "run_id": self.run_id, "created": self.created,
                           "host": self.host}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, *, path: str) -> RunIdentity:
        """Parse a ``run.json``. Raises :class:`CorruptCheckpointError` naming ``path`` for anything else."""
        try:
            doc = json.loads(raw)
            ok = (isinstance(doc, dict) and doc.get("format") == _FORMAT and isinstance(doc.get("run_id"), str)
                  and 0 < len(doc["run_id"]) <= 64 and isinstance(doc.get("created"), (int, float))
                  and isinstance(doc.get("host"), str) and len(doc["host"]) <= 255)
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise CorruptCheckpointError(f"{layout.RUN_FILE} is not a run identity", path=path)
        return cls(doc["run_id"], float(doc["created"]), doc["host"])

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created))
        return f"run {self.run_id} (created {when} on {self.host})"


def read(store: Store) -> RunIdentity | None:
    """The identity ``store``'s root records, or None. Raises what the store raises, and
    :class:`CorruptCheckpointError` for a damaged ``run.json``."""
    try:
        raw = store.read_bytes(layout.RUN_FILE, max_size=MAX_RUN_BYTES)
    except FileNotFoundError:
        return None
    return RunIdentity.from_bytes(raw, path=f"{store.url}/{layout.RUN_FILE}")


def claim(store: Store, mine: RunIdentity) -> RunIdentity:
    """Record ``mine`` in ``store``'s root unless an identity is there already; returns the one the root holds
    afterwards (``mine``, or the earlier run's that won)."""
    if store.create_exclusive(layout.RUN_FILE, mine.to_bytes()):
        log.info("tier %s: %s now records %s", store.tier, store.url, mine.describe())
        return mine
    theirs = read(store)
    if theirs is None:  # removed between the two calls: try once more
        return claim(store, mine)
    return theirs


def local_identity(store: Store) -> RunIdentity:
    """The local tier's run identity, created (exclusively) when its root records none: a new run."""
    found = read(store)
    return found if found is not None else claim(store, RunIdentity.new())


def adopt(store: Store, theirs: RunIdentity) -> None:
    """Record ``theirs`` in the local tier's root (replacing its own): this job continues that run."""
    store.put_atomic(layout.RUN_FILE, theirs.to_bytes())
    log.warning("tier %s: %s continues %s", store.tier, store.url, theirs.describe())


def check_remote(remote: Store, mine: RunIdentity, *, local_url: str, adopt_theirs: bool,
                 shares_saves: Callable[[set[int]], bool]) -> RunIdentity:
    """Check, before the first upload, that ``remote`` belongs to run ``mine`` (see the module docstring), claiming
    an empty root. ``shares_saves(steps)``: whether the local tier holds a save of one of ``steps`` (the remote's
    committed steps) with the same save id: a root with steps but no identity then belongs to this run.
    ``adopt_theirs``: continue the remote's run on purpose. Returns the identity to go on with (``mine``, or the
    remote's when adopted).

    Raises:
        RunConflictError: the remote belongs to another run (naming both, and how to go on).
        StorageError / CorruptCheckpointError: the remote could not be read."""
    theirs = read(remote)
    if theirs is None:
        steps = set(list_root(remote).steps)
        if steps and not adopt_theirs and not shares_saves(steps):
            raise RunConflictError(
                f"the remote holds steps {_some(steps)} of a run that recorded no identity, and this job's local "
                f"folder {local_url} ({mine.describe()}) holds none of their saves: nothing is uploaded, so none "
                f"of them is replaced. {_HOW}", tier=remote.tier, path=remote.url)
        theirs = claim(remote, mine)
    if theirs.run_id == mine.run_id:
        return mine
    if adopt_theirs or shares_saves(set(list_root(remote).steps)):
        return theirs  # on purpose, or the local tier holds the remote's saves (`tierckpt pull`): the same run
    raise RunConflictError(
        f"the remote belongs to another {theirs.describe()}; this job's local folder {local_url} belongs to "
        f"{mine.describe()}: nothing is uploaded, so none of the other run's checkpoints is replaced, and this "
        f"job's steps stay in its local folder. {_HOW}", tier=remote.tier, path=remote.url)


_HOW = ("To continue that run on purpose, restore from it first (restore() adopts the run of a step it reads "
        "from the remote) or pass continue_remote_run=True; to keep both runs, give this job another remote URL.")


def _some(steps: set[int], shown: int = 6) -> str:
    s = sorted(steps)
    return ", ".join(map(str, s[:shown])) + (f" ... {s[-1]}" if len(s) > shown else "")

