"""What one put or get carries on the client's side: ``TensorBatch``, the tensors of a put, checked
before a byte is sent and encoded part by part as the transport asks (``PutBatch``); ``Landing``,
where a get's bytes land (the caller's ``out`` tensors, or new ones)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tensorwire._gc import gc_paused
from tensorwire.errors import InvalidTensor, ProtocolError
from tensorwire.types import TensorMeta
from tensorwire.wire.names import validate_name
from tensorwire.wire.tensors import byte_view, check_out, empty_for, sendable


class Landing:
    """Where a GET's bytes land: the caller's ``out`` tensors, or new tensors."""

    def __init__(self, names: list[str], outs: Mapping[str, torch.Tensor]) -> None:
        self.names = names
        self.outs = outs
        self.results: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, non-contiguous out)

    def reset(self) -> None:
        """Forget a failed attempt's landing places before a retry."""
        self.results.clear()
        self.staged.clear()

    def sink(self, metas: list[TensorMeta]) -> list[memoryview]:
        if len(metas) == 1:  # skip the list building and GC pause of the batch path
            if metas[0].name != self.names[0] or len(self.names) != 1:
                raise ProtocolError("the server answered for another tensor than the one asked for")
            return [self._land(metas[0])]
        if [m.name for m in metas] != self.names:
            raise ProtocolError("the server answered for other tensors than the ones asked for")
        with gc_paused():
            return [self._land(meta) for meta in metas]

    def _land(self, meta: TensorMeta) -> memoryview:
        self.versions[meta.name] = meta.version
        out = self.outs.get(meta.name)
        if out is None:
            target = empty_for(meta)
            self.results[meta.name] = target
            return byte_view(target)
        check_out(meta, out)
        self.results[meta.name] = out
        if out.is_contiguous():
            return byte_view(out)
        staged = empty_for(meta)  # a strided out is filled from a contiguous copy after the transfer
        self.staged.append((staged, out))
        return byte_view(staged)

    def finish(self) -> dict[str, torch.Tensor]:
        for received, out in self.staged:
            out.copy_(received)
        return self.results


class TensorBatch:
    """The tensors of one put, checked now and encoded part by part as the transport sends them
    (see ``PutBatch``). Parts of ``PART_TENSORS`` let the server decode one part while this side
    encodes the next: on a 10,000-tensor batch that hides most of the client's share."""

    PART_TENSORS = 1024

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        with gc_paused():
            for name, tensor in pairs:  # every refusal happens before a byte is sent
                validate_name(name)
                if tensor.dim() > 255:
                    raise InvalidTensor(f"{name!r}: {tensor.dim()} dims cannot be sent (max 255)")
            self.tensors = [sendable(tensor, name) for name, tensor in pairs]
        self.names: Sequence[str] = [name for name, _ in pairs]
        self.parts = -(-len(pairs) // self.PART_TENSORS)
        self._encoded: dict[int, tuple[list[TensorMeta], list[memoryview]]] = {}

    def part(self, index: int) -> tuple[list[TensorMeta], list[memoryview]]:
        encoded = self._encoded.get(index)
        if encoded is None:
            lo = index * self.PART_TENSORS
            hi = lo + self.PART_TENSORS
            with gc_paused():
                views = [byte_view(t) for t in self.tensors[lo:hi]]  # each keeps its tensor alive
                metas = [
                    TensorMeta(name, t.dtype, tuple(t.shape), v.nbytes)
                    for name, t, v in zip(self.names[lo:hi], self.tensors[lo:hi], views, strict=True)
                ]
            encoded = self._encoded[index] = (metas, views)
        return encoded
