"""Keeping the disk busy while a restore parses manifests and plans: the data files it is about to read, asked
for ahead (:class:`Prefetch`).

Invariants: a prefetch only asks the store to start reading (a hint, never data anyone uses): it neither allocates
nor verifies anything, it stops asking at :meth:`Prefetch.stop` or after its byte budget, and a failing or missing
file there only ends the prefetch (the real reads report it).
"""

from __future__ import annotations

import logging
import threading

from ..format import layout
from ..format.manifest import StepManifest
from ..storage.base import Store, join

log = logging.getLogger(__name__)

#: Bytes a restore asks the store to prefetch while it parses manifests and plans. Bounded so that a state much
#: larger than memory does not push out pages it has still to read; a few hundred ms of disk time covers the planning.
PREFETCH_BYTES = 1 << 30
PREFETCH_CHUNK = 8 << 20


class Prefetch:
    """Keeps the disk busy while a restore parses manifests and plans: asks the store to start reading one rank's
    data files, in the order and parallelism the readers will use (``width`` files at a time, a chunk of each in
    turn), up to ``budget`` bytes, until :meth:`stop`. Files are found by name in the step folder (the rank manifest
    is not parsed yet). It runs on its own short-lived thread, so the readers' threads are free the moment they are
    needed; on stores without ``prefetch_reads`` it does nothing.

    Call order: construct (right after ``manifest.json`` is read) → parse and plan → :meth:`stop` → read.
    """

    def __init__(self, store: Store, manifest: StepManifest, rank: int, *, width: int,
                 budget: int | None = None) -> None:
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        budget = PREFETCH_BYTES if budget is None else budget
        if store.prefetch_reads and budget > 0:
            self._thread = threading.Thread(target=self._run, args=(store, manifest, rank, max(1, width), budget),
                                            name="tierckpt-prefetch", daemon=True)
            self._thread.start()

    def _run(self, store: Store, manifest: StepManifest, rank: int, width: int, budget: int) -> None:
        folder = layout.step_dir(manifest.step)
        try:
            for ref in manifest.ranks:  # the rank manifest first: it is read (and parsed) before any data file
                if ref.rank == rank:
                    store.prefetch(join(folder, ref.name), 0, ref.size)
            names = layout.data_files_of(store.list(folder), rank, manifest.save_id)
            for w in range(0, len(names), width):
                rels = [join(folder, n) for n in names[w : w + width]]
                wave = [(rel, store.size(rel)) for rel in rels]
                for offset in range(0, max((size for _, size in wave), default=0), PREFETCH_CHUNK):
                    for rel, size in wave:
                        if self._stopped.is_set() or budget <= 0:
                            return
                        if offset < size:
                            n = min(PREFETCH_CHUNK, size - offset)
                            store.prefetch(rel, offset, n)
                            budget -= n
        except Exception as exc:  # a hint: the real reads report any problem with these files
            log.debug("restore: prefetch of step %d in tier %s stopped: %s", manifest.step, store.tier, exc)

    def stop(self) -> None:
        """No new prefetch requests from now on (those already queued still complete in the background). Does not
        wait: the thread ends after the request it is making, if any."""
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the prefetch thread has made its last request; whether it has (tests, quiet shutdowns)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
