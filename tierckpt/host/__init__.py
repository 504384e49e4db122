"""Host-side helpers with no torch: the C library functions ``os`` lacks (:mod:`.libc`), large I/O buffers on
anonymous and transparent huge pages (:mod:`.memory`), pausing the cyclic garbage collector around bursts of
allocation (:mod:`.gcpause`), and the optional native streaming copy (``_hostcopy.c``, used through
:mod:`tierckpt.snapshot.hostcopy`). Storage, tiers and snapshot share them; they import nothing else of tierckpt.
"""
