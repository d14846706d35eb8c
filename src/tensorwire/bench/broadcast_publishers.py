"""The publishers of ``tensorwire bench broadcast`` (broadcast.py), run where the origin is: in its
namespace a process of their own (their puts cross no shaped link), on loopback this process
(torch is imported already). ``run_publisher`` publishes one generation; ``publishing`` keeps a
publisher publishing generation after generation (the ``mixed`` mode's) while its body runs."""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tensorwire.bench.broadcast_readers import (
    START_TIMEOUT,
    STOP_TIMEOUT,
    publisher_loop_main,
    publisher_main,
    write_json,
)
from tensorwire.server.process import wait_for


def run_publisher(wrapper: Sequence[str], folder: Path, timeout: float, spec: str) -> dict[str, Any]:
    """The publisher runs where the origin does: in its namespace, a process of its own (its put
    crosses no shaped link); on loopback, this process (it has torch imported already). Returns
    the generation's number and digests."""
    out, log = folder / f"published-{spec}", folder / "publisher.log"
    if not wrapper:
        publisher_main(folder / spec, out)
        return dict(json.loads(out.read_text()))
    cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.broadcast_readers", "--publish",
           str(folder / spec), str(out)]  # fmt: skip
    with open(log, "wb") as sink:
        done = subprocess.run(
            cmd, check=False, stdout=sink, stderr=subprocess.STDOUT, timeout=START_TIMEOUT + timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"the publisher exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@contextlib.contextmanager
def publishing(
    wrapper: Sequence[str], spec: dict[str, Any], log: Path, every: float, timeout: float
) -> Iterator[None]:
    """A publisher where the origin is (``wrapper``: in its namespace; none: a thread of this
    process) publishing a new generation every ``every`` seconds (``publisher_loop_main``,
    appending each to ``log``) from its first publish until leaving; RuntimeError if it failed."""
    stop = log.with_suffix(".stop")
    spec_path = log.with_suffix(".json")
    write_json(spec_path, {**spec, "stop": str(stop), "every": every})
    run = functools.partial(_publisher_process, wrapper) if wrapper else _publisher_thread
    with run(spec_path, log, timeout) as alive:
        try:
            wait_for(lambda: _published_once(alive, log), START_TIMEOUT, "the publisher's first generation")
            yield
        finally:
            stop.touch()


@contextlib.contextmanager
def _publisher_process(
    wrapper: Sequence[str], spec: Path, log: Path, timeout: float
) -> Iterator[Callable[[], bool]]:
    """The publisher in the origin's namespace (its puts cross no shaped link); on leaving, waited
    for (it was told to stop), RuntimeError with its log's tail if it failed."""
    cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.broadcast_readers",
           "--publish-loop", str(spec), str(log)]  # fmt: skip
    output = log.with_suffix(".log")
    with open(output, "ab") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield lambda: proc.poll() is None
    finally:
        try:
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(STOP_TIMEOUT)
    if proc.returncode != 0:
        tail = output.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the publisher exited with {proc.returncode}:\n{tail}")


@contextlib.contextmanager
def _publisher_thread(spec: Path, log: Path, timeout: float) -> Iterator[Callable[[], bool]]:
    """On loopback, the publisher is a thread of this process (torch is imported already)."""
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            publisher_loop_main(spec, log)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=guarded, name="bench-publisher", daemon=True)
    thread.start()
    try:
        yield thread.is_alive
    finally:
        thread.join(timeout)
    if errors or thread.is_alive():
        raise RuntimeError("the publisher failed" if errors else "the publisher did not stop") from (
            errors[0] if errors else None
        )


def _published_once(alive: Callable[[], bool], log: Path) -> bool:
    if log.exists() and log.stat().st_size > 0:
        return True
    if not alive():
        raise RuntimeError("the publisher ended before its first publish")
    return False
