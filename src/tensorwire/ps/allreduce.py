"""Deprecated: the gradient exchange's client under its first name (``ps.allreduce.ExchangeClient``).

It lives in ``tensorwire.ps.exchange.client``; import it as ``tensorwire.ps.ExchangeClient``. This
alias warns (``DeprecationWarning``) and goes in the next release.
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    # Looked up on use, not at import, so the warning points at the line that uses the old name.
    if name != "ExchangeClient":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        "tensorwire.ps.allreduce.ExchangeClient is deprecated: use tensorwire.ps.ExchangeClient",
        DeprecationWarning,
        stacklevel=2,
    )
    from tensorwire.ps.exchange.client import ExchangeClient

    return ExchangeClient
