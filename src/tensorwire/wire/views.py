"""``byte_view`` and ``copy_out``: compiled (``views_c``) where the install built them, else
``views_py``'s (see ``tensorwire._extensions``). Import ``byte_view`` from ``wire.tensors``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire import _extensions
from tensorwire.wire import views_py

if TYPE_CHECKING:  # the types are the source's; the extension has the same signature
    from tensorwire.wire.views_py import byte_view, copy_out
else:
    _impl = _extensions.load("tensorwire.wire.views_c", views_py)
    byte_view = _impl.byte_view
    copy_out = _impl.copy_out

__all__ = ["byte_view", "copy_out"]
