"""SHM_GEN_VIEW (docs/protocol.md §16) against peers that misbehave: a connection may pin at most
--leases-per-connection generations (64 by default), and what it pinned ends with it (tainted);
the opcode is refused on a tcp:// listener; a client refuses answers that name other tensors,
another prefix, segments without a lease, or a segment that cannot hold what the answer says."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import transport
from tensorwire._aio import run
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.server import ServerThread
from tensorwire.server import shm as server_shm
from tensorwire.server.request import extension_of
from tensorwire.store.generation_config import DEFAULT_LEASES_PER_OWNER as MAX_GENERATION_VIEWS
from tensorwire.testing.process import wait_for
from tensorwire.transport import TransportOptions
from tensorwire.transport.shm import ShmTransport
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode

PREFIX = "policy"
OPTIONS = TransportOptions(5.0, 5.0)


@pytest.fixture(scope="module")
def served() -> Iterator[ServerThread]:
    """A server on tcp:// (to publish) and shm:// (to view), with one generation of PREFIX."""
    with ServerThread(["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]) as srv:
        with tensorwire.connect(srv.url) as client:
            client.publish(PREFIX, {"w": torch.arange(1 << 15, dtype=torch.float32), "b": torch.ones(3)})
        yield srv


def shm_url(srv: ServerThread) -> str:
    return next(str(a) for a in srv.addresses if a.scheme == "shm")


async def _open(srv: ServerThread) -> ShmTransport:
    opened = await transport.open_transport(tensorwire.Address.parse(shm_url(srv)), OPTIONS)
    assert isinstance(opened, ShmTransport)
    return opened


def test_a_connection_pins_a_bounded_number_of_generations_and_its_pins_end_with_it(
    served: ServerThread,
) -> None:
    generations = served.server.generations

    async def pin_too_many() -> None:
        views = await _open(served)
        held = [await views.view_generation(PREFIX, 0) for _ in range(MAX_GENERATION_VIEWS)]
        with pytest.raises(
            LimitExceeded, match="generations with views: at most 64 \\(--leases-per-connection\\)"
        ):
            await views.view_generation(PREFIX, 0)
        assert len(held) == MAX_GENERATION_VIEWS
        await views.close()  # the held views outlive the connection: their segments are tainted

    run(pin_too_many())
    wait_for(lambda: generations.find(PREFIX, 0).pins == 0, 10, "the closed connection's pins to end")
    pool = _service(served).pool
    assert any(segment.tainted for segment in pool._live.values())


def _service(served: ServerThread) -> server_shm.ShmService:
    service = extension_of(served.server.extensions, server_shm.ShmService)
    assert service is not None
    return service


def test_generation_views_are_refused_on_a_tcp_listener(served: ServerThread) -> None:
    async def over_tcp() -> None:
        channel = await transport.open_channel(served.url, OPTIONS, what="a stranger")
        try:
            with pytest.raises(ProtocolError, match="only on the shm:// listener"):
                await channel.call(
                    Opcode.SHM_GEN_VIEW, ws.encode_view_request(PREFIX, 0), what="SHM_GEN_VIEW"
                )
        finally:
            await channel.close()

    run(over_tcp())


def test_a_leased_segment_that_cannot_hold_the_answers_tensor_is_refused(served: ServerThread) -> None:
    segment = next(iter(_service(served).pool._live.values()))
    too_big = TensorMeta(f"{PREFIX}/w", torch.uint8, (segment.capacity + 1,), segment.capacity + 1)
    stale = TensorMeta(f"{PREFIX}/w", torch.uint8, (16,), 16)

    async def map_them() -> None:
        views = await _open(served)
        try:
            for meta, generation in ((too_big, segment.generation), (stale, segment.generation + 1)):
                with pytest.raises(ProtocolError, match="holds something else"):
                    views._pages(ws.SegmentRef(0, meta, segment.name, generation))
        finally:
            await views.close()

    run(map_them())


GEN = Generation(PREFIX, 3, bytes(16), (f"{PREFIX}/a", f"{PREFIX}/b"), 0)
SEGMENT = "tensorwire-1-2-ab-3"


def _meta(name: str, nbytes: int = 4) -> TensorMeta:
    return TensorMeta(name, torch.uint8, (nbytes,), nbytes, 3)


def _answer(
    gen: Generation, inline: list[TensorMeta], refs: list[ws.SegmentRef], lease: int
) -> wm.MetaReader:
    body = ws.encode_view_answer(gen, inline, refs, lease)
    reader = wm.MetaReader(body, tensorwire.Limits())
    assert wm.decode_records(reader) == inline
    return reader


@pytest.mark.parametrize(
    ("gen", "inline", "refs", "lease", "match"),
    [
        (
            dataclasses.replace(GEN, prefix="other"),
            [_meta(GEN.names[0]), _meta(GEN.names[1])],
            [],
            0,
            "generation 3 of 'other'",
        ),
        (
            GEN,
            [_meta(GEN.names[0])],
            [ws.SegmentRef(1, _meta(GEN.names[0]), SEGMENT, 1)],
            7,
            "named for another",
        ),
        (
            GEN,
            [_meta(GEN.names[1])],
            [ws.SegmentRef(1, _meta(GEN.names[1]), SEGMENT, 1)],
            7,
            "inline records",
        ),
        (GEN, [_meta(GEN.names[0])], [], 0, "inline records"),
        (GEN, [_meta(GEN.names[0])], [ws.SegmentRef(1, _meta(GEN.names[1]), SEGMENT, 1)], 0, "no lease"),
    ],
)
def test_a_view_answer_that_does_not_add_up_is_refused(
    gen: Generation, inline: list[TensorMeta], refs: list[ws.SegmentRef], lease: int, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        ws.decode_view_answer(_answer(gen, inline, refs, lease), inline, PREFIX)


def test_a_view_answer_that_adds_up_is_taken() -> None:
    inline = [_meta(GEN.names[0])]
    refs = [ws.SegmentRef(1, _meta(GEN.names[1]), SEGMENT, 1)]
    answer = ws.decode_view_answer(_answer(GEN, inline, refs, 7), inline, PREFIX)
    assert answer.inline == [0] and answer.refs == refs and answer.lease == 7
