"""The old bytes of the caller's tensors, kept while a guarded restore reads the new ones straight into them.

A default restore promises that a restore which fails leaves the state as it was. Reading every byte into a staging
buffer, verifying it, then copying it into the tensors keeps that promise at the price of a second, state-sized copy
after the last read (on the benchmark VM about 90 ms for 2 GiB, one eighth of a cold read). A guarded restore keeps
it the other way round: the reads go straight into the tensors, as with ``in_place=True``, and each range of a tensor
is first copied, just before it is overwritten, into the staging buffer at that range's place in its file (a place a
direct read leaves unused). If the restore then fails (a checksum, a short file, a cancelled read, a rank that
cannot load, an interrupt), :meth:`UndoLog.rollback` copies the old bytes back once no read is running any more.

Invariants:
- a range is saved, and only then logged, before anything writes it; so the first entry that covers a byte holds
  its original value (every write to that byte comes after its own entry, and entries are logged in order), and
  rolling back in reverse order ends with that value even where tensors alias each other;
- the copy back runs only when no read or hashing task touches the tensors or the buffer any more
  (:class:`~tierckpt.tiers.reader.PendingLoad` guarantees that when ``result`` or ``cancel`` returns);
- a range never logged is never written back: a tensor the reads did not reach keeps its bytes untouched.
"""

from __future__ import annotations

import ctypes
import logging

from ..host.memory import buffer_address

log = logging.getLogger(__name__)


class UndoLog:
    """Saved ranges of live memory: ``(address, saved_at, size)``, in the order they were saved.

    Call order: :meth:`save` or :meth:`keep` (from the reading and hashing threads, each before it writes the
    range) → once every read has ended, exactly one of :meth:`rollback` (failure) or :meth:`discard` (success)."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, int, int]] = []

    @property
    def saved_bytes(self) -> int:
        return sum(size for _, _, size in self._entries)

    def save(self, address: int, saved_at: int, size: int) -> None:
        """Copy ``size`` bytes at ``address`` to ``saved_at`` and log them (the copy releases the GIL)."""
        ctypes.memmove(saved_at, address, size)
        self._entries.append((address, saved_at, size))  # list.append is atomic: threads may log together

    @staticmethod
    def place(part: memoryview, pos: int, buffer: memoryview) -> int | None:
        """Where the old bytes of ``part``, about to receive the file's bytes from ``pos`` on, are saved: their
        file position in ``buffer`` (the file's range of the staging buffer); None for a part that lies in
        ``buffer`` itself (the buffer's own: headers, small tensors), which holds nothing of the state."""
        base = buffer_address(buffer)
        address = buffer_address(part)
        if base is None or (address is None and part.nbytes):
            raise ValueError("a guarded restore reads into writable memory only")
        if address is None or base <= address < base + buffer.nbytes:
            return None
        if pos + part.nbytes > buffer.nbytes:
            raise ValueError(f"a saved range [{pos}, {pos + part.nbytes}) runs past the file's {buffer.nbytes} bytes")
        return base + pos

    def keep(self, parts: list[memoryview], pos: int, buffer: memoryview) -> None:
        """Save the live parts of a vectored read of the file from ``pos`` on (see :meth:`place`)."""
        for part in parts:
            at = self.place(part, pos, buffer)
            if at is not None:
                address = buffer_address(part)
                assert address is not None
                self.save(address, at, part.nbytes)
            pos += part.nbytes

    def rollback(self) -> int:
        """Copy every saved range back, newest first; returns the bytes written back. Once."""
        entries, self._entries = self._entries, []
        for address, saved_at, size in reversed(entries):
            ctypes.memmove(address, saved_at, size)
        restored = sum(size for _, _, size in entries)
        if restored:
            log.info("restore: put back %d bytes of the state's tensors after a failed restore", restored)
        return restored

    def discard(self) -> None:
        """The restore succeeded: forget the saved ranges (the buffer holding them goes back to its pool)."""
        self._entries = []
