"""The seams of the transport layer: what a transport is, and what more it may be able to do.

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

What a transport can do beyond ``Transport`` is asked of the object, never of its scheme or its
class: each capability is a runtime-checkable Protocol that a transport implements or not, and a
caller asks ``isinstance(t, Ranged)`` (or opens with ``open_channel``, which asks for it):

* ``FrameChannel``: any request of the frame protocol (an opcode, its metadata and data; the
  answer's metadata back). What extensions (STATUS, DIGEST, the parameter server) speak.
  tcp://, tls://, memory://, shm://.
* ``Ranged``: one tensor in byte ranges of a server-side upload, published whole by a commit; and
  reads of byte ranges pinned to a version. What striping and CUDA staging use. tcp://, tls://,
  memory:// (not shm://: its bytes go through shared segments, not frames).
* ``Resumable``: a put that goes on after a broken connection from the last byte the server
  verified. tcp://, tls://, memory://.
* ``Viewable``: read-only tensors over the server's own pages. shm://.
* ``RangedGenerations``: a generation held (manifest, lease) while many byte ranges of its tensors
  are read (what ``tensorwire.sharded`` reads with). tcp://, tls://, memory://, grpc://, grpcs://.
* ``Generational``: generations (publish, reads at a generation, one or many byte ranges of one,
  manifests, waits, leases; docs/protocol.md §14); ``RangedGenerations`` and more. tcp://, tls://,
  memory:// (not yet grpc:// nor shm://).
* ``PartPublisher``: one part of a generation published from several connections (the ranks of a
  job: GEN_PUBLISH_PART, §14.8). tcp://, tls://, memory://, shm:// (its parts through segments:
  SHM_GEN_PART), grpc://, grpcs:// (the PublishPart call, §14.9).
* ``GenerationViews``: a generation as read-only tensors over the server's own pages, and waits
  for the next one (§16: how a host leader's followers read it). shm://.
* ``Lendable`` (lending.py, with the rest of lending): an idle connection lent to a thread that
  runs requests on it itself, with no event-loop turn or thread hop (what the blocking client's
  plain gets and puts take). tcp://.
* ``DeviceDirect``: CUDA tensors moved from and into device memory by the transport itself
  (GPU-direct RDMA), where ``gpu_direct`` says it can now. rdma:// with a CUDA build of its engine.

One capability is asked of a request's data rather than of the transport: ``StagedData``, bytes
that become readable while the request is being sent (device copies into pinned memory).

A capability's methods follow the transport's lifecycle above: they run on an open transport,
concurrently with any other operation, and fail with ``ConnectionLost`` once it is closed.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tensorwire.errors import UnsupportedTransport
from tensorwire.types import Address, Generation, GenerationManifest, TensorMeta
from tensorwire.wire.delta_reads import DeltaAnswer
from tensorwire.wire.meta import MetaReader, ServerInfo

if TYPE_CHECKING:
    import torch

    from tensorwire.transport.plain import LentStream, ReadyIO

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
    # Whether the kernel moves this stream's bytes (a socket: the copy runs with the interpreter
    # lock released), so that streams on several threads move bytes at once. In-process pipes copy
    # under the lock: several of them go no faster than one.
    parallel: bool = False

    @abstractmethod
    async def recv_into(self, buf: memoryview) -> int:
        """Read at least one byte into ``buf``; 0 means the peer closed the stream."""

    @abstractmethod
    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write every byte of ``buffers``, in order."""

    @abstractmethod
    async def close(self) -> None:
        """Close the stream; pending and later calls raise ConnectionLost."""

    def watch_idle(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once, on the stream's loop, when the stream turns readable (bytes, or
        the peer's close) while nobody is in ``recv_into``; watching again takes another call.
        False: this stream cannot tell, so its owner must keep a reader waiting instead."""
        return False

    def busy_poll(self, seconds: float) -> bool:
        """From now on, each wait for bytes keeps this stream's loop polling without sleeping for
        up to ``seconds`` first (transport/spin.py); 0: never. False: this stream cannot."""
        return False

    async def serve_idle(self, serve: Callable[[ReadyIO], bool]) -> bool:
        """Wait for the peer's next bytes while the stream's loop calls ``serve(io)`` from its own
        readiness callback, with no task woken: ``serve`` takes and answers what it can with
        ``io``'s plain calls, and returns True to wait on (nothing is left for the caller) or False
        to end the wait. Returns True then, or when the stream is closed; False at once where the
        stream cannot (its bytes are not plain socket bytes, or no callback sees them): the caller
        reads as usual."""
        return False

    def lend(self) -> LentStream | None:
        """A twin of this idle stream for one other thread to drive with blocking waits (its
        coroutines never suspend), while this one's loop neither reads nor watches it; None: this
        stream cannot be lent. ``take_back`` ends the loan."""
        return None

    def take_back(self) -> bool:
        """End a loan (on the stream's loop): False when something arrived meanwhile unasked (the
        peer's close, or bytes no request asked for), which leaves the connection unusable."""
        return True


StreamHandler = Callable[[ByteStream], Awaitable[None]]


class Listener(ABC):
    """A bound server endpoint; ``address`` is the real one (port 0 is resolved). What it offers
    its peers is asked of it, not read off the scheme: ``encrypted`` (its connections run inside
    TLS) and ``networked`` (other hosts can reach it; not an in-process pipe)."""

    address: Address
    encrypted: bool = False
    networked: bool = True

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting and close every stream it handed out."""


class Transport(ABC):
    """Client side of one connection to one server, one method per operation."""

    address: Address
    info: ServerInfo
    # Why this connection is not the shm:// one that ``prefer_local`` tried (its server runs on
    # this host and serves shm://, but that failed); None when nothing was tried or it worked.
    local_fallback: str | None = None

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


# -- capabilities (see the module docstring) -----------------------------------------------------
@runtime_checkable
class FrameCaller(Protocol):
    """What sends one request of the frame protocol: a ``FrameChannel``, or something that sends
    through one (a parameter-server worker's ``ServerSlot``, which resends on a new connection)."""

    async def call(
        self,
        opcode: int,
        meta: bytes,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        *,
        what: str,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> MetaReader:
        """One request: ``meta``, then ``data``; the answer's metadata comes back (with ``sink``, the
        answer's tensor records are read and its data lands in the buffers the sink hands out).
        ``what`` names the request in errors; ``timeout`` replaces the channel's own for it."""


@runtime_checkable
class FrameChannel(FrameCaller, Protocol):
    """Requests of the frame protocol (docs/protocol.md), one opcode at a time (``call``).

    Lifecycle: ``tensorwire.transport.open_channel`` opens and checks it (the one place that does);
    the caller then sends any number of ``call``s, concurrently, and closes it when done. A call
    that fails with a retryable error leaves the channel closed if the connection broke (``closed``
    is True): the caller opens a new one (``client/retry.py`` does that). An error the server
    answered leaves the channel open.
    """

    address: Address
    info: ServerInfo  # what HELLO said: the server's limits, its store's identity

    @property
    def closed(self) -> bool: ...

    async def close(self) -> None: ...


@runtime_checkable
class Ranged(Protocol):
    """One tensor moved in byte ranges (docs/protocol.md §11.7).

    A put: the caller draws an upload id (``new_upload``), sends every range of the tensor with
    ``put_range`` (in any order, over any connections to the same server, each retried on its own:
    a range sent twice lands twice in the same place), then ``commit`` publishes the whole tensor
    under one new version. Nothing is visible before the commit; commit is not idempotent (retry
    it only if it never left). A get: ``stat`` for the version, then ``get_range`` of each range,
    pinned to that version: ``VersionChanged`` if the tensor moved on meanwhile (read it again).

    ``parallel``: whether ranges over several connections at once, each on its own thread, go
    faster than over one (the kernel moves the bytes): what striping asks before it opens lanes.
    """

    address: Address

    @property
    def parallel(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    async def put_range(self, upload: int, meta: TensorMeta, offset: int, data: memoryview) -> None:
        """Bytes ``offset .. offset + len(data)`` of the tensor ``meta`` into upload ``upload``."""

    async def get_range(self, meta: TensorMeta, offset: int, dest: memoryview) -> None:
        """Bytes ``offset .. offset + len(dest)`` of ``meta``'s tensor at ``meta.version`` into ``dest``."""

    async def commit(self, upload: int, meta: TensorMeta) -> int:
        """Publish upload ``upload`` (all of ``meta``'s bytes in); return the tensor's new version."""

    async def close(self) -> None: ...


@runtime_checkable
class Resumable(Protocol):
    """A put that survives broken connections (docs/protocol.md, PUT_RESUMABLE).

    The caller draws an upload id (``new_upload``) and calls ``put_resumable`` from offset 0; after a
    broken connection it opens a new transport, asks ``resume_point`` (how many bytes the server
    holds, verified) and calls ``put_resumable`` again from there, with the same upload and bytes.
    The tensor becomes visible once all its bytes are in, under the version returned.
    """

    async def resume_point(self, upload: int, meta: TensorMeta) -> int: ...

    async def put_resumable(
        self,
        upload: int,
        meta: TensorMeta,
        data: memoryview,
        offset: int = 0,
        progress: Progress | None = None,
    ) -> int:
        """Send ``data`` (all of the tensor's bytes) from ``offset`` on; return the new version."""


@runtime_checkable
class Viewable(Protocol):
    """Tensors over the server's own pages, with no copy (shm://: README, "Shared memory")."""

    async def view(self, name: str) -> torch.Tensor:
        """A read-only tensor over the pages that hold ``name``, held for as long as it lives."""


@runtime_checkable
class RangedGenerations(Protocol):
    """One generation held while byte ranges of its tensors are read (``client/ranges.py``):
    ``manifest`` says what generation ``at`` (0: the newest) holds, ``lease`` keeps it (0 seconds:
    release), ``get_ranges_at`` reads many ranges of one tensor of it in one request."""

    async def get_ranges_at(self, name: str, at: int, ranges: Sequence[tuple[int, memoryview]]) -> int:
        """Each ``(offset, dest)``: bytes ``offset .. offset + len(dest)`` of ``name`` at generation
        ``at`` into ``dest``, all in one request (GEN_GET_RANGES); the generation's number."""

    async def manifest(self, prefix: str, at: int) -> GenerationManifest: ...

    async def lease(self, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        """Seconds granted (0 after a release) and the oldest generation the prefix keeps."""


@runtime_checkable
class Generational(RangedGenerations, Protocol):
    """Generations of tensors under a prefix (docs/protocol.md §14; README, "Generations").

    ``publish`` sends a batch as one generation (parts over several frames, like a put; nothing
    visible before the last is in; not idempotent: retry only if it never left). Reads name full
    names and a generation (``at``: a number, or 0 for the newest) and answer with the number and
    digest they read; ``wait`` returns once a generation after ``after`` exists (the server holds
    the request, not the connection); ``lease`` keeps one for a while (0 seconds: release).
    """

    async def publish(self, prefix: str, batch: PutBatch, progress: Progress | None = None) -> Generation: ...

    async def get_at(self, names: Sequence[str], at: int, sink: Sink) -> tuple[str, int, bytes]:
        """Tensors of one generation into the sink's buffers; the prefix, number and digest of the
        generation read."""

    async def get_delta_at(self, names: Sequence[str], at: int, base: int, sink: Sink) -> DeltaAnswer:
        """Generation ``at`` of ``names`` for a reader holding generation ``base`` (GEN_GET_DELTA):
        each tensor's deltas, one uint8 record per name, land in the sink's buffers; the answer
        says, per chunk, how long each delta is and the new chunk's checksum."""

    async def get_range_at(self, name: str, at: int, offset: int, dest: memoryview) -> int:
        """Bytes ``offset .. offset + len(dest)`` of ``name`` at generation ``at``; its number."""

    async def get_ranges_at(self, name: str, at: int, ranges: Sequence[tuple[int, memoryview]]) -> int:
        """Each ``(offset, dest)``: bytes ``offset .. offset + len(dest)`` of ``name`` at generation
        ``at`` into ``dest``, all in one request (GEN_GET_RANGES); the generation's number."""

    async def manifest(self, prefix: str, at: int) -> GenerationManifest: ...

    async def wait(self, prefix: str, after: int, timeout: float) -> Generation: ...

    async def lease(self, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        """Seconds granted (0 after a release) and the oldest generation the prefix keeps."""


@runtime_checkable
class GenerationViews(Protocol):
    """Generations read in place, on the server's own pages (docs/protocol.md §16).

    ``view_generation`` answers with generation ``at`` (0: the newest) of ``prefix`` and a
    read-only tensor per full name, every one of that one generation; the server keeps the
    generation (one lease for all of them) until every one of those tensors is freed, or the
    connection ends (the tensors stay readable then too). ``wait`` returns once a generation after
    ``after`` exists (GEN_WAIT: the server holds the request, not the connection).
    """

    async def view_generation(self, prefix: str, at: int) -> tuple[Generation, dict[str, torch.Tensor]]: ...

    async def wait(self, prefix: str, after: int, timeout: float) -> Generation: ...

    # Bytes copied into or out of the server's pages over this connection (puts into segments,
    # gets out of them, and the copies callers make out of views, which they ``note_copied``):
    # what moved, as a socket's byte counters say for the framed transports.
    copied_bytes: int

    def note_copied(self, nbytes: int) -> None: ...


@runtime_checkable
class PartPublisher(Protocol):
    """Part ``index`` of ``count`` of one generation of ``prefix`` (docs/protocol.md §14.8).

    Every part of a transaction names the same 16-byte ``txn``; each is sent once, from any
    connection. The answer comes when the transaction ends: the generation, once every part is
    in; else the error that aborted it (``WaitTimeout`` at ``timeout`` seconds, ``PublishAborted``
    when a part failed or its connection closed), and nothing of it is visible. Not idempotent.
    """

    async def publish_part(
        self, prefix: str, batch: PutBatch, *, txn: bytes, index: int, count: int, timeout: float
    ) -> Generation: ...


def as_part_publisher(transport: Transport, what: str) -> PartPublisher:
    """``transport`` as ``PartPublisher``; UnsupportedTransport (naming ``what``) if it is not."""
    if not isinstance(transport, PartPublisher):
        raise UnsupportedTransport(
            f"{what} needs multi-part publishes (GEN_PUBLISH_PART), which {transport.address.scheme}://"
            " does not serve (use tcp://, tls://, grpc://, grpcs://, shm:// or memory://)"
        )
    return transport


def as_ranged_generations(transport: Transport, what: str) -> RangedGenerations:
    """``transport`` as ``RangedGenerations``; UnsupportedTransport (naming ``what``) if it is not."""
    if not isinstance(transport, RangedGenerations):
        raise UnsupportedTransport(
            f"{what} needs ranged reads of generations, which {transport.address.scheme}:// does not"
            " serve (use tcp://, tls://, grpc://, grpcs://, shm:// or memory://)"
        )
    return transport


@runtime_checkable
class DeviceDirect(Protocol):
    """CUDA tensors moved straight from and into device memory (GPU-direct RDMA: the NIC reads and
    writes the GPU's memory, no host copy of the bytes on the way). ``gpu_direct`` says whether
    this transport can now (rdma:// with a CUDA build of the engine); when it is False the caller
    moves a CUDA tensor through host memory as on any other transport. ``put_device`` returns the
    new version, ``get_device`` the version it read into ``out`` (same dtype, shape, device)."""

    @property
    def gpu_direct(self) -> bool: ...

    async def put_device(self, name: str, tensor: torch.Tensor) -> int: ...

    async def get_device(self, name: str, out: torch.Tensor) -> int: ...


def as_generational(transport: Transport, what: str) -> Generational:
    """``transport`` as ``Generational``; UnsupportedTransport (naming ``what``) if it is not."""
    if not isinstance(transport, Generational):
        raise UnsupportedTransport(
            f"{what} needs generations, which {transport.address.scheme}:// does not serve yet"
            " (use tcp://, tls:// or memory://)"
        )
    return transport


@runtime_checkable
class StagedData(Protocol):
    """A request's data whose bytes become readable in order while it is sent: a CUDA tensor's
    copies into pinned host memory, the copy of each piece overlapping the send of the one before
    (``client/staging.py``).

    It is the request's ``data`` (a sequence of byte views, format ``B``, that exist from the
    start; their bytes may not yet). The sender awaits ``ready(end)`` before it reads any of the
    first ``end`` bytes, and sends the views as they are, never joining them (they are large).
    Sent again (a resend after a broken connection) it is ready at once.
    """

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[memoryview]: ...

    async def ready(self, end: int) -> None:
        """Return once the first ``end`` bytes of the data may be read."""


def as_ranged(transport: Transport, what: str) -> Ranged:
    """``transport`` as ``Ranged``; UnsupportedTransport (naming ``what`` needed it) if it is not."""
    if not isinstance(transport, Ranged):
        raise UnsupportedTransport(
            f"{what} needs ranged transfers, which {transport.address.scheme}:// lacks"
        )
    return transport


def as_resumable(transport: Transport, what: str) -> Resumable:
    """``transport`` as ``Resumable``; UnsupportedTransport (naming ``what``) if it is not."""
    if not isinstance(transport, Resumable):
        raise UnsupportedTransport(f"{what} needs resumable puts, which {transport.address.scheme}:// lacks")
    return transport


def new_upload() -> int:
    """A fresh upload id for ``Ranged`` and ``Resumable`` puts (random, never 0)."""
    return secrets.randbits(63) or 1
