"""One capacity for the process: the store's tensors, the parameter server's jobs and the gradient
exchange count in one ledger, the store's ``--capacity``. Before, each enforced ``--capacity`` on
its own, so a server with a capacity of N held N of tensors and N of a job and N of exchange
rounds at once. A server made as ``tensorwire serve`` makes it: a store of N, a ParamServer of N."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch
from psid_kit import call, config, flat_metas, init, join, push

from tensorwire import connect
from tensorwire.errors import CapacityExceeded, WaitTimeout
from tensorwire.ps import ParamServer
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import wait_for
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

N = 4 << 20  # the process's capacity: 4 MiB
HALF = N // 2  # bytes of tensors the store holds
MORE = 3 * N // 5 // 4 * 4  # what the parameter server or the exchange asks for: more than what is left
KEY = f"w#0:{MORE // 4}"


def serve(capacity: int = N) -> tuple[ServerThread, TensorStore]:
    """A server as `tensorwire serve --capacity N` makes it: one store, one ParamServer of N."""
    store = TensorStore(capacity)
    return ServerThread(store=store, extensions=[ParamServer(capacity=capacity, wait_timeout=30)]), store


def allreduce(url: str, world: int, wait_ms: int = 5000) -> None:
    """One ALLREDUCE of a gradient of MORE bytes as rank 0 of ``world``, in one request."""
    metas = flat_metas([("g", MORE // 4)])
    head = wps.PsHead(0, world, 0, secrets.randbits(63) or 1, wait_ms).encode()
    body = head + wm.encode_records(metas)
    call(url, Opcode.ALLREDUCE, body, [torch.ones(MORE // 4)], answer_has_data=True)


def make_job(url: str, job: str = "big") -> None:
    incarnation = secrets.randbits(63) or 1
    join(url, 0, 1, incarnation, job)
    init(url, 0, 1, config("async"), {KEY: torch.zeros(MORE // 4)}, incarnation=incarnation, job=job)


def test_a_job_does_not_fit_beside_the_tensors_the_store_holds() -> None:
    server, store = serve()
    with server, connect(server.url) as client:
        client.put("half", torch.zeros(HALF // 4))
        with pytest.raises(CapacityExceeded, match="--capacity"):
            make_job(server.url)
        assert store.used <= store.capacity
        client.delete("half")
        make_job(server.url, "another")  # with the tensors gone it fits
        assert store.charged.get("ps.params") == MORE


def test_tensors_do_not_fit_beside_a_job() -> None:
    server, store = serve()
    with server, connect(server.url) as client:
        make_job(server.url)
        with pytest.raises(CapacityExceeded, match="--capacity"):
            client.put("half", torch.zeros(HALF // 4))
        assert store.used <= store.capacity
        assert server_stats([server.url])[0]["held_bytes"]["params"] == MORE
        assert server.server.status()["store"]["charged"]["ps.params"] == MORE  # STATUS shows them by kind


def test_an_exchange_round_does_not_fit_beside_the_tensors_the_store_holds() -> None:
    server, store = serve()
    with server, connect(server.url) as client:
        client.put("half", torch.zeros(HALF // 4))
        with pytest.raises(CapacityExceeded, match="--capacity"):
            allreduce(server.url, 1)
        assert store.used <= store.capacity
        client.delete("half")
        allreduce(server.url, 1)  # with the tensors gone it fits


def test_tensors_do_not_fit_beside_an_exchange_round() -> None:
    """Rank 0 of a world of two sends its gradient and waits for rank 1: the round holds it. A put
    that does not fit beside it is refused; once the round is given up, the room is back."""
    server, store = serve()
    failure: list[BaseException] = []

    def rank0() -> None:
        try:
            allreduce(server.url, 2, wait_ms=3000)
        except BaseException as exc:  # the test reads it
            failure.append(exc)

    with server, connect(server.url) as client:
        sender = threading.Thread(target=rank0)
        sender.start()
        try:
            wait_for(lambda: store.charged.get("exchange", 0) >= MORE, 10, "the round to hold the gradient")
            with pytest.raises(CapacityExceeded, match="--capacity"):
                client.put("half", torch.zeros(HALF // 4))
        finally:
            sender.join(30)
        assert failure and isinstance(failure[0], WaitTimeout)  # rank 1 never came
        wait_for(lambda: not store.charged.get("exchange"), 10, "the round's bytes to be given back")
        client.put("half", torch.zeros(HALF // 4))  # fits again


def test_a_put_makes_the_jobs_idle_gradient_buffers_go() -> None:
    """A job keeps a push's gradient buffers for the next one (fresh pages are slow): counted in
    the one capacity, they must not keep a put out. The put lets them go, as a job's own
    reservation would."""
    server, store = serve()
    elements = N // 20  # a fifth of the capacity in bytes
    incarnation = secrets.randbits(63) or 1
    with server, connect(server.url) as client:
        join(server.url, 0, 1, incarnation, "small")
        key = f"w#0:{elements}"
        init(
            server.url,
            0,
            1,
            config("async"),
            {key: torch.zeros(elements)},
            incarnation=incarnation,
            job="small",
        )
        push(server.url, {key: torch.ones(elements)}, incarnation=incarnation, job="small")
        assert store.charged["ps.gradients"] == 4 * elements  # kept for the next push
        client.put("big", torch.zeros((N - 6 * elements) // 4))  # fits once they go
        assert "ps.gradients" not in store.charged and store.used <= store.capacity
