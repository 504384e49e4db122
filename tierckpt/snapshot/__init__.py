"""Snapshot: the only layer that touches torch (and CUDA).

- :mod:`.tree`: a state mapping <-> a JSON tree with type tags plus a list of tensor leaves; in-place loading.
- :mod:`.staging`: reusable host buffers (pinned under CUDA) and the copy of tensors into them.
"""
