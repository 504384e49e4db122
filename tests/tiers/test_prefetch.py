"""Restore keeps the disk busy while it parses and plans: ``prefetch.Prefetch`` asks the store to start reading this
rank's data files (and its rank manifest first), in the readers' order, within a byte budget, until stopped. It is
only a hint: what it asks for is never used as data, and a failing hint changes nothing."""

from __future__ import annotations

import threading

import torch

import tierckpt
from tests._support.helpers import assert_tree_equal, clone_tree, save_once, zeros_like_tree
from tierckpt.format import layout
from tierckpt.storage.local import LocalStore
from tierckpt.tiers import prefetch, reader


class RecordingStore(LocalStore):
    """A real local store that also records every prefetch request (and can hold the first one)."""

    def __init__(self, root, *, hold: threading.Event | None = None) -> None:
        super().__init__(root, create=False)
        self.calls: list[tuple[str, int, int]] = []
        self.hold = hold
        self.entered = threading.Event()

    def prefetch(self, rel: str, offset: int, length: int) -> None:
        self.calls.append((rel, offset, length))
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(10)
        super().prefetch(rel, offset, length)


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"w": {f"t{i}": torch.randn(300_000 + 1000 * i, generator=g) for i in range(6)}, "n": 3}


def _saved(tmp_path) -> tuple[dict, object]:
    state = _state()
    return state, save_once(tmp_path / "ck", state, 7)


def test_data_files_of_picks_one_rank_and_save():
    names = ["manifest.json", "r00000-abcd1234.manifest.json", "r00000-p0001-abcd1234.safetensors",
             "r00000-p0000-abcd1234.safetensors", "r00001-p0000-abcd1234.safetensors",
             "r00000-p0000-ffff0000.safetensors", ".r00000-p0002-abcd1234.safetensors",
             "r00000-p0003-abcd1234.safetensors.part"]
    assert layout.data_files_of(names, 0, "abcd1234") == ["r00000-p0000-abcd1234.safetensors",
                                                          "r00000-p0001-abcd1234.safetensors"]
    assert layout.data_files_of(names, 1, "abcd1234") == ["r00001-p0000-abcd1234.safetensors"]
    assert layout.data_files_of(names, 2, "abcd1234") == []


def test_prefetch_follows_the_readers_order_within_budget(tmp_path, monkeypatch):
    _, root = _saved(tmp_path)
    store = RecordingStore(root)
    manifest = reader.read_step(store, 7)
    folder = layout.step_dir(7)
    data = layout.data_files_of(store.list(folder), 0, manifest.save_id)
    sizes = {f"{folder}/{n}": store.size(f"{folder}/{n}") for n in data}
    assert len(data) >= 4  # several waves of two files
    monkeypatch.setattr(prefetch, "PREFETCH_CHUNK", 256 << 10)

    pf = prefetch.Prefetch(store, manifest, 0, width=2)
    assert pf.wait(10)
    rank_ref = manifest.ranks[0]
    assert store.calls[0] == (f"{folder}/{rank_ref.name}", 0, rank_ref.size)
    calls = store.calls[1:]
    # every byte of every data file, once, in chunks of at most PREFETCH_CHUNK
    for rel, size in sizes.items():
        mine = [(o, n) for r, o, n in calls if r == rel]
        assert [o for o, _ in mine] == list(range(0, size, 256 << 10))
        assert sum(n for _, n in mine) == size and max(n for _, n in mine) <= 256 << 10
    # in waves of two files: a wave is finished before the next starts, and its files take turns
    order = [r for r, _, _ in calls]
    firsts = sorted(sizes, key=order.index)
    assert firsts == [f"{folder}/{n}" for n in data]
    assert (max(i for i, r in enumerate(order) if r in firsts[:2])
            < min(i for i, r in enumerate(order) if r in firsts[2:4]))
    assert order[:2] == firsts[:2]

    # the budget bounds what is asked for
    store.calls.clear()
    pf = prefetch.Prefetch(store, manifest, 0, width=2, budget=600 << 10)
    assert pf.wait(10)
    asked = sum(n for _, _, n in store.calls[1:])
    assert 600 << 10 <= asked < (600 << 10) + (256 << 10)
    # nothing at all with a zero budget, or for a rank with no files here
    store.calls.clear()
    assert prefetch.Prefetch(store, manifest, 0, width=2, budget=0).wait(10) and store.calls == []
    assert prefetch.Prefetch(store, manifest, 3, width=2).wait(10) and store.calls == []


