"""``tensorwire serve`` keeps what it loaded before serving out of the cyclic collector's walks:
a full collection of a server walked some 185,000 objects of modules, classes and functions (88 ms
on the development VM, every connection of the loop waiting) however few tensors it held."""

from __future__ import annotations

import gc
from collections.abc import Coroutine
from typing import Any

import pytest
from click.testing import CliRunner

from tensorwire import cli
from tensorwire.cli import serve as serve_command


def test_serve_freezes_what_it_loaded_before_the_first_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen_when_serving: list[int] = []

    def run(coro: Coroutine[Any, Any, None]) -> None:  # in place of serving: what is frozen by now
        frozen_when_serving.append(gc.get_freeze_count())
        coro.close()

    monkeypatch.setattr(serve_command, "run", run)
    gc.unfreeze()
    try:
        result = CliRunner().invoke(cli.main, ["serve", "--listen", "tcp://127.0.0.1:0"])
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector
    assert result.exit_code == 0, result.output
    assert frozen_when_serving and frozen_when_serving[0] > 10_000  # torch's and ours, at least
    assert gc.get_freeze_count() == 0
