"""DIGEST: a server hashes tensors it holds, so a sender can check what landed without reading it back.

The per-chunk checksums of the protocol prove that each transfer arrived intact; a digest proves,
after the fact and end to end, that the bytes a server holds now are the bytes a source file holds
(``tensorwire dataset scatter`` compares the two before skipping an item and after sending one).

Wire (docs/protocol.md §14): the request's metadata is ``u8 checksum kind | names`` (as STAT);
the answer is ``u32 count`` then, for each requested name the server holds, a tensor record
(name, dtype, shape, nbytes, version) and a ``u64`` digest of its bytes. Names it does not hold
are left out (no error): "not there" is an ordinary answer for a resuming sender.

Bounds, on both sides of a peer: a request names at most ``MAX_NAMES`` tensors, and its answer
must fit the server's metadata limit (``Limits.max_meta_bytes``), else LimitExceeded. Hashing runs
on the service's own few threads (``hash_threads``), so a flood of DIGESTs queues behind itself
and never takes the threads the store's commits use; a tensor stays pinned until its hash is done,
even when the request that asked is cut off meanwhile (its bytes are not reused under the hash),
and the queued hash of a request cut off before it started is dropped with its pin.
A sender accepts an answer only of names it asked for, each once.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tensorwire.errors import KeyNotFound, LimitExceeded, ProtocolError
from tensorwire.server.core import Handler, Request
from tensorwire.store import Entry, TensorStore
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
MAX_NAMES = 4096  # names one DIGEST may ask for (a sender asks in batches of this many)


@dataclass(frozen=True, slots=True)
class Digest:
    """What a server holds under a name: its metadata and a checksum of its bytes."""

    meta: TensorMeta
    value: int


def encode_request(names: Sequence[str], kind: ChecksumKind = ChecksumKind.XXH3_64) -> bytes:
    return _U8.pack(kind) + wm.encode_names(names)


def decode_answer(reader: wm.MetaReader, asked: Sequence[str]) -> dict[str, Digest]:
    """The digests of an answer to a request for ``asked``: ProtocolError if it names a tensor
    that was not asked for, or one twice (what a sender skips must be what it asked about)."""
    wanted = set(asked)
    count = reader.count()
    if count > len(wanted):
        raise ProtocolError(f"a DIGEST answer of {count} tensors, for {len(wanted)} names asked")
    found: dict[str, Digest] = {}
    for _ in range(count):
        meta = reader.record()
        if meta.name not in wanted or meta.name in found:
            raise ProtocolError(f"a DIGEST answer names {meta.name[:200]!r}, not asked for (or twice)")
        found[meta.name] = Digest(meta, reader.u64())
    reader.done()
    return found


async def fetch_digests(
    conn: FrameChannel, names: Sequence[str], kind: ChecksumKind = ChecksumKind.XXH3_64
) -> dict[str, Digest]:
    """Digests of those of ``names`` the server holds (in batches its limits accept)."""
    found: dict[str, Digest] = {}
    for i in range(0, len(names), MAX_NAMES):
        part = names[i : i + MAX_NAMES]
        what = f"the digests of {len(part)} tensors ({part[0]!r}...)"
        reader = await conn.call(Opcode.DIGEST, encode_request(part, kind), what=what)
        found.update(decode_answer(reader, part))
    return found


class DigestService:
    """The server side: an ``Extension`` of a ``Server`` over ``store`` (``tensorwire serve`` adds it).
    ``hash_threads``: how many large tensors are hashed at once, server-wide."""

    def __init__(self, store: TensorStore, hash_threads: int = 2) -> None:
        if hash_threads < 1:
            raise ValueError(f"hash_threads must be at least 1, not {hash_threads}")
        self.store = store
        self._pool = ThreadPoolExecutor(hash_threads, thread_name_prefix="tw-digest")

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {Opcode.DIGEST: self._on_digest}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # queued hashes release their pins

    async def _on_digest(self, request: Request) -> None:
        if request.header.data_len:
            raise ProtocolError(f"DIGEST carries no data, but the frame has {request.header.data_len} bytes")
        kind = request.meta.u8()
        if kind not in _KINDS:
            raise ProtocolError(f"DIGEST asks for checksum kind {kind}; known kinds are {sorted(_KINDS)}")
        asked = request.meta.peek_count()
        if asked > MAX_NAMES:
            raise LimitExceeded(f"DIGEST asks for {asked} names; at most {MAX_NAMES} a request")
        names = wm.decode_names(request.meta)
        request.meta.done()
        limit = request.connection.limits.max_meta_bytes
        answer = [_U32.pack(0)]
        size = _U32.size
        for name in dict.fromkeys(names):
            try:
                (entry,) = self.store.acquire([name])  # pinned: a concurrent delete cannot reuse it
            except KeyNotFound:
                continue
            value = await self._hash(entry, ChecksumKind(kind))  # releases the pin
            answer.append(wm.encode_record(entry.meta) + _U64.pack(value))
            size += len(answer[-1])
            if size > limit:  # ~1.3 KB a record at most: only names near the limits get here
                raise LimitExceeded(
                    f"a DIGEST answer over the server's {limit}-byte metadata limit: ask for fewer"
                )
        answer[0] = _U32.pack(len(answer) - 1)
        await request.reply(b"".join(answer))

    async def _hash(self, entry: Entry, kind: ChecksumKind) -> int:
        """The checksum of a pinned entry's bytes; the pin is released once the hash is done (not
        when a cancelled request stops waiting for it: the thread still reads those bytes)."""
        data = entry.data[: entry.meta.nbytes]
        if len(data) < _INLINE_BYTES:
            try:
                return checksum(kind, data)
            finally:
                self.store.release([entry])
        # xxhash releases the GIL: the loop keeps serving while a large tensor hashes. The pin goes
        # with the job itself: at once if a cut-off request's job had not started (cancelled in
        # the queue), else when the thread is done with the bytes.
        job = self._pool.submit(checksum, kind, data)
        job.add_done_callback(lambda _: self.store.release([entry]))
        return await asyncio.wrap_future(job)  # cancelling this cancels a job not yet started