def test_stop_ends_the_prefetch_after_the_request_in_flight(tmp_path, monkeypatch):
    _, root = _saved(tmp_path)
    hold = threading.Event()
    store = RecordingStore(root, hold=hold)
    manifest = reader.read_step(store, 7)
    monkeypatch.setattr(prefetch, "PREFETCH_CHUNK", 64 << 10)
    pf = prefetch.Prefetch(store, manifest, 0, width=2)
    assert store.entered.wait(10)
    pf.stop()
    assert not pf.wait(0.05)  # still inside its one request
    hold.set()
    assert pf.wait(10)
    assert len(store.calls) == 1


def test_restore_loads_the_same_bytes_when_every_hint_fails(tmp_path, monkeypatch):
    state, root = _saved(tmp_path)
    expected = clone_tree(state)
    calls = []

    def broken(self, rel, offset, length):
        calls.append(rel)
        raise OSError("no readahead here")

    monkeypatch.setattr(LocalStore, "prefetch", broken)
    stop = prefetch.Prefetch.stop
    monkeypatch.setattr(prefetch.Prefetch, "stop", lambda self: (self.wait(10), stop(self)))  # let it fail first
    target = zeros_like_tree(state)
    with tierckpt.CheckpointManager(root, file_size_mb=1, direct_io=False) as mgr:
        assert mgr.restore(target, in_place=True) == 7
    assert_tree_equal(target, expected)
    assert calls  # the hint was asked for, failed, and the restore did not care


def test_only_in_place_restores_that_read_through_the_page_cache_prefetch(tmp_path, monkeypatch):
    """A default restore reads without hints; so does an in-place one from a store that reads around the page cache
    (a prefetch would fill the cache that its direct reads avoid); an in-place one without direct reads prefetches."""
    state, root = _saved(tmp_path)
    calls: list[str] = []
    real = LocalStore.prefetch

    def record(self, rel, offset, length):
        calls.append(rel)
        real(self, rel, offset, length)

    monkeypatch.setattr(LocalStore, "prefetch", record)
    stop = prefetch.Prefetch.stop
    monkeypatch.setattr(prefetch.Prefetch, "stop", lambda self: (self.wait(10), stop(self)))  # let it finish first
    with tierckpt.CheckpointManager(root, file_size_mb=1) as mgr:
        assert mgr.restore(zeros_like_tree(state)) == 7
        assert calls == []  # the default restore reads without hints
        if mgr.local.direct_reads:
            assert mgr.restore(zeros_like_tree(state), in_place=True) == 7
            assert calls == []
    with tierckpt.CheckpointManager(root, file_size_mb=1, direct_io=False) as mgr:
        target = zeros_like_tree(state)
        assert mgr.restore(target, in_place=True) == 7
    assert_tree_equal(target, state)
    data = [c for c in calls if c.endswith(".safetensors")]
    assert calls[0].endswith(".manifest.json") and len(data) >= 4


def test_other_stores_get_no_prefetch_thread(tmp_path):
    _, root = _saved(tmp_path)
    store = LocalStore(root, create=False)
    manifest = reader.read_step(store, 7)
    store.prefetch_reads = False
    before = {t.name for t in threading.enumerate()}
    pf = prefetch.Prefetch(store, manifest, 0, width=2)
    assert pf._thread is None and pf.wait(0)
    assert {t.name for t in threading.enumerate()} - before == set()
