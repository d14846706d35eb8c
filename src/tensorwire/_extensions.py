"""Compiled modules, and the pure-Python modules they are compiled from.

A module of the hot path (``wire/codec_py.py``) is compiled by Cython at install time into a
sibling extension (``codec_c``), or has a compiled twin written for Cython (``wire/views_c.pyx``,
twin of ``views_py.py``); ``load`` returns that extension, or the pure-Python module when
the extension is missing (the build failed, or this install never had a compiler), stale (its
source changed after it was built: an editable checkout), or refused (``TENSORWIRE_NO_EXTENSIONS=1``).
Both behave the same (tests/adversarial/test_compiled_codec.py and tests/unit/test_views.py run
one against the other); the fallback costs CPU, so a fallback that was not asked for is a warning
in the log, once per module, and ``tensorwire --version`` and ``bench transfer`` say which ran.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TypeVar, cast

log = logging.getLogger(__name__)

M = TypeVar("M", bound=ModuleType)
# What each loaded module runs: "compiled", or "pure Python" and why.
_LOADED: dict[str, str] = {}
# An installed wheel writes the extension and its source in one go, in either order; an edited
# source is newer than its build by more than this.
_SLACK_S = 5.0


def disabled() -> bool:
    """Whether ``TENSORWIRE_NO_EXTENSIONS`` asks for the pure-Python modules."""
    return os.environ.get("TENSORWIRE_NO_EXTENSIONS", "") not in ("", "0")


def load(compiled: str, fallback: M) -> M:
    """The extension module ``compiled`` built from ``fallback``'s source, or ``fallback`` itself
    (see the module's docstring). Its functions have ``fallback``'s signatures."""
    reason = _unusable(compiled, fallback)
    if reason is None:
        try:
            module = importlib.import_module(compiled)
        except ImportError as exc:
            reason = f"{compiled} does not load: {exc}"
        else:
            _LOADED[fallback.__name__] = "compiled"
            return cast(M, module)
    _LOADED[fallback.__name__] = f"pure Python ({reason})"
    if not disabled():
        log.warning("%s runs as pure Python, which costs more CPU per tensor: %s", fallback.__name__, reason)
    return fallback


def _unusable(compiled: str, fallback: ModuleType) -> str | None:
    if disabled():
        return "TENSORWIRE_NO_EXTENSIONS is set"
    spec = importlib.util.find_spec(compiled)
    if (
        spec is None
        or spec.origin is None
        or not spec.origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    ):
        return f"{compiled} was not built (no compiler or no Cython at install; reinstall to build it)"
    built = Path(spec.origin).stat().st_mtime
    for source in _sources(compiled, fallback):
        if source.stat().st_mtime > built + _SLACK_S:
            return f"{compiled} is older than {source.name} (rebuild: make extensions)"
    return None


def _sources(compiled: str, fallback: ModuleType) -> list[Path]:
    """What ``compiled`` is built from: the fallback's file, and the ``.pxd`` or ``.pyx`` named
    after the extension beside it, where there is one."""
    if fallback.__file__ is None:
        return []
    source = Path(fallback.__file__)
    leaf = compiled.rpartition(".")[2]
    twins = (source.with_name(f"{leaf}.pxd"), source.with_name(f"{leaf}.pyx"))
    return [source, *(twin for twin in twins if twin.exists())]


def loaded() -> dict[str, str]:
    """Each module with a compiled twin that has been imported, and which of the two runs."""
    return dict(_LOADED)


def compiled() -> bool:
    """Whether every module with a compiled twin runs compiled."""
    return bool(_LOADED) and all(state == "compiled" for state in _LOADED.values())


def describe() -> str:
    """One line for ``tensorwire --version``: whether the hot path runs compiled, and if not, why."""
    if not _LOADED:
        return "hot path: no module with a compiled twin imported"
    if compiled():
        return f"hot path: compiled (Cython: {', '.join(sorted(_LOADED))})"
    pure = "; ".join(f"{name}: {state}" for name, state in sorted(_LOADED.items()) if state != "compiled")
    return f"hot path: {pure}"
