"""Hand-made parameter-server requests for the adversarial tests of ranks, jobs and memory
(test_psid_*.py): what a peer that is not a ``ps.Worker`` can send, on a connection of its own.
Each names a job: ``JOB`` unless told (a ``ps.Worker``'s is ``worker.job``)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence

import torch

from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

JOB = "psid-kit"
SESSION = secrets.randbits(63) | 1  # the kit's own worker process, where a test names none


def call(
    url: str, opcode: Opcode, body: bytes, data: Sequence[torch.Tensor] = (), *, answer_has_data: bool = False
) -> bytes:
    """One request on a new connection; the answer's metadata (after its records, when
    ``answer_has_data``: a pull's values land in throwaway buffers). Errors raise as their types."""

    def land(metas: list[TensorMeta]) -> list[memoryview]:
        return [byte_view(torch.empty(m.nbytes, dtype=torch.uint8)) for m in metas]

    async def go() -> bytes:
        conn = await transports.open_transport(Address.parse(url), transports.TransportOptions(5.0, 20.0))
        try:
            assert isinstance(conn, FramedTransport)
            views = [byte_view(t.contiguous()) for t in data]
            sink = land if answer_has_data else None
            reader = await conn.call(opcode, body, views, sink, what=f"a hand-made {opcode.name}")
            return reader.raw(reader.remaining)
        finally:
            await conn.close()

    return run(go())


def flat_metas(shards: Sequence[tuple[str, int]]) -> list[TensorMeta]:
    """Float32 records of ``(key, elements)`` shards."""
    return [TensorMeta(key, torch.float32, (n,), 4 * n) for key, n in shards]


def config(mode: str = "async", **optimizer: object) -> str:
    return json.dumps({"mode": mode, "optimizer": {"kind": "sgd", **optimizer}})


def join(url: str, worker: int, world: int, incarnation: int, job: str = JOB) -> None:
    call(url, Opcode.PS_JOIN, wps.PsHead(worker, world, 0, incarnation, 5000, job).encode())


def init(
    url: str,
    worker: int,
    world: int,
    cfg: str,
    values: dict[str, torch.Tensor],
    *,
    job: str = JOB,
    incarnation: int | None = None,
) -> None:
    """PS_INIT as the session ``incarnation`` that joined as ``worker`` (None: join first as the
    kit's own session, as a worker does)."""
    if incarnation is None:
        incarnation = SESSION
        join(url, worker, world, incarnation, job)
    metas = flat_metas([(key, t.numel()) for key, t in values.items()])
    head = wps.PsHead(worker, world, 0, incarnation, 5000, job).encode()
    body = head + wps.encode_config(cfg) + wm.encode_records(metas)
    call(url, Opcode.PS_INIT, body, list(values.values()))


def push(
    url: str,
    grads: dict[str, torch.Tensor],
    *,
    worker: int = 0,
    world: int = 1,
    seq: int = 1,
    incarnation: int,
    clock: int = 0,
    codec: str | None = None,
    payloads: Sequence[torch.Tensor] | None = None,
    job: str = JOB,
) -> bytes:
    """PS_PUSH as ``worker`` claiming ``incarnation`` (0: none, as a frame of an older worker)."""
    metas = flat_metas([(key, t.numel()) for key, t in grads.items()])
    tail = wps.encode_push_tail(codec, incarnation) if incarnation else wps.encode_codec(codec)
    body = wps.PsHead(worker, world, clock, seq, 5000, job).encode() + wm.encode_records(metas) + tail
    return call(url, Opcode.PS_PUSH, body, list(payloads) if payloads is not None else list(grads.values()))


def pull(
    url: str, worker: int, keys: Sequence[str], incarnation: int, *, codec: str | None = None, job: str = JOB
) -> bytes:
    body = wps.PsHead(worker, 1, 0, incarnation, 5000, job).encode() + wm.encode_names(keys)
    return call(url, Opcode.PS_PULL, body + wps.encode_codec(codec), answer_has_data=True)
