"""The relay under faults: a reader kill -9'd mid-relay and a reader that forwards a corrupt chunk
are routed around; the others finish bit-exact (docs/protocol.md §15)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import torch

import tensorwire
from tensorwire.errors import TensorwireError, TransportError
from tensorwire.testing.process import ServerProcess, run_threads
from tensorwire.testing.relay import (
    PREFIX,
    blank_like,
    model_bytes,
    model_tensors,
    origin,
    publish,
    same_bytes,
)

PAUSE_AT = 5  # chunks the doomed reader verifies (and can forward) before it stops pulling

# A reader that pulls one chunk at a time, says so after PAUSE_AT chunks and stops pulling there
# (its relay server keeps serving what it has), until it is killed.
_DOOMED = """
import sys, threading
import tensorwire
from tensorwire.testing.relay import PREFIX, blank_like, model_tensors

def progress(chunks):
    if chunks == PAUSE_AT:
        print("paused", flush=True)
        threading.Event().wait()

sub = tensorwire.Subscriber(sys.argv[1], PREFIX, blank_like(model_tensors(1)), listen_host="127.0.0.1",
                            window=1, progress=progress)
sub.update(timeout=120)
""".replace("PAUSE_AT", str(PAUSE_AT))


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError(f"waited {timeout}s for the doomed reader to pause")
    return proc.stdout.readline().strip()


def _reaching(event: threading.Event) -> Callable[[int], None]:
    def progress(chunks: int) -> None:
        if chunks >= PAUSE_AT:
            event.set()

    return progress


def test_a_reader_killed_mid_relay_is_routed_around() -> None:
    model = model_tensors(1)
    with origin() as (srv, _):
        publish(srv.url, model)
        doomed = subprocess.Popen([sys.executable, "-c", _DOOMED, srv.url], stdout=subprocess.PIPE, text=True)
        subs: list[tensorwire.Subscriber] = []
        try:
            assert _read_line(doomed, 60) == "paused"
            # Every reader joins behind the doomed one, so each stops at PAUSE_AT chunks until the kill.
            reached = [threading.Event() for _ in range(3)]
            targets = [blank_like(model) for _ in range(3)]
            for event, target in zip(reached, targets, strict=True):
                subs.append(tensorwire.Subscriber(srv.url, PREFIX, target, listen_host="127.0.0.1", window=1,
                                                  progress=_reaching(event)))  # fmt: skip
            done = threading.Event()

            def read_all() -> None:
                run_threads(lambda i: subs[i].update(timeout=60), 3, 90)
                done.set()

            worker = threading.Thread(target=read_all, daemon=True)
            worker.start()
            for event in reached:
                assert event.wait(60), "a reader behind the doomed one never got the chunks it had"
            assert not done.is_set()  # they wait on the doomed reader: the kill lands mid-relay
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(30)
            worker.join(90)
            assert done.is_set(), "the readers did not finish after the kill"
            assert all(same_bytes(model, t) for t in targets)
            (gen,) = subs[0].stats()["generations"]
            assert gen["dropped"] >= 1
            assert gen["served_bytes"] <= 1.5 * model_bytes(model), gen
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait(30)
            for sub in subs:
                sub.close()


def test_a_reader_that_forwards_a_corrupt_chunk_is_dropped_and_the_chunk_fetched_again() -> None:
    model = model_tensors(1)
    with origin() as (srv, _):
        publish(srv.url, model)
        liar_target, honest, later = blank_like(model), blank_like(model), blank_like(model)
        with (
            tensorwire.Subscriber(srv.url, PREFIX, liar_target, listen_host="127.0.0.1") as liar,
            tensorwire.Subscriber(srv.url, PREFIX, honest, listen_host="127.0.0.1") as reader,
            tensorwire.Subscriber(srv.url, PREFIX, later, listen_host="127.0.0.1") as late,
        ):
            liar.update(timeout=30)
            liar_target["fc1.weight"].view(-1).view(torch.uint8)[40_000] ^= 0x10  # in chunk 2 of it
            reader.update(timeout=30)  # its upstream is the liar: chunk 2 fails its checksum
            assert same_bytes(model, honest)
            (gen,) = reader.stats()["generations"]
            assert gen["dropped"] == 1 and gen["readers"] == 1  # the liar is out of the relay
            late.update(timeout=30)  # joins behind the honest reader, not the liar
            assert same_bytes(model, later)
            assert late.reader_id and reader.stats()["generations"][0]["dropped"] == 1


def _pausing(after: int, paused: threading.Event, go: threading.Event) -> Callable[[int], None]:
    def progress(chunks: int) -> None:
        if chunks == after:
            paused.set()
            assert go.wait(60), "the test never let the reader go on"

    return progress


def test_a_generation_retired_mid_read_restarts_the_update_at_the_newest() -> None:
    models = [model_tensors(seed) for seed in range(4)]
    paused, go = threading.Event(), threading.Event()
    target = blank_like(models[0])
    with origin(generations=True) as (srv, _), tensorwire.connect(srv.url) as trainer:
        trainer.publish("policy", models[0])
        sub = tensorwire.Subscriber(
            srv.url, "policy", target, listen_host="127.0.0.1", window=1, progress=_pausing(1, paused, go)
        )
        with sub:
            result: list[int] = []
            reading = threading.Thread(target=lambda: result.append(sub.update(timeout=60)), daemon=True)
            reading.start()
            assert paused.wait(60)
            newest = [trainer.publish("policy", m) for m in models[1:]][-1]  # keeps 2: the first retires
            go.set()
            reading.join(60)
            assert result == [newest.number] and same_bytes(models[-1], target)


def test_an_origin_killed_mid_read_fails_the_update_without_a_hang() -> None:
    paused, go = threading.Event(), threading.Event()
    model = model_tensors(1)
    with ServerProcess() as srv, tensorwire.connect(srv.url) as trainer:
        trainer.publish("policy", model)
        sub = tensorwire.Subscriber(
            srv.url, "policy", blank_like(model), listen_host="127.0.0.1", window=1,
            progress=_pausing(1, paused, go), stall_timeout=2.0, connect_timeout=2.0,
        )  # fmt: skip
        with sub:
            errors: list[BaseException] = []

            def read() -> None:
                try:
                    sub.update(timeout=30)
                except TensorwireError as exc:
                    errors.append(exc)

            reading = threading.Thread(target=read, daemon=True)
            reading.start()
            assert paused.wait(60)
            srv.signal(signal.SIGKILL)
            srv.proc.wait(30)
            go.set()
            reading.join(30)
            assert not reading.is_alive() and len(errors) == 1
            assert isinstance(errors[0], TransportError) and sub.generation == 0
