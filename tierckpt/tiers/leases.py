"""Leases: a running job's pins of remote steps, visible to every other process that may delete them.

An incremental step's upload references earlier steps of the remote (their stored bytes). Inside the uploading
process those steps are pinned in memory (:func:`.incremental.pins`); a ``tierckpt prune`` or another job's
retention runs elsewhere and cannot see that. So while a process pins steps of a tier other than its own local one,
it keeps a small *lease* object at the tier's root, ``pins-<holder>.json``, listing the pinned steps and when the
lease expires. It is written before the pinning process checks that those steps are still committed, rewritten when
the pinned steps change, refreshed every :data:`REFRESH_S` seconds (moving its expiry :data:`TTL_S` seconds ahead),
and removed once nothing is pinned. A deletion in any process (:func:`.steps.delete_steps`) keeps every step a fresh
lease lists. A process killed while it holds a lease leaves the object behind: it pins nothing once expired, and
``tierckpt prune --leftovers`` removes it.

Clocks: the expiry is the writer's wall-clock time; a reader takes a lease for fresh while its own clock is before
the expiry. Clocks that disagree by more than ``TTL_S - REFRESH_S`` (9 minutes) can make a live lease look expired.

Failures: a lease that cannot be written is logged (WARNING) and the upload goes on: the upload itself needs the
same remote, and its commit fails if a referenced step went meanwhile (see :func:`.steps.delete_steps`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..storage.base import Store

log = logging.getLogger(__name__)

#: a lease object's name at the tier's root: ``pins-<holder>.json``
PREFIX = "pins-"
SUFFIX = ".json"
#: seconds a lease stays fresh after it was last written
TTL_S = 600.0
#: seconds between refreshes of a held lease
REFRESH_S = 60.0
#: the largest lease object read (a lease lists a few step numbers)
MAX_LEASE_BYTES = 1 << 16

_HOLDER = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def is_lease(name: str) -> bool:
    """Whether ``name`` (an entry of a tier's root) is a lease object."""
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


@dataclass(frozen=True)
class Lease:
    """A lease as read: its object name, the steps it pins, its expiry (epoch seconds) and its holder."""

    name: str
    steps: tuple[int, ...]
    expires: float
    holder: str

    def fresh(self, now: float | None = None) -> bool:
        """Whether it still pins its steps at ``now`` (default: this host's clock)."""
        return (time.time() if now is None else now) < self.expires

    def describe(self) -> str:
        left = self.expires - time.time()
        return f"{self.name} (held by {self.holder}, " + (f"expires in {left:.0f} s)" if left > 0 else "expired)")


def encode(steps: tuple[int, ...], expires: float, holder: str = _HOLDER) -> bytes:
    """A lease object's bytes."""
    return json.dumps({"steps": list(steps), "expires": expires, "holder": holder}, sort_keys=True).encode()


def read(store: Store, name: str) -> Lease | None:
    """The lease ``name`` of ``store`` (None when it is gone). An unreadable or malformed lease raises ValueError
    (what it may pin is unknown). Raises what the store raises."""
    try:
        raw = store.read_bytes(name, max_size=MAX_LEASE_BYTES)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
        steps = tuple(int(s) for s in doc["steps"])
        return Lease(name, steps, float(doc["expires"]), str(doc.get("holder", "?")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"lease {store.url}/{name} is malformed: {exc}") from None


def pinned_by(store: Store, names: list[str], now: float | None = None) -> dict[int, Lease]:
    """The steps that the fresh leases among ``names`` (a listing of ``store``'s root) pin, each with one lease
    pinning it. A lease that cannot be parsed pins nothing (logged: no writer produces one). Raises what the store
    raises."""
    out: dict[int, Lease] = {}
    for name in names:
        if not is_lease(name):
            continue
        try:
            lease = read(store, name)
        except ValueError as exc:
            log.warning("tier %s: %s; it pins nothing", store.tier, exc)
            continue
        if lease is not None and lease.fresh(now):
            for s in lease.steps:
                out.setdefault(s, lease)
    return out


class _Held:
    """This process's lease on one store: how often each step is pinned, and the lock ordering its writes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.name = f"{PREFIX}{_HOLDER}{SUFFIX}"
        self.counts: Counter[int] = Counter()
        self.lock = threading.Lock()  # orders this lease's writes (held across one request of this lease only)
        self.written: tuple[int, ...] = ()
        self.written_at = 0.0  # time.monotonic() of the last write

    def sync(self, refresh: bool = False) -> None:
        """Write the lease as the counts stand (remove it when nothing is pinned). Logged, never raised."""
        with self.lock:
            with _GUARD:
                steps = tuple(sorted(s for s, n in self.counts.items() if n > 0))
            if steps == self.written and not refresh:
                return
            try:
                if steps:
                    self.store.put_atomic(self.name, encode(steps, time.time() + TTL_S))
                else:
                    self.store.remove(self.name)
                self.written, self.written_at = steps, time.monotonic()
            except Exception as exc:
                log.warning("tier %s: cannot write the lease %s/%s pinning steps %s: %s; another process's prune "
                            "may not see them", self.store.tier, self.store.url, self.name, list(steps), exc)


_GUARD = threading.Lock()  # guards _HELD and the counts (never held across a request)
#: by store URL (one entry per remote this process ever pinned steps of, kept: its lock orders the lease's writes)
_HELD: dict[str, _Held] = {}
_refresher: threading.Thread | None = None


def hold(store: Store, steps: tuple[int, ...]) -> None:
    """Pin ``steps`` of ``store`` in this process's lease there (written before this returns)."""
    global _refresher
    if not steps:
        return
    with _GUARD:
        held = _HELD.setdefault(store.url, _Held(store))
        for s in steps:
            held.counts[s] += 1
        if _refresher is None or not _refresher.is_alive():
            _refresher = threading.Thread(target=_refresh, name="tierckpt-leases", daemon=True)
            _refresher.start()
    held.sync()


def release(store: Store, steps: tuple[int, ...]) -> None:
    """Unpin ``steps`` of ``store`` (see :func:`hold`); the lease is rewritten, or removed once it pins nothing."""
    if not steps:
        return
    with _GUARD:
        held = _HELD.get(store.url)
        if held is None:
            return
        for s in steps:
            held.counts[s] -= 1
            if held.counts[s] <= 0:
                del held.counts[s]
    held.sync()


def _refresh() -> None:
    """The refresher thread: rewrite each held lease once it was written :data:`REFRESH_S` seconds ago (looking
    at most every second); ends once none is held."""
    global _refresher
    while True:
        time.sleep(min(REFRESH_S, 1.0))
        with _GUARD:
            current = [held for held in _HELD.values() if held.counts or held.written]
            if not current:
                _refresher = None
                return
        for held in current:
            if time.monotonic() - held.written_at >= REFRESH_S:
                held.sync(refresh=True)
