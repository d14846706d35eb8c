"""Which twin runs: the compiled module when it is built, current and not refused; else the
pure-Python source, with a warning that says why (a fallback nobody notices is a known trap)."""

from __future__ import annotations

import importlib.machinery
import logging
import os
import types
from pathlib import Path

import pytest

from tensorwire import _extensions
from tensorwire.wire import codec, codec_py


def test_the_hot_path_runs_compiled_unless_told_not_to() -> None:
    state = _extensions.loaded()["tensorwire.wire.codec_py"]
    if _extensions.disabled():
        assert state.startswith("pure Python") and codec.decode_records is codec_py.decode_records
    else:  # `make install` builds it: a pure-Python run here is the unnoticed fallback this guards
        assert state == "compiled", state
        assert codec.decode_records is not codec_py.decode_records


@pytest.fixture(autouse=True)
def _own_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a test loads is forgotten after it: the process's record stays the real one."""
    monkeypatch.setattr(_extensions, "_LOADED", dict(_extensions.loaded()))


def test_a_missing_build_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TENSORWIRE_NO_EXTENSIONS", raising=False)
    source = types.ModuleType("tw_test_source")
    with caplog.at_level(logging.WARNING, logger="tensorwire._extensions"):
        assert _extensions.load("tensorwire.wire.no_such_twin", source) is source
    assert "was not built" in _extensions.loaded()["tw_test_source"]
    assert "runs as pure Python" in caplog.text and "no_such_twin" in caplog.text


def test_a_build_older_than_its_source_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TENSORWIRE_NO_EXTENSIONS", raising=False)
    built = tmp_path / f"twin{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    built.write_bytes(b"")
    source_file = tmp_path / "twin_py.py"
    source_file.write_text("")
    os.utime(built, (1_000_000, 1_000_000))  # built long before the source was last edited
    spec = importlib.machinery.ModuleSpec("twin", None, origin=str(built))
    monkeypatch.setattr(_extensions.importlib.util, "find_spec", lambda name: spec)
    source = types.ModuleType("tw_test_stale")
    source.__file__ = str(source_file)
    with caplog.at_level(logging.WARNING, logger="tensorwire._extensions"):
        assert _extensions.load("twin", source) is source
    assert "is older than twin_py.py" in _extensions.loaded()["tw_test_stale"]


def test_no_extensions_is_obeyed_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TENSORWIRE_NO_EXTENSIONS", "1")
    with caplog.at_level(logging.WARNING, logger="tensorwire._extensions"):
        assert _extensions.load("tensorwire.wire.codec_c", codec_py) is codec_py
    assert caplog.text == ""  # asked for: nothing to warn about


def test_a_build_older_than_its_pxd_or_pyx_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORWIRE_NO_EXTENSIONS", raising=False)
    built = tmp_path / f"thing_c{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    built.write_bytes(b"")
    source_file, declarations = tmp_path / "thing_py.py", tmp_path / "thing_c.pxd"
    source_file.write_text("")
    declarations.write_text("")
    os.utime(source_file, (1_000_000, 1_000_000))  # the .py is as old as the build; the .pxd is not
    os.utime(built, (1_000_000, 1_000_000))
    spec = importlib.machinery.ModuleSpec("pkg.thing_c", None, origin=str(built))
    monkeypatch.setattr(_extensions.importlib.util, "find_spec", lambda name: spec)
    source = types.ModuleType("tw_test_pxd")
    source.__file__ = str(source_file)
    assert _extensions.load("pkg.thing_c", source) is source
    assert "is older than thing_c.pxd" in _extensions.loaded()["tw_test_pxd"]
