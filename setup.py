"""The compiled twins of the hot path's pure-Python modules (tensorwire/_extensions.py).

Cython compiles each listed ``.py`` file, unchanged, with the C types of the ``.pxd`` named after
the extension, and each ``.pyx``, using this machine's compiler. A build that cannot happen (no Cython, no compiler,
a compile error) warns and installs the package without it: tensorwire then runs the same modules
as pure Python, says so in its log and in ``tensorwire --version``, and works the same, slower.
Metadata and everything else: pyproject.toml.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# extension -> what it is compiled from: a pure-Python module (with the .pxd named after the
# extension), or a .pyx written for Cython whose pure-Python twin is the module named *_py.
COMPILED = {
    "tensorwire.wire.codec_c": "src/tensorwire/wire/codec_py.py",
    "tensorwire.wire.views_c": "src/tensorwire/wire/views_c.pyx",
}
DIRECTIVES = {"language_level": 3, "annotation_typing": False, "embedsignature": True}


def _warn(message: str) -> None:
    bar = "*" * 78
    fallback = "The pure-Python modules are used instead (same behaviour, more CPU per tensor)."
    print(f"\n{bar}\nWARNING: tensorwire: {message}\n{fallback}\n{bar}\n", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext whose failures are warnings, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any build failure falls back; it is said loudly
            _warn(f"the compiled modules were not built: {exc}")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            _warn(f"{ext.name} was not built: {exc}")


def _extensions() -> list[Extension]:
    if os.environ.get("TENSORWIRE_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed, so the compiled modules were not built")
        return []
    modules = [Extension(name, [source]) for name, source in COMPILED.items()]
    try:
        return list(cythonize(modules, compiler_directives=DIRECTIVES, quiet=True))
    except Exception as exc:
        _warn(f"Cython could not translate the compiled modules: {exc}")
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
