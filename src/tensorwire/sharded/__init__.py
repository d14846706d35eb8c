"""Sharded state (DTensor, FSDP): a state_dict put from the N ranks of one job, read on the M
ranks of another with other placements, only the bytes each rank's shard overlaps moved.

* ``state.py``: ``put_state_dict`` (all ranks' parts one generation, all or nothing),
  ``get_state_dict`` (ranged reads straight into each local shard), ``layout_of``.
* ``layout.py``: the layout math, no sockets: boxes, tiling checks, overlap runs, the layout
  document a reader checks like any peer input.
* ``checkpoint.py``: ``AsyncSaver`` / ``save_async`` (a snapshot into reused host buffers, uploaded
  on its own thread and gloo group) and ``training_state`` for an FSDP model and its optimizer.

README, "Sharded state (DTensor, FSDP)"; docs/protocol.md §14.8 (GEN_PUBLISH_PART).
"""

from tensorwire.sharded.checkpoint import (
    AsyncSaver,
    load_training_state,
    save_async,
    training_state,
)
from tensorwire.sharded.layout import Box, ShardLayout
from tensorwire.sharded.state import get_state_dict, layout_of, put_state_dict

__all__ = [
    "AsyncSaver",
    "Box",
    "ShardLayout",
    "get_state_dict",
    "layout_of",
    "load_training_state",
    "put_state_dict",
    "save_async",
    "training_state",
]
