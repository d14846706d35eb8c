"""Sharded state (DTensor, FSDP): a state_dict put from the N ranks of one job, read on the M
ranks of another with other placements, only the bytes each rank's shard overlaps moved.

* ``state.py``: ``put_state_dict`` (all ranks' parts one generation, all or nothing),
  ``load_state_dict`` (ranged reads straight into each local shard), ``layout_of``.
* ``layout.py``: the layout math, no sockets: boxes, tiling checks, overlap runs, the layout
  document a reader checks like any peer input.
* ``checkpoint.py``: ``AsyncSaver`` / ``async_save`` (a snapshot into reused host buffers, uploaded
  on its own thread and gloo group) and ``training_state`` for an FSDP model and its optimizer.

README, "Sharded state (DTensor, FSDP)"; docs/protocol.md §14.8 (GEN_PUBLISH_PART).

``get_state_dict`` and ``save_async``, the names before issue 33, still work for one release and
warn (``DeprecationWarning``): torch's ``get_state_dict`` returns state dicts, and DCP says
``async_save``.
"""

from tensorwire.sharded.checkpoint import (
    AsyncSaver,
    async_save,
    load_training_state,
    training_state,
)
from tensorwire.sharded.checkpoint import save_async as save_async  # deprecated: async_save
from tensorwire.sharded.layout import Box, ShardLayout
from tensorwire.sharded.state import get_state_dict as get_state_dict  # deprecated: load_state_dict
from tensorwire.sharded.state import layout_of, load_state_dict, put_state_dict

__all__ = [
    "AsyncSaver",
    "Box",
    "ShardLayout",
    "async_save",
    "layout_of",
    "load_state_dict",
    "load_training_state",
    "put_state_dict",
    "training_state",
]
