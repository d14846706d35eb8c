"""The two seams of the transport layer.

``ByteStream`` is one reliable, ordered connection. It is made by a connector (client side) or
handed to a listener's handler (server side); one task reads with ``recv_into`` while another may
write with ``send``; ``close`` ends it. Streams raise ``tensorwire.errors`` types, never
``OSError``.

``Transport`` is the client side of one connection to one server, at the level of operations.
Lifecycle: the factory (``tensorwire.transport.open_transport``) builds and opens it; any number of
operations may then run concurrently; ``close`` ends it and fails what is still in flight with
``ConnectionLost``. A transport whose connection broke stays closed (``closed`` is True): the
client opens a new one. Timeouts belong to the caller, who closes the transport when one expires,
since a half-sent frame leaves the connection unusable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from tensorwire.types import Address, TensorMeta
from tensorwire.wire.meta import ServerInfo

Buffer = bytes | bytearray | memoryview
# Called by a transport with the metadata of the tensors a GET returns; answers with one writable
# byte buffer per tensor (exactly meta.nbytes long) for the data to land in.
Sink = Callable[[list[TensorMeta]], list[memoryview]]
Progress = Callable[[int], None]  # called with the number of data bytes just moved


class PutBatch(Protocol):
    """The tensors of one put, cut into ``parts`` that a transport asks for in order.

    A part is encoded when it is first asked for (and kept, for a retry), so a transport can send
    part k while the caller's side encodes part k+1.
    """

    names: Sequence[str]
    parts: int

    def part(self, index: int) -> tuple[Sequence[TensorMeta], Sequence[memoryview]]: ...


class ByteStream(ABC):
    """One connection's bytes."""

    peer: str = "?"
    last_active: float = 0.0  # time.monotonic() of the last byte moved either way

    @abstractmethod
    async def recv_into(self, buf: memoryview) -> int:
        """Read at least one byte into ``buf``; 0 means the peer closed the stream."""

    @abstractmethod
    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write every byte of ``buffers``, in order."""

    @abstractmethod
    async def close(self) -> None:
        """Close the stream; pending and later calls raise ConnectionLost."""


StreamHandler = Callable[[ByteStream], Awaitable[None]]


class Listener(ABC):
    """A bound server endpoint; ``address`` is the real one (port 0 is resolved)."""

    address: Address

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting and close every stream it handed out."""


class Transport(ABC):
    """Client side of one connection to one server, one method per operation."""

    address: Address
    info: ServerInfo

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        """Store every tensor of ``batch`` atomically; return their common new version."""

    @abstractmethod
    async def get(
        self, names: Sequence[str], sink: Sink, progress: Progress | None = None
    ) -> list[TensorMeta]:
        """Fetch tensors into the buffers ``sink`` hands out; return their metadata."""

    @abstractmethod
    async def delete(self, names: Sequence[str]) -> int: ...

    @abstractmethod
    async def stat(self, names: Sequence[str]) -> list[TensorMeta]: ...

    @abstractmethod
    async def list(self, prefix: str, limit: int) -> list[TensorMeta]: ...

    @abstractmethod
    async def ping(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...
