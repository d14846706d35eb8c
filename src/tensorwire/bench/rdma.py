"""The RDMA part of ``tensorwire bench transfer``: ``rdma://`` put and get next to the bare
transfer engine moving the same bytes in the same run (a child process registers one buffer; this
process's engine writes it and reads it back), interleaved with the puts and gets.

``rdma_vs_engine`` is rdma:// put+get over bare engine write+read, both the same bytes each way:
what tensorwire's control path, registration and chunk checksums cost on top of the engine
(target >= 0.9). Without an engine here (or without an RDMA device, unless
``TENSORWIRE_RDMA_PROTOCOL=tcp`` asks for the engine's TCP mode) the figures are None and
``rdma_note`` says why: never a silent measurement of something else.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch

import tensorwire
from tensorwire.bench.children import starting, wait_for_stop
from tensorwire.transport import rdma_clients, rdma_engine
from tensorwire.wire.tensors import byte_view

Result = dict[str, float | int | str | None]
KEYS = (
    "rdma_put_gbps", "rdma_get_gbps", "rdma_vs_engine",
    "engine_gbps", "engine_write_gbps", "engine_read_gbps",
)  # fmt: skip


def skipped(reason: str) -> Result:
    return {**dict.fromkeys(KEYS), "rdma_note": reason}


class EnginePeer(NamedTuple):
    """What the engine peer child answers: its engine's name and instance, and its buffer."""

    session: str
    instance: int
    address: int


def engine_peer(conn: Connection, nbytes: int) -> None:
    """Child: a bare engine with one registered buffer of ``nbytes``; answers an ``EnginePeer``."""
    with starting(conn):
        engine = rdma_engine.Engine("127.0.0.1")
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        engine.register(buf.data_ptr(), nbytes)
        conn.send(("ready", tuple(EnginePeer(engine.session, engine.instance, buf.data_ptr()))))
    try:
        wait_for_stop(conn)
    finally:
        engine.close()


@contextlib.contextmanager
def client_engine_for(peer: EnginePeer) -> Iterator[rdma_engine.Engine]:
    """This process's client engine (the one rdma:// connections share), held while the block runs."""
    engine = rdma_clients.client_engine("127.0.0.1", peer.session, peer.instance)
    try:
        yield engine
    finally:
        rdma_clients.release_client_engine(engine)


def measure(client: tensorwire.Client, data: torch.Tensor, iters: int, peer: EnginePeer) -> Result:
    """rdma put, get into ``out=``, bare engine write and read: one of each per round, medians."""
    if client.transport != "rdma":
        raise ValueError(f"the rdma benchmark needs an rdma:// client, not {client.url}")
    with client_engine_for(peer) as engine:
        return _measure(client, engine, data, iters, peer)


def _measure(
    client: tensorwire.Client, engine: rdma_engine.Engine, data: torch.Tensor, iters: int, peer: EnginePeer
) -> Result:
    src = byte_view(data)
    out = torch.empty_like(data)
    out.zero_()  # touched once: the timed reads measure transfers, not page faults
    nbytes = src.nbytes

    def bare(kind: str) -> None:
        move = engine.write if kind == "write" else engine.read
        # The registrations rdma:// itself makes (and keeps): the engine refuses a buffer twice.
        with engine.cache.using(src if kind == "write" else byte_view(out)) as local:
            asyncio.run(move(peer.session, local, peer.address, nbytes, timeout=120.0))

    steps: dict[str, Callable[[], object]] = {
        "put": lambda: client.put("bench/rdma", data),
        "get": lambda: client.get("bench/rdma", out=out),
        "write": lambda: bare("write"),
        "read": lambda: bare("read"),
    }
    for step in steps.values():  # warm: the server's buffers, the registrations, the handshakes
        step()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(iters):
        for kind, step in steps.items():
            start = time.perf_counter()
            step()
            times[kind].append(time.perf_counter() - start)
    client.get("bench/rdma", out=out)
    if not torch.equal(out, data):
        raise RuntimeError("bench/rdma came back different from what was put")
    med = {k: statistics.median(v) for k, v in times.items()}
    return fields(nbytes, med)


def fields(nbytes: int, med: dict[str, float]) -> Result:
    engine = 2 * nbytes / (med["write"] + med["read"]) / 1e9
    rdma = 2 * nbytes / (med["put"] + med["get"]) / 1e9
    return {
        "rdma_put_gbps": nbytes / med["put"] / 1e9,
        "rdma_get_gbps": nbytes / med["get"] / 1e9,
        "engine_gbps": engine,
        "engine_write_gbps": nbytes / med["write"] / 1e9,
        "engine_read_gbps": nbytes / med["read"] / 1e9,
        "rdma_vs_engine": rdma / engine if engine > 0 else None,
        "rdma_note": f"engine protocol {rdma_engine.requested_protocol()}",
    }


def rows(r: Result, fmt: object) -> list[tuple[str, str, str]]:
    """The table rows of the rdma figures; ``fmt`` is the table's number formatter."""
    f = fmt
    assert callable(f)
    return [
        ("put over rdma://", f"{f(r['rdma_put_gbps'], '.3f')} GB/s", f"note: {r['rdma_note']}"),
        ("get(out=) over rdma://", f"{f(r['rdma_get_gbps'], '.3f')} GB/s", ""),
        ("bare engine write+read", f"{f(r['engine_gbps'], '.3f')} GB/s", "baseline"),
        ("rdma:// vs engine", f"{f(r['rdma_vs_engine'], '.2f')} x", "target >= 0.9"),
    ]
