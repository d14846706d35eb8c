"""``byte_view``: compiled (``views_c``) where the install built it, else ``views_py``'s (see
``tensorwire._extensions``). Import it from ``tensorwire.wire.tensors``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire import _extensions
from tensorwire.wire import views_py

if TYPE_CHECKING:  # the types are the source's; the extension has the same signature
    from tensorwire.wire.views_py import byte_view
else:
    byte_view = _extensions.load("tensorwire.wire.views_c", views_py).byte_view

__all__ = ["byte_view"]
