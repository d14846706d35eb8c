"""DIGEST: a server hashes tensors it holds, so a sender can check what landed without reading it back.

The per-chunk checksums of the protocol prove that each transfer arrived intact; a digest proves,
after the fact and end to end, that the bytes a server holds now are the bytes a source file holds
(``tensorwire dataset scatter`` compares the two before skipping an item and after sending one).

Wire (docs/protocol.md §14): the request's metadata is ``u8 checksum kind | names`` (as STAT);
the answer is ``u32 count`` then, for each requested name the server holds, a tensor record
(name, dtype, shape, nbytes, version) and a ``u64`` digest of its bytes. Names it does not hold
are left out (no error): "not there" is an ordinary answer for a resuming sender.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import KeyNotFound, ProtocolError
from tensorwire.server.core import Handler, Request
from tensorwire.store import TensorStore
from tensorwire.transport.base import FrameChannel
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Opcode

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Hash on the event loop below this many bytes (a thread hop costs more than the hash).
_INLINE_BYTES = 1 << 20
_KINDS = frozenset(int(k) for k in ChecksumKind)


@dataclass(frozen=True, slots=True)
class Digest:
    """What a server holds under a name: its metadata and a checksum of its bytes."""

    meta: TensorMeta
    value: int


def encode_request(names: Sequence[str], kind: ChecksumKind = ChecksumKind.XXH3_64) -> bytes:
    return _U8.pack(kind) + wm.encode_names(names)


def decode_answer(reader: wm.MetaReader) -> dict[str, Digest]:
    found: dict[str, Digest] = {}
    for _ in range(reader.count()):
        meta = reader.record()
        found[meta.name] = Digest(meta, reader.u64())
    reader.done()
    return found


async def fetch_digests(
    conn: FrameChannel, names: Sequence[str], kind: ChecksumKind = ChecksumKind.XXH3_64
) -> dict[str, Digest]:
    """Digests of those of ``names`` the server holds (in batches its limits accept)."""
    found: dict[str, Digest] = {}
    step = 4096
    for i in range(0, len(names), step):
        part = names[i : i + step]
        what = f"the digests of {len(part)} tensors ({part[0]!r}...)"
        reader = await conn.call(Opcode.DIGEST, encode_request(part, kind), what=what)
        found.update(decode_answer(reader))
    return found


class DigestService:
    """The server side: an ``Extension`` of a ``Server`` over ``store`` (``tensorwire serve`` adds it)."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {Opcode.DIGEST: self._on_digest}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        return None

    async def _on_digest(self, request: Request) -> None:
        if request.header.data_len:
            raise ProtocolError(f"DIGEST carries no data, but the frame has {request.header.data_len} bytes")
        kind = request.meta.u8()
        if kind not in _KINDS:
            raise ProtocolError(f"DIGEST asks for checksum kind {kind}; known kinds are {sorted(_KINDS)}")
        names = wm.decode_names(request.meta)
        request.meta.done()
        answer = [_U32.pack(0)]
        count = 0
        for name in dict.fromkeys(names):
            try:
                (entry,) = self.store.acquire([name])  # pinned: a concurrent delete cannot reuse it
            except KeyNotFound:
                continue
            try:
                data = entry.data[: entry.meta.nbytes]
                if len(data) < _INLINE_BYTES:
                    value = checksum(kind, data)
                else:  # xxhash releases the GIL: the loop keeps serving while a large tensor hashes
                    value = await asyncio.to_thread(checksum, kind, data)
            finally:
                self.store.release([entry])
            answer.append(wm.encode_record(entry.meta) + _U64.pack(value))
            count += 1
        answer[0] = _U32.pack(count)
        await request.reply(b"".join(answer))
