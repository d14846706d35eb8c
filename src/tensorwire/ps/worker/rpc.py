"""The parameter-server protocol, typed: ``PsChannel`` builds every PS request in one place.

docs/protocol.md §13.2 (and ``tensorwire.wire.ps``) define the requests: a 28-byte head
(``worker | world | clock | seq | wait_ms``), the job id (the ``Sender``'s), then each opcode's
own fields. A ``PsChannel`` wraps
one ``FrameCaller`` (transport/base.py: a ``FrameChannel`` connection, or a worker's
``ServerSlot``, which resends on a new connection) and turns each request into one method
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
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import ConnectError, NotPrimary, ProtocolError
from tensorwire.security import Security, client_token
from tensorwire.transport.base import FrameCaller, Sink
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

T = TypeVar("T")
JOB_TOKEN_ENV = "TENSORWIRE_JOB_TOKEN"  # the job's token, which its workers share (ps/job.py)


class Sender(NamedTuple):
    """Who the requests of one ``PsChannel`` come from: the head's fields that do not change
    from request to request (``clock`` and ``seq`` are each request's own)."""

    worker: int = wps.OBSERVER  # the rank, or OBSERVER for a reader that takes no part
    world: int = 0
    wait_ms: int = 0  # how long the server may wait on other workers (0: its own default)
    job: str = ""  # the job (wire.ps.check_job_id); "": none (the exchange, the server's stats)
    # The job's token (its workers share it: $TENSORWIRE_JOB_TOKEN), offered by the requests that
    # join, initialise or end the job (b"": none, an open job); for PS_END, or the operator's.
    credential: bytes = b""


class PsChannel:
    """The parameter-server requests over one ``FrameChannel`` (see the module doc).

    ``peer`` names the server in errors; ``label`` is added to each request's opcode name to say
    what it is in the channel's errors and logs (a worker's: `` from worker 0 to tcp://...``).
    """

    def __init__(self, channel: FrameCaller, sender: Sender, *, peer: str = "", label: str = "") -> None:
        self.channel = channel
        self.sender = sender
        self.peer = peer
        self.label = label

    async def join(
        self, clock: int, incarnation: int, config: str, records: Sequence[TensorMeta]
    ) -> tuple[int, bool, int, int]:
        """PS_JOIN with the job as this worker sees it: (clock, initialized, last applied seq,
        last barrier generation released)."""
        # The job as this worker sees it: a server running another one refuses before admitting it.
        job = wps.encode_config(config) + wm.encode_records(records)
        job += wps.encode_credential(self.sender.credential)
        reader = await self._call(Opcode.PS_JOIN, clock, incarnation, job)
        reply = wps.decode_join_reply(reader)
        reader.done()
        return reply

    async def init(
        self,
        clock: int,
        incarnation: int,
        config: str,
        records: Sequence[TensorMeta],
        data: Sequence[memoryview],
    ) -> tuple[bool, int]:
        """PS_INIT, by the session that joined with this rank (``incarnation``): create the job with
        ``data`` as its values, or (no data) check it is this one."""
        body = wps.encode_config(config) + wm.encode_records(records)
        body += wps.encode_credential(self.sender.credential)
        reader = await self._call(Opcode.PS_INIT, clock, incarnation, body, data)
        reply = wps.decode_init_reply(reader)
        reader.done()
        return reply

    async def leave(
        self,
        clock: int,
        incarnation: int,
        *,
        final: bool = True,
        what: str | None = None,
        timeout: float | None = None,
    ) -> None:
        """PS_LEAVE: no step and no allreduce round waits for this rank any more. ``final``: this
        worker is done (its job ends with its last worker); else it steps aside and rejoins."""
        body = wps.encode_flag(final)
        await self._call(Opcode.PS_LEAVE, clock, incarnation, body, what=what, timeout=timeout)

    async def barrier(self, generation: int, incarnation: int, wait: float) -> int:
        """PS_BARRIER ``generation``: answered once every live worker of the job reached it (the
        server waits ``wait`` seconds at most); the generation released."""
        wait_ms = max(1, min(int(wait * 1000), 0xFFFFFFFF))
        reader = await self._call(
            Opcode.PS_BARRIER, generation, incarnation, b"", wait_ms=wait_ms, timeout=wait + 10.0,
            what=f"barrier {generation}{self.label}",
        )  # fmt: skip
        released = wps.decode_u64(reader)
        reader.done()
        return released

    async def end(self, force: bool = False) -> None:
        """PS_END: end the sender's job on this server (``force``: even with live workers), offering
        the sender's credential (the job's token or the operator's)."""
        body = wps.encode_flag(force) + wps.encode_credential(self.sender.credential)
        reader = await self._call(Opcode.PS_END, 0, 0, body)
        reader.done()

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

    async def relay(self, clock: int, session: int) -> tuple[int, int]:
        """PS_RELAY: a pull's gate, then (version, the generation of ``_ps/<job>`` it is published
        as, to read through the relay: ps/worker/relay_reader.py)."""
        reader = await self._call(Opcode.PS_RELAY, clock, session, b"")
        reply = wps.decode_relay_reply(reader)
        reader.done()
        return reply

    async def heartbeat(self, clock: int, incarnation: int) -> None:
        """PS_HEARTBEAT: this rank is alive (a server that dropped it is rejoined by the next
        push or pull, not here)."""
        await self._call(Opcode.PS_HEARTBEAT, clock, incarnation, b"", what="a heartbeat")

    async def rollback(self, version: int, incarnation: int) -> int:
        """PS_ROLLBACK to the server's checkpoint of ``version``, by the session that joined with
        this rank and stepped aside (``incarnation``): the version it is at now."""
        reader = await self._call(Opcode.PS_ROLLBACK, version, incarnation, b"")
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
        wait_ms: int | None = None,
    ) -> wm.MetaReader:
        s = self.sender
        wait = s.wait_ms if wait_ms is None else wait_ms
        head = wps.PsHead(s.worker, s.world, clock, seq, wait, s.job).encode()
        what = what or f"{opcode.name}{self.label}"
        return await self.channel.call(opcode, head + body, data, sink, what=what, timeout=timeout)


