"""Shared helpers of the tests of a failing remote tier: a switch that makes every remote store a manager opens
refuse its writes (for the Hypothesis state machines), and a bounded wait for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import tierckpt.manager as manager_mod
from tierckpt.storage.faulty import FaultyStore

#: every operation that writes or deletes on the remote (reads and listings keep working while it is "down")
WRITE_OPS = ("makedirs", "open_write", "write_bytes", "write", "close", "remove", "replace_dir", "sync_dir")


def _denied(op: str, n: int) -> BaseException:
    return PermissionError(13, f"injected: remote refuses {op} #{n}")


class RemoteSwitch:
    """The outage of one example: every remote store a manager opens is wrapped in a :class:`FaultyStore`, and
    refuses every write (a permanent ``PermissionError``, no in-upload retries) while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.stores: list[FaultyStore] = []

    def _plan(self) -> dict:
        return {op: "all" for op in WRITE_OPS} if self.down else {}

    def set(self, down: bool) -> None:
        self.down = down
        for s in self.stores:
            s.plan.fail = self._plan()  # FaultPlan.hit reads it under its lock; "all" fails every call

    def wrap(self, store):  # noqa: ANN001, ANN201
        faulty = FaultyStore(store, fail=self._plan(), error_factory=_denied)
        self.stores.append(faulty)
        return faulty


def wrap_remote_stores(monkeypatch: pytest.MonkeyPatch, current: list[RemoteSwitch]) -> None:
    """Make every manager wrap its remote store with ``current[0]`` (the running example's switch), from its
    construction on, so that a restarted manager's resumed uploads see the same outage."""
    real_open_store = manager_mod.open_store

    def open_store(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        store = real_open_store(*args, **kwargs)
        return current[0].wrap(store) if kwargs.get("tier") == "remote" and current else store

    monkeypatch.setattr(manager_mod, "open_store", open_store)


def wait_for(cond: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll ``cond`` until it is true; fails the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)
