"""What a ``--data-dir`` server restores at start is what it published, and nothing stops it from
starting (issue 32, review 2 #4), with real ``tensorwire serve`` processes:

* a publish given up during its disk write (the server stopped with SIGTERM mid-write: its client
  hears the connection was lost) does not come back as "latest" after the restart; before, the disk
  thread finished the write anyway and the generation came back, outside every quota, and could
  make every later start fail ("prefix 'a' nests with 'a/b'");
* restoring is not publishing: a restart with a lower ``--max-prefixes`` starts with every prefix
  it kept (and refuses new ones);
* a generation that cannot be restored (damaged files, a prefix nesting with another) is set
  aside under ``generations-quarantine/``, logged and counted in STATUS, and the server starts with
  the rest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire.client.core import ClientOptions
from tensorwire.dashboard.collect import ask_status
from tensorwire.errors import KeyNotFound, LimitExceeded, TensorwireError
from tensorwire.store.generation_disk import QUARANTINE, ROOT, number_dir, prefix_dir
from tensorwire.testing.process import ServerProcess, wait_for


def stop(srv: ServerProcess) -> str:
    """SIGTERM (the server's clean stop), waited for; what it logged."""
    srv.signal(signal.SIGTERM)
    srv.proc.wait(60)
    return srv.output()


def status(url: str) -> dict[str, Any]:
    return asyncio.run(ask_status(url, ClientOptions()))["generations"]


def test_a_publish_given_up_during_its_write_does_not_come_back(tmp_path: Path) -> None:
    big = {"w": torch.ones(32 << 20)}  # 128 MiB: its fsynced write takes a while
    first = ServerProcess(capacity="512MiB", data_dir=tmp_path)
    answered: list[int] = []
    try:
        with tensorwire.connect(first.url, retries=0) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
            publishing = pool.submit(lambda: answered.append(c.publish("a", big).number))
            writing = lambda: any((tmp_path / ROOT).glob("*/.tmp-*"))  # noqa: E731
            wait_for(lambda: writing() or publishing.done(), 60, "the generation's write to begin")
            stop(first)  # in the middle of the write
            with pytest.raises(TensorwireError):  # the connection was lost: it was not published
                publishing.result(60)
    finally:
        first.stop()
    assert not answered, "the publish was answered before the stop: make the generation larger"
    with ServerProcess(capacity="512MiB", data_dir=tmp_path) as second, tensorwire.connect(second.url) as c:
        with pytest.raises(KeyNotFound):  # before: generation 1 of 'a', which its client was told failed
            c.manifest("a")
        assert c.publish("a/b", {"w": torch.zeros(2)}).number == 1  # no phantom 'a' to nest with
        stop(second)
    with ServerProcess(capacity="512MiB", data_dir=tmp_path) as third, tensorwire.connect(third.url) as c:
        assert c.manifest("a/b").generation.number == 1  # before: every start failed, 'a' nests with 'a/b'
        assert status(third.url)["quarantined"] == 0


def test_a_restart_with_a_lower_max_prefixes_keeps_every_prefix(tmp_path: Path) -> None:
    with ServerProcess(capacity="64MiB", data_dir=tmp_path) as first, tensorwire.connect(first.url) as c:
        for p in ("p1", "p2", "p3"):
            c.publish(p, {"w": torch.full((4,), float(p[1]))})
        stop(first)
    extra = ("--max-prefixes", "2")
    with (
        ServerProcess(capacity="64MiB", data_dir=tmp_path, extra=extra) as second,
        tensorwire.connect(second.url) as c,
    ):  # before: LimitExceeded at start, at every start
        for p in ("p1", "p2", "p3"):
            assert c.get(f"{p}/w", at=1).equal(torch.full((4,), float(p[1])))
        c.publish("p1", {"w": torch.zeros(4)})  # a prefix it has is no new one
        with pytest.raises(LimitExceeded, match="--max-prefixes"):
            c.publish("p4", {"w": torch.zeros(4)})


def test_a_damaged_generation_is_set_aside_and_the_server_starts(tmp_path: Path) -> None:
    with ServerProcess(capacity="64MiB", data_dir=tmp_path) as first, tensorwire.connect(first.url) as c:
        for g in (1, 2):
            c.publish("m", {"w": torch.full((1024,), float(g))})
        stop(first)
    damaged = tmp_path / ROOT / prefix_dir("m") / number_dir(2)
    tensor = next(p for p in damaged.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(tensor.read_bytes())
    raw[-1] ^= 0xFF
    tensor.write_bytes(bytes(raw))
    second = ServerProcess(capacity="64MiB", data_dir=tmp_path)  # before: PersistenceError, no start
    try:
        with tensorwire.connect(second.url) as c:
            assert c.manifest("m").generation.number == 1  # what could be restored
            assert c.get("m/w", at="latest").equal(torch.full((1024,), 1.0))
            assert status(second.url)["quarantined"] == 1
            assert c.publish("m", {"w": torch.zeros(1024)}).number == 2  # numbering goes on
        log = stop(second)
    finally:
        second.stop()
    assert "generation set aside" in log and str(damaged) in log
    (aside,) = (tmp_path / QUARANTINE).iterdir()
    assert (aside / tensor.name).read_bytes() == bytes(raw)  # kept for an operator, not deleted


def test_prefixes_that_nest_are_not_both_restored_and_the_server_starts(tmp_path: Path) -> None:
    """A data directory holding generations of both 'a' and 'a/b' (what a phantom of the old code
    left): one is set aside, the server starts with the other."""
    other = tmp_path / "other"
    data = tmp_path / "data"
    with ServerProcess(capacity="64MiB", data_dir=other) as srv, tensorwire.connect(srv.url) as c:
        c.publish("a", {"w": torch.ones(2)})
        stop(srv)
    with ServerProcess(capacity="64MiB", data_dir=data) as srv, tensorwire.connect(srv.url) as c:
        c.publish("a/b", {"w": torch.zeros(2)})
        stop(srv)
    shutil.copytree(other / ROOT / prefix_dir("a"), data / ROOT / prefix_dir("a"))
    with ServerProcess(capacity="64MiB", data_dir=data) as srv, tensorwire.connect(srv.url) as c:
        restored = []
        for prefix in ("a", "a/b"):
            with contextlib.suppress(KeyNotFound):
                restored.append(c.manifest(prefix).generation.prefix)
        assert len(restored) == 1 and status(srv.url)["quarantined"] == 1
    assert len(list((data / QUARANTINE).iterdir())) == 1
