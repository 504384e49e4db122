"""Snapshot: all tensor work, from a live state to host bytes and back. With the manager's orchestration
(``manager``, ``engine``, ``distributed``) the only code that imports torch; ``format``, ``storage``
and ``tiers`` never do.

- :mod:`.tree`: a state mapping -> a type-tagged JSON tree plus its tensor leaves (``flatten``, memoised across saves).
- :mod:`.capture`: what a lazy ``save()`` takes at once; the snapshot thread flattens and copies the rest.
- :mod:`.staging`: the reusable host staging slots (pinned under CUDA), the copy's per-file watermarks, fault-in.
- :mod:`.copier`: the copy of a flattened state into a staging slot (a CUDA copy stream, or host copies).
- :mod:`.hostcopy`: host-to-host copies with streaming stores over threads, through the optional C extension.
- :mod:`.decode`: a saved tree decoded into plain values (``load()``, and the values a restore hands over).
- :mod:`.load`: the plan that loads a tree into the live state in place, checked before anything changes.
- :mod:`.loadbatch`: a restore plan's checks for a whole dict of plain tensors at once.
- :mod:`.loaded`: a restore's loaded bytes as typed tensor views, address ranges and byte views of live tensors.
- :mod:`.modules`: whether an ``nn.Module`` tree saves and loads like ``nn.Module`` itself (work may be skipped).
- :mod:`.dtensor`: DTensor shards, their place in the global tensor, and resharding on restore.
- :mod:`.dtypes`: torch and numpy element types <-> safetensors dtype codes.
"""
