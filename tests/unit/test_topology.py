"""Where a process runs (``tensorwire.topology``): labels read when asked, checked like any peer
field, and a host identity that tells apart processes that cannot share segments."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorwire import topology


def test_here_reads_the_environment_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(topology.HOST_ENV, "node-7")
    monkeypatch.setenv(topology.RACK_ENV, "r2")
    assert topology.here() == topology.Location("node-7", "r2")
    assert topology.here("r9").rack == "r9"  # --rack wins over the variable
    monkeypatch.delenv(topology.RACK_ENV)
    assert topology.here().rack is None
    monkeypatch.setenv(topology.HOST_ENV, "bad host")
    with pytest.raises(ValueError, match="TENSORWIRE_HOST must be printable ASCII"):
        topology.here()


def test_labels_are_bounded_and_printable() -> None:
    assert topology.check_label("h-1.example", "host") == "h-1.example"
    for bad in ("", "x" * 256, "a\nb", "é"):
        with pytest.raises(ValueError, match="host"):
            topology.check_label(bad, "host")


def test_host_identity_tells_apart_segment_directories_and_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(topology.HOST_ID_ENV, raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = topology.host_identity(tmp_path / "a")
    assert a == topology.host_identity(tmp_path / "a") != 0
    assert a != topology.host_identity(tmp_path / "b")  # another /dev/shm: no shared segments
    monkeypatch.setenv(topology.HOST_ENV, "elsewhere")
    assert a != topology.host_identity(tmp_path / "a")
    monkeypatch.setenv(topology.HOST_ID_ENV, "same")
    assert topology.host_identity(tmp_path / "a") == topology.host_identity(tmp_path / "b")
