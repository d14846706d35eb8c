"""The relay's metadata blocks and chunk layout (wire/relay.py) and its tables (broadcast/chains.py)."""

from __future__ import annotations

import pytest
import torch

from tensorwire.broadcast.chains import ORIGIN, Chains, Owner
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr


def _manifest(generation: int = 3) -> wr.Manifest:
    metas = (
        TensorMeta("p/a", torch.uint8, (0,), 0, generation),  # empty: no chunks
        TensorMeta("p/b", torch.uint8, (25,), 25, generation),  # chunks 0, 1, 2
        TensorMeta("p/c", torch.uint8, (15,), 15, generation),  # chunks 3, 4
    )
    return wr.Manifest(generation, 10, metas, (1, 2, 3, 4, 5))


def test_chunks_are_numbered_across_tensors_and_a_span_stays_in_one() -> None:
    m = _manifest()
    assert m.chunks == 5 and m.nbytes == 40
    assert m.locate(0) == (1, 0, 3) and m.locate(2) == (1, 20, 1) and m.locate(3) == (2, 0, 2)
    assert m.span(1, 64) == (1, 10, 15)  # to the end of "p/b", its last chunk short
    with pytest.raises(ProtocolError):
        m.locate(5)
    with pytest.raises(ProtocolError):
        wr.Manifest(1, 10, m.metas, (1, 2))  # checksums do not match the chunks


def test_join_answer_round_trips_and_its_chunk_count_is_bounded() -> None:
    m = _manifest()
    raw = wr.encode_join_reply(m, wr.Placement(7, 5, "tcp://10.0.0.2:4000"))
    got, placement = wr.decode_join_reply(wm.MetaReader(raw, Limits()), 1 << 20)
    assert got == m and placement == wr.Placement(7, 5, "tcp://10.0.0.2:4000")
    with pytest.raises(LimitExceeded):
        wr.decode_join_reply(wm.MetaReader(raw, Limits()), 4)
    with pytest.raises(ProtocolError):
        wr.decode_join_reply(wm.MetaReader(raw[:-3], Limits()), 1 << 20)


def test_requests_round_trip() -> None:
    def reader(raw: bytes) -> wm.MetaReader:
        return wm.MetaReader(raw, Limits())

    assert wr.decode_join(reader(wr.encode_join("p", 2, "tcp://h:1"))) == ("p", 2, "tcp://h:1")
    assert wr.decode_get(reader(wr.encode_get("p", 2, 9, 4, 100))) == ("p", 2, 9, 4, 100)
    report = wr.encode_report("p", 2, 7, wr.Report.FAILED, 5)
    assert wr.decode_report(reader(report)) == ("p", 2, 7, wr.Report.FAILED, 5)
    with pytest.raises(ProtocolError):
        wr.decode_get(reader(wr.encode_get("p", 2, 9, 0, 100)))  # no chunks asked for
    with pytest.raises(ProtocolError):
        wr.decode_report(reader(report[:-9] + bytes([9]) + report[-8:]))  # unknown kind


def test_chains_string_readers_and_route_around_the_dropped() -> None:
    chains = Chains(max_chain=3)
    gen = chains.generation("p", _manifest())
    owners = [Owner() for _ in range(4)]
    a, b, c, d = (chains.join("p", gen, f"tcp://h:{i}", owners[i - 1]) for i in range(1, 5))
    assert a and b and c and d
    assert (a.upstream, b.upstream, c.upstream, d.upstream) == (ORIGIN, a.id, b.id, ORIGIN)
    # c's upstream failed: b is dropped, and c reads from the origin (not from b's upstream).
    assert chains.failed("p", gen, c, b.id) == wr.Placement(c.id, ORIGIN, "")
    assert b.id not in gen.readers and gen.dropped == 1
    chains.leave(gen, a.id)
    assert gen.readers[c.id].upstream == ORIGIN
    newer = chains.generation("p", _manifest(4))
    chains.join("p", newer, "tcp://h:3", owners[2])  # c's owner joins the newer generation: c leaves
    assert c.id not in gen.readers
    chains.drop_owner(owners[3])  # d's connection closed before it was done
    assert d.id not in gen.readers and gen.dropped == 2 and chains.addresses() == 1
