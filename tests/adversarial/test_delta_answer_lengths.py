"""A GEN_GET_DELTA answer's per-chunk delta lengths are the server's word: a hostile one may claim a
delta of no bytes, one longer than the chunk's full form, or lengths that do not add up to the data
it sent. The client refuses such an answer as a whole (ProtocolError) before it applies a byte to
``out``, rather than slicing the data by lengths it cannot trust (wire/delta_reads.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
import torch

import tensorwire
from tensorwire.errors import ProtocolError
from tensorwire.server import ServerThread, delta_answers
from tensorwire.store.generations import Kept
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import delta_reads as dr
from tensorwire.wire import meta as wm

Built = tuple[dr.DeltaAnswer, list[memoryview]]


def lying(lengths: tuple[int, ...], data: bytes) -> Callable[..., Built]:
    """A ``build`` that answers the one tensor with ``lengths`` and ``data`` instead."""
    real = delta_answers.build

    def build(
        new: Kept, base: Kept | None, pairs: Sequence[tuple[TensorMeta, memoryview]], *rest: object
    ) -> Built:
        answer, _ = real(new, base, pairs)
        tensor = replace(answer.tensors[0], lengths=lengths)
        return replace(answer, tensors=(tensor,)), [memoryview(data)]

    return build


@pytest.mark.parametrize(
    ("lengths", "data", "refused"),
    [
        ((0,), b"", "a delta of 0 bytes"),  # an empty delta
        ((70,), b"\x00" * 70, "a delta of 70 bytes"),  # longer than the chunk's FULL form (41)
        ((200,), b"\x00" * 200, "more than its full size"),  # refused before it is allocated
    ],
    ids=["empty", "longer-than-full", "over-the-sink-bound"],
)
def test_lying_delta_lengths_are_refused(
    monkeypatch: pytest.MonkeyPatch, lengths: tuple[int, ...], data: bytes, refused: str
) -> None:
    with ServerThread() as srv, tensorwire.connect(srv.url, retries=0) as c:
        c.publish("m", {"x": torch.arange(10.0)})
        c.publish("m", {"x": torch.arange(10.0) + 1})
        out = c.get_many(["m/x"], at=1)
        monkeypatch.setattr(delta_answers, "build", lying(lengths, data))
        with pytest.raises(ProtocolError, match=refused):
            c.get_many(["m/x"], at=2, base=1, out=out)
        assert torch.equal(out["m/x"], torch.arange(10.0))  # nothing applied
        assert c.delta_stats.refetched == 0


def test_lengths_that_do_not_add_up_or_miss_a_chunk_are_refused() -> None:
    meta = TensorMeta("m/x", torch.float32, (10,), 40, 2)
    honest = dr.DeltaAnswer("m", 2, b"\x00" * 16, 1, 1, 16, (dr.TensorDelta(meta, (9, 9, 9), (1, 2, 3)),))

    def decode(answer: dr.DeltaAnswer, data_bytes: int) -> dr.DeltaAnswer:
        reader = wm.MetaReader(dr.encode_answer(answer), Limits())
        records = wm.decode_records(reader)
        records = [TensorMeta(records[0].name, torch.uint8, (data_bytes,), data_bytes, 2)]
        return dr.decode_answer(reader, records)

    assert decode(honest, 27).tensors[0].lengths == (9, 9, 9)
    with pytest.raises(ProtocolError, match="add up to 27 bytes, not 30"):
        decode(honest, 30)
    short = replace(honest, tensors=(dr.TensorDelta(meta, (9, 9), (1, 2)),))
    with pytest.raises(ProtocolError, match="2 chunks, not one entry per chunk"):
        decode(short, 18)