def server_stats(
    servers: Sequence[str],
    *,
    timeout: float = 10.0,
    token: str | None = None,
    security: Security | None = None,
    job: str | None = None,
) -> list[dict[str, Any]]:
    """Each server's ``PS_STATS`` answer, without joining anything (``tensorwire ps stats``): the
    server and its jobs, with ``job``'s view (else its one job's, if it holds one). ``security``:
    TLS files and token (default: ``token``, else ``$TENSORWIRE_TOKEN``)."""
    security = security or Security(None, client_token(token))
    return _each(servers, lambda rpc: rpc.stats(), security, timeout, job or "")


def end_job(
    servers: Sequence[str],
    job: str,
    *,
    force: bool = False,
    timeout: float = 10.0,
    token: str | None = None,
    security: Security | None = None,
    credential: str | None = None,
) -> None:
    """PS_END of ``job`` on every server (``tensorwire ps end``): its state freed, its last
    checkpoint written. Refused while it has live workers, unless ``force``. A server given as its
    replicas (``a|b``) is asked at the one that answers as the primary. ``credential``: the job's
    token or the servers' operator token (default: ``$TENSORWIRE_JOB_TOKEN``); NotAuthorized if
    the job has a token and this is neither."""
    wps.check_job_id(job)
    security = security or Security(None, client_token(token))
    offered = (credential or os.environ.get(JOB_TOKEN_ENV) or "").encode()
    for server in servers:
        replicas = server.split("|")
        for i, url in enumerate(replicas):
            try:
                _each([url], lambda rpc: rpc.end(force), security, timeout, job, credential=offered)
                break
            except (NotPrimary, ConnectError):
                if i == len(replicas) - 1:
                    raise


def _each(
    servers: Sequence[str],
    ask: Callable[[PsChannel], Awaitable[T]],
    security: Security,
    timeout: float,
    job: str,
    *,
    credential: bytes = b"",
) -> list[T]:
    """``ask`` of every server at once, on a connection of its own (an observer's, for ``job``)."""
    options = transports.TransportOptions(timeout, timeout, security=security)

    async def one(url: str) -> T:
        conn = await transports.open_channel(url, options, what="a parameter-server request")
        try:
            return await ask(PsChannel(conn, Sender(job=job, credential=credential)))
        finally:
            await conn.close()

    async def every() -> list[T]:
        return list(await asyncio.gather(*(one(url) for url in servers)))

    return run(every())
