"""tierckpt as the storage of ``torch.distributed.checkpoint`` (DCP): a writer, a reader and an async stager.

```python
import torch.distributed.checkpoint as dcp
import tierckpt.dcp
dcp.save(state_dict, storage_writer=tierckpt.dcp.StorageWriter(mgr, step))
dcp.async_save(state_dict, storage_writer=tierckpt.dcp.StorageWriter(mgr, step), async_stager=tierckpt.dcp.Stager(mgr))
dcp.load(state_dict, storage_reader=tierckpt.dcp.StorageReader(mgr))            # newest intact step, any tier
dcp.load(state_dict, storage_reader=tierckpt.dcp.StorageReader(mgr, step=N))    # exactly step N, or raise
```

What one DCP save stores (one tierckpt step, saved by ``mgr.save`` on every rank of DCP's group):

- every rank: ``{"dcp": {key: value}}``, one entry per item of that rank's final DCP plan: the tensor DCP resolved
  (a tensor, a DTensor's local shard, a chunk) or, for a ``BYTE_IO`` item (a non-tensor value that DCP pickles with
  ``torch.save``), its bytes as an opaque ``bytes`` value. ``key`` is :func:`storage_key` of the item's
  ``MetadataIndex``: ``"t:<offsets>:<fqn>"`` for a tensor chunk, ``"b:<fqn>"`` for bytes;
- the coordinator also stores ``"dcp_metadata"``: DCP's global ``Metadata`` as JSON (schema in :func:`metadata_to_json`,
  never pickle), whose ``storage_data`` gives, for each item, the tierckpt rank that stored it and its key. Every key
  is derived from (rank, item index) alone, so the coordinator writes the complete metadata before any byte is
  written, and the step commits with it (manifest last), so DCP's ``finish`` writes nothing.

DCP's meaning of "saved" is tierckpt's ``handle.persisted``: the step committed on the local tier on every rank; the
upload to the remote tier continues in the background. Loading checks every stored byte against its checksum, and
falls back to the other tier's copy, then (``step=None``) to an older step; see :class:`StorageReader`. Byte items
reach DCP's planner (which unpickles them with ``weights_only=False``) only as what ``torch.load(weights_only=True)``
made of them, unless the reader is built with ``allow_pickle=True`` for a trusted checkpoint.

Requirements: DCP's process group is the manager's world (DCP rank ``r`` is tierckpt rank ``r``: the default
``process_group=None``); DCP's ``use_collectives=True`` (the default); the thread async checkpointer (the default).

Modules: :mod:`._metadata` (the metadata JSON, storage keys, step ids), :mod:`._writer` (:class:`StorageWriter`,
:class:`Stager`), :mod:`._reader` (:class:`StorageReader`).
"""

from ._metadata import FORMAT, FORMAT_VERSION, Record, metadata_from_json, metadata_to_json, storage_key
from ._reader import StorageReader
from ._writer import Stager, StorageWriter

__all__ = ["StorageWriter", "StorageReader", "Stager", "Record", "storage_key", "metadata_to_json",
           "metadata_from_json", "FORMAT", "FORMAT_VERSION"]
