"""torch.distributed.checkpoint (DCP) storage in a tensorwire store: ``StorageWriter`` and
``StorageReader`` for ``dcp.save``, ``dcp.async_save`` and ``dcp.load``.

* ``storage.py``: the writer and the reader (one checkpoint, one generation published in parts:
  each rank's items, then the coordinator's metadata, the commit).
* ``metadata.py``: DCP's ``Metadata`` as JSON, read back as untrusted input (no pickle) and checked
  against what the checkpoint holds before DCP plans a read.

README, "Checkpoints with torch.distributed.checkpoint"; docs/protocol.md §14.8.
"""

from tensorwire.dcp.storage import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
