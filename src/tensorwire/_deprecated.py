"""Old public names kept for one release: each use warns ``DeprecationWarning`` naming the new one.

* ``renamed(old, new)``: a function renamed; the old name calls the new one after the warning.
* ``moved(package, homes)``: a package's module ``__getattr__`` for names that left its ``__all__``
  (internals that were exported); each still resolves, from the module that defines it, after the
  warning. A name Python looks up on the package itself (a submodule, a name it has) never comes
  here, so only the names listed warn.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def renamed(old: str, new: Callable[P, R]) -> Callable[P, R]:
    """``new`` under its old name ``old`` (``package.name``): warns on every call, then calls it.
    The warning names ``new`` as its package exports it (the module's parent)."""
    new_name = f"{new.__module__.rsplit('.', 1)[0]}.{new.__name__}"

    @functools.wraps(new)
    def alias(*args: P.args, **kwargs: P.kwargs) -> R:
        warnings.warn(f"{old} is deprecated; use {new_name}", DeprecationWarning, stacklevel=2)
        return new(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old.rsplit(".", 1)[1]
    alias.__doc__ = f"Deprecated: the old name of ``{new_name}``, which see."
    return alias


def moved(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: each name of ``homes`` (name -> the module that
    defines it) warns and resolves from there; any other name is an AttributeError, as without."""

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        warnings.warn(
            f"{package}.{name} is not public API and leaves {package} in the next release; "
            f"import it from {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
