"""Server-side storage: tensors in memory with capacity and versions, optionally on disk.

``validate_name`` (``tensorwire.wire.names``) was exported here before; imported from here it still
works for one release and warns.
"""

from tensorwire._deprecated import moved
from tensorwire.store.memory import Entry, Reservation, TensorStore

__getattr__ = moved("tensorwire.store", {"validate_name": "tensorwire.wire.names"})

__all__ = ["Entry", "Reservation", "TensorStore"]
