"""torch.distributed.checkpoint (DCP) storage in a tensorwire store: ``StorageWriter`` and
``StorageReader`` for ``dcp.save``, ``dcp.async_save`` and ``dcp.load``.

* ``writer.py``: the writer (one checkpoint, one generation published in parts: each rank's items,
  then the coordinator's metadata, the commit).
* ``reader.py``: the reader (generation 1's metadata checked, then only the byte runs DCP's plan asks
  for, read straight into place).
* ``connection.py``: what both hold: the server's url and options, the checkpoint's prefix, the
  client opened on first use, and the checks of a checkpoint id.
* ``metadata.py``: DCP's ``Metadata`` as JSON, read back as untrusted input (no pickle) and checked
  against what the checkpoint holds before DCP plans a read.

README, "Checkpoints with torch.distributed.checkpoint"; docs/protocol.md §14.8.
"""

from tensorwire.dcp.reader import StorageReader
from tensorwire.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
