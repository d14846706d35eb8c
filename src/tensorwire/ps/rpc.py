"""The parameter-server protocol, typed: ``PsChannel`` builds every PS request in one place.

docs/protocol.md §13.2 (and ``tensorwire.wire.ps``) define the requests: a 28-byte head
(``worker | world | clock | seq | wait_ms``), then each opcode's own fields. A ``PsChannel`` wraps
one ``Caller`` (anything with the frame channel's ``call``: a ``FrameChannel`` connection, or a
worker's ``ServerSlot``, which resends on a new connection) and turns each request into one method
with typed arguments and a decoded answer. It opens, retries and closes nothing itself.

Lifecycle: the owner of a channel builds a ``PsChannel`` around it with the ``Sender`` its
requests come from (rank, world, how long the server may wait), calls its methods (any number,
concurrently if the channel allows), and closes the channel itself when done.

Connections come from ``tensorwire.transport.open_channel`` (the one place that opens and checks
a channel of the frame protocol), here and in the worker's slots and the exchange client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import ProtocolError
from tensorwire.security import Security, client_token
from tensorwire.transport.base import Sink
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode


class Caller(Protocol):
    """What a ``PsChannel`` needs of what is under it: one framed request, the answer's metadata
    back (``FrameChannel.call``; see there for ``sink`` and ``timeout``)."""

    async def call(
        self,
        opcode: int,
        meta: bytes,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        *,
        what: str,
        timeout: float | None = None,
    ) -> wm.MetaReader: ...


class Sender(NamedTuple):
    """Who the requests of one ``PsChannel`` come from: the head's fields that do not change
    from request to request (``clock`` and ``seq`` are each request's own)."""

    worker: int = wps.OBSERVER  # the rank, or OBSERVER for a reader that takes no part
    world: int = 0
    wait_ms: int = 0  # how long the server may wait on other workers (0: its own default)


class PsChannel:
    """The parameter-server requests over one ``FrameChannel`` (see the module doc).

    ``peer`` names the server in errors; ``label`` is added to each request's opcode name to say
    what it is in the channel's errors and logs (a worker's: `` from worker 0 to tcp://...``).
    """

    def __init__(self, channel: Caller, sender: Sender, *, peer: str = "", label: str = "") -> None:
        self.channel = channel
        self.sender = sender
        self.peer = peer
        self.label = label

    async def join(
        self, clock: int, incarnation: int, config: str, records: Sequence[TensorMeta]
    ) -> tuple[int, bool, int]:
        """PS_JOIN with the job as this worker sees it: (clock, initialized, last applied seq)."""
        # The job as this worker sees it: a server running another one refuses before admitting it.
        job = wps.encode_config(config) + wm.encode_records(records)
        reader = await self._call(Opcode.PS_JOIN, clock, incarnation, job)
        reply = wps.decode_join_reply(reader)
        reader.done()
        return reply

    async def init(
        self, clock: int, config: str, records: Sequence[TensorMeta], data: Sequence[memoryview]
    ) -> tuple[bool, int]:
        """PS_INIT: create the job with ``data`` as its values, or (no data) check it is this one."""
        body = wps.encode_config(config) + wm.encode_records(records)
        reader = await self._call(Opcode.PS_INIT, clock, 0, body, data)
        reply = wps.decode_init_reply(reader)
        reader.done()
        return reply

    async def leave(
        self, clock: int, incarnation: int, *, what: str | None = None, timeout: float | None = None
    ) -> None:
        """PS_LEAVE: no step and no allreduce round waits for this rank any more."""
        await self._call(Opcode.PS_LEAVE, clock, incarnation, b"", what=what, timeout=timeout)

    async def push(
        self,
        clock: int,
        seq: int,
        records: Sequence[TensorMeta],
        data: Sequence[memoryview],
        *,
        codec: str | None,
        incarnation: int,
        acked: Callable[[], None],
    ) -> tuple[int, int]:
        """PS_PUSH number ``seq``: (version, staleness). ``acked`` runs as soon as the server has
        answered, before its answer is read: from then on the push is the server's (sending it
        again would be a duplicate), whatever the answer holds."""
        body = wm.encode_records(records) + wps.encode_push_tail(codec, incarnation)
        reader = await self._call(Opcode.PS_PUSH, clock, seq, body, data)
        acked()
        reply = wps.decode_push_reply(reader)
        reader.done()
        return reply

    async def pull(
        self, clock: int, session: int, keys: Sequence[str], sink: Sink, codec: str | None = None
    ) -> int:
        """PS_PULL of ``keys`` (in ``codec`` where given), landing through ``sink``: the version."""
        body = wm.encode_names(keys) + wps.encode_codec(codec)
        reader = await self._call(Opcode.PS_PULL, clock, session, body, sink=sink)
        version = wps.decode_u64(reader)
        if codec is not None and wps.decode_codec(reader) != codec:
            raise ProtocolError(f"{self.peer} answered a {codec} pull in another codec")
        reader.done()
        return version

    async def heartbeat(self, clock: int, incarnation: int) -> None:
        """PS_HEARTBEAT: this rank is alive (a server that dropped it is rejoined by the next
        push or pull, not here)."""
        await self._call(Opcode.PS_HEARTBEAT, clock, incarnation, b"", what="a heartbeat")

    async def rollback(self, version: int) -> int:
        """PS_ROLLBACK to the server's checkpoint of ``version``: the version it is at now."""
        reader = await self._call(Opcode.PS_ROLLBACK, version, 0, b"")
        now = wps.decode_u64(reader)
        reader.done()
        return now

    async def stats(self, clock: int = 0) -> dict[str, Any]:
        """PS_STATS: the server's view of the job (mode, step, workers' clocks, staleness)."""
        reader = await self._call(Opcode.PS_STATS, clock, 0, b"")
        doc: dict[str, Any] = json.loads(wps.decode_stats(reader))
        return doc

    async def allreduce(
        self,
        step: int,
        session: int,
        records: Sequence[TensorMeta],
        data: Sequence[memoryview],
        sink: Sink,
        *,
        codec: str | None,
        what: str,
    ) -> int:
        """ALLREDUCE of step ``step``: the means land through ``sink``; how many workers they are over."""
        body = wm.encode_records(records) + wps.encode_codec(codec)
        reader = await self._call(Opcode.ALLREDUCE, step, session, body, data, sink=sink, what=what)
        count = wps.decode_u32(reader)
        reader.done()
        return count

    async def _call(
        self,
        opcode: Opcode,
        clock: int,
        seq: int,
        body: bytes,
        data: Sequence[memoryview] = (),
        *,
        sink: Sink | None = None,
        what: str | None = None,
        timeout: float | None = None,
    ) -> wm.MetaReader:
        s = self.sender
        head = wps.PsHead(s.worker, s.world, clock, seq, s.wait_ms).encode()
        what = what or f"{opcode.name}{self.label}"
        return await self.channel.call(opcode, head + body, data, sink, what=what, timeout=timeout)


def server_stats(
    servers: Sequence[str],
    *,
    timeout: float = 10.0,
    token: str | None = None,
    security: Security | None = None,
) -> list[dict[str, Any]]:
    """Each server's ``PS_STATS`` answer, without joining anything (``tensorwire ps stats``).
    ``security``: TLS files and token (default: ``token``, else ``$TENSORWIRE_TOKEN``)."""
    security = security or Security(None, client_token(token))
    options = transports.TransportOptions(timeout, timeout, security=security)

    async def one(url: str) -> dict[str, Any]:
        conn = await transports.open_channel(url, options, what="ps stats")
        try:
            return await PsChannel(conn, Sender()).stats()
        finally:
            await conn.close()

    async def every() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(one(url) for url in servers)))

    return run(every())
