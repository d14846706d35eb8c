"""Server-side storage: tensors in memory with capacity and versions, optionally on disk.

``validate_name`` (``tensorwire.wire.names``) was exported here before; imported from here it still
works for one release and warns.
"""

from typing import TYPE_CHECKING

from tensorwire._deprecated import moved
from tensorwire.store.memory import Entry, Reservation, TensorStore

# Hidden from type checkers: to them a module __getattr__ would make every name of the package
# exist, a typo included; the deprecated names are for old code at run time only.
if not TYPE_CHECKING:
    __getattr__ = moved("tensorwire.store", {"validate_name": "tensorwire.wire.names"})

__all__ = ["Entry", "Reservation", "TensorStore"]
