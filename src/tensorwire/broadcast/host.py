"""Per-host fan-out: one process per host reads a model from the network, the others read it from
shared memory, so a host with 8 ranks costs one network copy (README, "Publish once, read by many").

The **leader** is a ``Subscriber`` made with ``share="shm://127.0.0.1:0"``: after every ``update()``
that brought a generation (through the relay or as a delta, verified whole), it copies the tensors
once into a local server's shared-memory segments and publishes them there as one generation with
the same number (``HostShare``). ``sub.share_url`` is the address to hand the followers; the share
asks for the leader's token, and shm:// proves that a follower shares the leader's segment directory.
The share is a listener of its own, so it holds to the origin's rules: it binds the loopback address
it was given (shm:// takes no other), asks for the token the origin asks for (a leader that
authenticates with a client certificate and no token cannot share: shm:// has no TLS to check one
with), serves only what followers read with (``SHARE_OPCODES``: no follower can write, publish or
park anything else in it) and at most ``MAX_SHARE_CONNECTIONS`` of them. A follower's views pin
their generation in the share for at most ``lease_seconds`` (server/shm.py): past that the views
still read (their segments are never reused), but no longer hold the share's room, so followers
that keep old generations can make the share refuse new ones for that long at most.

A **follower** is a ``HostReader(share_url, prefix)``: ``update()`` returns the newest generation's
number and ``tensors``, read-only views over the leader's segments (no copy, no network), all of
that one generation. The leader's server keeps the generation for as long as any of those views is
alive (one lease, released when the last is freed), whatever ``keep`` retires meanwhile; with
``into=`` the views are copied once into the caller's tensors and dropped at once.

Faults: the leader publishes a generation only once its update returned (every chunk verified), in
one step, and in segments of its own (its ``into`` tensors being overwritten by the next update is
invisible to followers), so a follower never sees a partial or mixed generation. A leader that dies
fails its followers' next ``update()`` (or a ``wait_and_update()`` in progress) at once with
``ConnectError``/``ConnectionLost`` naming the share address; the views they hold stay readable
(their pages stay mapped).

Lifecycle: ``HostShare.start`` (from the leader's loop) -> ``publish`` after each update ->
``close``. ``HostReader``: ``update``/``wait_and_update`` any number of times -> ``close``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import torch

from tensorwire import transport
from tensorwire._aio import LoopThread, asyncio_timeout
from tensorwire.broadcast.peer import serve_only
from tensorwire.errors import (
    ConnectError,
    ConnectionLost,
    InvalidTensor,
    KeyNotFound,
    TensorwireError,
    UnsupportedTransport,
)
from tensorwire.security import Security, client_token
from tensorwire.server import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.generation_config import DEFAULT_MAX_LEASE_SECONDS
from tensorwire.store.generations import DEFAULT_KEEP, GenerationConfig
from tensorwire.store.memory import entry_cost
from tensorwire.transport import TransportOptions
from tensorwire.transport.base import GenerationViews, Transport
from tensorwire.types import Address, Generation, MiB, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

# What a follower sends: HELLO, SHM_ATTACH, SHM_GEN_VIEW, SHM_RELEASE (its views freed), GEN_WAIT.
SHARE_OPCODES = frozenset(
    (Opcode.HELLO, Opcode.SHM_ATTACH, Opcode.SHM_GEN_VIEW, Opcode.SHM_RELEASE, Opcode.GEN_WAIT)
)
MAX_SHARE_CONNECTIONS = 64  # followers on one host (each holds one connection)


def share_prefix(prefix: str) -> str:
    """The prefix a share publishes under: the subscriber's, without a trailing "/" (a plain-tensor
    prefix such as "policy/" names ``policy/key`` just as the generations prefix "policy" does)."""
    return prefix.rstrip("/")


class HostShare:
    """The leader's shm:// server, holding the generations it shares (see the module docstring).

    Its store holds ``keep`` generations, the one being published and one more that followers' views
    may pin after it retired; a publish beyond that (followers pinning more) is CapacityExceeded."""

    def __init__(self, server: Server, url: str, prefix: str) -> None:
        self.server = server
        self.url = url
        self.prefix = share_prefix(prefix)
        self.generation = 0  # the newest generation shared (0: none yet)

    @classmethod
    async def start(
        cls,
        listen: str,
        prefix: str,
        targets: Mapping[str, torch.Tensor],
        security: Security,
        *,
        keep: int = DEFAULT_KEEP,
        lease_seconds: float = DEFAULT_MAX_LEASE_SECONDS,
    ) -> HostShare:
        """Serve ``listen`` (an shm:// address on loopback; port 0 picks one) for followers of
        ``prefix``, whose tensors are ``targets`` (by full name), asking them for ``security``'s
        token (the leader's); a follower's view pins its generation ``lease_seconds`` at most."""
        if Address.parse(listen).scheme != "shm":
            raise ValueError(f"a host share serves shm:// (followers map its segments), not {listen!r}")
        if security.token is None and security.tls is not None and security.tls.cert is not None:
            raise ValueError(
                "this leader authenticates to its origin with a client certificate, which a share over "
                "shm:// cannot ask its followers for: give it a token too (the share asks for it)"
            )
        room = sum(t.nbytes + entry_cost(name) for name, t in targets.items())
        store = TensorStore(capacity=(keep + 2) * room + MiB)
        config = GenerationConfig(keep=keep, max_lease_seconds=lease_seconds)
        limits = ConnectionOptions(max_connections=MAX_SHARE_CONNECTIONS)
        options = ServerOptions(token=security.token, generations=config, connections=limits)
        server = Server(options, store=store)
        try:
            (address,) = await server.start(listen)
        except BaseException:
            await server.close()
            raise
        serve_only(server, SHARE_OPCODES)  # after start: the shm:// listener adds its handlers there
        return cls(server, str(address), prefix)

    async def publish(self, number: int, targets: Mapping[str, torch.Tensor]) -> Generation | None:
        """Share ``targets`` (by full name; they hold generation ``number``) as generation ``number``;
        nothing when that one is shared already."""
        if not number or number == self.generation:
            return None
        tensors = [(_record(name, t), byte_view(t)) for name, t in targets.items()]
        gen = await self.server.generation_ops.publish_copy(self.prefix, tensors, number)
        self.generation = gen.number
        return gen

    async def close(self) -> None:
        await self.server.close()


def _record(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, tensor.dtype, tuple(tensor.shape), tensor.nbytes)


class HostReader:
    """A follower of a host leader's share (see the module docstring): ``update()`` brings the
    newest generation as read-only views (``tensors``, by the keys the leader's ``into`` has), or
    copies it into ``into`` (a module or a ``state_dict``) when given.

    ``token``: the leader's token (default ``$TENSORWIRE_TOKEN``). ``timeout``: how long one
    ``update()`` may take by default; ``connect_timeout``: reaching the leader.
    """

    def __init__(
        self,
        share_url: str,
        prefix: str,
        *,
        into: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
        token: str | None = None,
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.address = Address.parse(share_url)
        if self.address.scheme != "shm":
            raise ValueError(f"a HostReader reads a leader's shm:// share, not {share_url!r}")
        self.prefix = share_prefix(prefix)
        self.timeout = timeout
        self.generation = 0  # the generation ``tensors`` hold (0: none yet)
        self.tensors: dict[str, torch.Tensor] = {}
        self._into = None if into is None else _by_key(into)
        security = Security(token=client_token(token))
        self._options = TransportOptions(connect_timeout, timeout, security=security)
        self._transport: Transport | None = None
        self._loop = LoopThread("tensorwire-host-reader")

    # -- the blocking API ------------------------------------------------------------------------
    def update(self, timeout: float | None = None) -> int:
        """The newest generation shared: its number (``tensors`` hold it; nothing changes when
        they hold it already). KeyNotFound before the leader shared any; ConnectError or
        ConnectionLost, naming the share, when the leader is gone."""
        wait = self.timeout if timeout is None else timeout
        what = f"the newest generation of {self.prefix!r} from {self.address}"
        return self._loop.call(self._update(wait, what), wait + 5.0, what)

    def wait_and_update(self, timeout: float) -> int:
        """Wait (the leader's server notifies; no polling) until a generation newer than the one
        held is shared, then ``update()``; WaitTimeout if none comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        what = f"a generation of {self.prefix!r} after {self.generation} from {self.address}"
        self._loop.call(self._wait(timeout), timeout + 5.0, what)
        return self.update(max(deadline - time.monotonic(), 1.0))

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self._loop.call(self._close(), 10.0, "closing the host reader")
        self._loop.stop()

    def __enter__(self) -> HostReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the loop ------------------------------------------------------------------------------
    async def _update(self, wait: float, what: str) -> int:
        async with asyncio_timeout(wait, what):
            views = await self._views()
            generation, tensors = await views.view_generation(self.prefix, wg.LATEST)
        if generation.number == self.generation:
            return self.generation  # the new views are dropped: their lease goes with them
        keyed = self._keyed(tensors)
        if self._into is not None:
            _copy(keyed, self._into, generation.number)
            keyed = self._into
        self.tensors, self.generation = keyed, generation.number
        return generation.number

    def _keyed(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = len(self.prefix) + 1
        return {name[head:]: tensor for name, tensor in tensors.items()}

    async def _wait(self, timeout: float) -> None:
        views = await self._views()
        await views.wait(self.prefix, self.generation, timeout)

    async def _views(self) -> _Guarded:
        """The connection to the leader (opened again if it was closed, e.g. idle), every call on it
        failing with an error that names the share when the leader is gone."""
        if self._transport is None or self._transport.closed:
            try:
                self._transport = await transport.open_transport(self.address, self._options)
            except (ConnectError, ConnectionLost) as exc:
                raise _gone(self, exc) from exc
        if not isinstance(self._transport, GenerationViews):
            raise UnsupportedTransport(f"{self.address} does not serve generations as views")
        return _Guarded(self, self._transport)

    async def _close(self) -> None:
        if self._transport is not None:
            with contextlib.suppress(TensorwireError):
                await self._transport.close()
            self._transport = None


class _Guarded:
    """A follower's ``GenerationViews``, translating a lost leader into an error naming it."""

    def __init__(self, reader: HostReader, views: GenerationViews) -> None:
        self._reader = reader
        self._views = views

    async def view_generation(self, prefix: str, at: int) -> tuple[Generation, dict[str, torch.Tensor]]:
        try:
            return await self._views.view_generation(prefix, at)
        except (ConnectError, ConnectionLost) as exc:
            raise _gone(self._reader, exc) from exc

    async def wait(self, prefix: str, after: int, timeout: float) -> Generation:
        try:
            return await self._views.wait(prefix, after, timeout)
        except (ConnectError, ConnectionLost) as exc:
            raise _gone(self._reader, exc) from exc


def _gone(reader: HostReader, exc: ConnectError | ConnectionLost) -> TensorwireError:
    """``exc``'s class, saying that the host leader sharing the prefix is gone."""
    return type(exc)(
        f"the host leader sharing {reader.prefix!r} at {reader.address} is unreachable (did it stop?): {exc}"
    )


def _by_key(into: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = into.state_dict(keep_vars=True) if isinstance(into, torch.nn.Module) else dict(into)
    return {
        key: tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        for key, tensor in tensors.items()
    }


def _copy(views: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor], number: int) -> None:
    """Copy every view into its tensor of ``into``, all checked before the first is written."""
    for key, view in views.items():
        target = into.get(key)
        if target is None:
            raise KeyNotFound(f"generation {number} has {key!r}, which `into` lacks")
        if target.dtype != view.dtype or target.shape != view.shape:
            raise InvalidTensor(
                f"{key!r}: generation {number} holds {view.dtype} {tuple(view.shape)}, `into` has"
                f" {target.dtype} {tuple(target.shape)}"
            )
    with torch.no_grad():
        for key, view in views.items():
            into[key].copy_(view)
