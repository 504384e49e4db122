"""Snapshot: the only layer that touches CUDA, and with the manager's orchestration (``manager``, ``_restore``) the
only code that imports torch; ``format``, ``storage`` and ``tiers`` never do.

- :mod:`.tree`: a state mapping <-> a JSON tree with type tags plus a list of tensor leaves; in-place loading.
- :mod:`.staging`: reusable host buffers (pinned under CUDA) and the copy of tensors into them.
"""
