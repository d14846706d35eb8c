"""Server-side storage: tensors in memory with capacity and versions, optionally on disk."""

from tensorwire.store.memory import Entry, Reservation, TensorStore
from tensorwire.wire.names import validate_name

__all__ = ["Entry", "Reservation", "TensorStore", "validate_name"]
