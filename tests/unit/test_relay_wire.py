"""The relay's metadata blocks and chunk layout (wire/relay.py) and its tables (broadcast/chains.py)."""

from __future__ import annotations

import pytest
import torch

from tensorwire.broadcast.chains import MAX_SESSIONS, ORIGIN, Chains, Owner
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

    assert wr.decode_join(reader(wr.encode_join("p", 2, "tcp://h:1"))) == ("p", 2, "tcp://h:1", 0)
    assert wr.decode_join(reader(wr.encode_join("p", 2, "", 1 << 62))) == ("p", 2, "", 1 << 62)
    assert wr.encode_join("p", 2, "") == wr.encode_join("p", 2, "", 0)  # no session: as before it
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
    assert gen is not None
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
    assert newer is not None
    chains.join("p", newer, "tcp://h:3", owners[2])  # c's owner joins the newer generation: c leaves
    assert c.id not in gen.readers
    chains.drop_owner(owners[3])  # d's connection closed before it was done
    assert d.id not in gen.readers and gen.dropped == 2 and chains.addresses() == 1


def test_a_join_that_registers_nothing_makes_no_table() -> None:
    chains = Chains(max_prefixes=2)
    assert chains.generation("p", _manifest(), make=False) is None
    assert chains.stats("p")["generations"] == [] and chains.readers_by_prefix() == {}


def test_tables_with_readers_are_never_evicted_for_a_new_prefix() -> None:
    chains, owner = Chains(max_prefixes=2), Owner()
    live = chains.generation("_ps/job", _manifest())
    empty = chains.generation("q", _manifest())
    assert live is not None and empty is not None
    chains.join("_ps/job", live, "tcp://h:1", owner)
    # A third prefix takes the place of the table without readers, never of the one with them.
    assert chains.generation("r", _manifest()) is not None
    assert set(chains.readers_by_prefix()) == {"_ps/job", "r"}
    third = chains.generation("r", _manifest())
    assert third is not None
    chains.join("r", third, "tcp://h:2", Owner())
    # Every table has readers now: a fourth prefix gets none (its readers read from the origin).
    assert chains.generation("s", _manifest()) is None
    assert chains.readers_by_prefix() == {"_ps/job": 1, "r": 1}


def test_an_upstream_rerouted_itself_is_spared_the_first_report_against_it() -> None:
    chains = Chains()
    gen = chains.generation("p", _manifest())
    assert gen is not None
    a, b, c, d = (chains.join("p", gen, f"tcp://h:{i}", Owner()) for i in range(1, 5))
    assert a and b and c and d
    chains.failed("p", gen, b, a.id)  # b waited on a: a is dropped, b reads from the origin
    assert a.id not in gen.readers and b.rerouted and gen.dropped == 1
    # c waited on b meanwhile (b had nothing to forward yet): b stays, c reads from the origin.
    assert chains.failed("p", gen, c, b.id) == wr.Placement(c.id, ORIGIN, "")
    assert b.id in gen.readers and gen.dropped == 1 and c.rerouted
    assert not b.rerouted  # spared once: the next report against it drops it
    chains.failed("p", gen, d, c.id)
    assert c.id in gen.readers and not c.rerouted
    e = chains.join("p", gen, "tcp://h:5", d.owner)  # d's owner joins again: behind the tail
    assert e is not None and e.upstream == c.id
    chains.failed("p", gen, e, c.id)
    assert c.id not in gen.readers and gen.dropped == 2


def test_admitted_sessions_are_per_prefix_bounded_and_forgotten() -> None:
    chains = Chains()
    chains.admit("_ps/a", 7)
    assert chains.admitted("_ps/a", 7) and not chains.admitted("_ps/b", 7) and not chains.admitted("_ps/a", 0)
    for session in range(1, MAX_SESSIONS + 2):
        chains.admit("_ps/b", session)
    assert not chains.admitted("_ps/a", 7) and chains.admitted("_ps/b", MAX_SESSIONS + 1)
    chains.forget("_ps/b")
    assert not chains.admitted("_ps/b", MAX_SESSIONS + 1)
