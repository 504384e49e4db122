"""Fixtures of the tier tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.tiers import memory


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A shared-memory folder of this test's own for the memory tier (tmpfs where /dev/shm is one)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = Path(tempfile.mkdtemp(prefix="tckpt-test-", dir=base))
    monkeypatch.setenv(memory.ROOT_ENV, str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
