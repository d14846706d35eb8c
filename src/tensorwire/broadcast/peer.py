"""A reader's relay server: ``RelayPeer``, an ``Extension`` that serves RELAY_GET from the
memory the reader is filling (its model's own tensors), chunk by chunk, once each is verified.

Lifecycle: the ``Subscriber`` builds one, serves it on a ``Server`` of its own (same token and TLS
as the cluster, port 0) and, on the same event loop, calls ``hold`` when it starts receiving a
generation (from then on the previous one is no longer served), ``advance`` each time more chunks
are verified, and ``drop`` when it stops serving. A RELAY_GET for a chunk not verified yet is
parked until it is, at most ``wait_ms`` (capped by ``max_wait``): then WaitTimeout, and the reader
downstream reports this one as stalled. A RELAY_GET for a newer generation than the one held
waits for it at most ``JOIN_GRACE``: the origin may name this reader as an upstream a moment before
the reader has read the origin's answer and started holding it.

The relay server (``serve``) asks its peers for what the origin asks for, and serves nothing else:

- the relay token (``relay_token``), derived from the cluster's token, instead of the token itself:
  a reader sends the cluster's token only to the origin, never to an address a peer registered,
  and a peer that harvests the relay token learns nothing the origin accepts;
- under tls://, a client certificate signed by the cluster's CA (``tls.ca``, which also signs the
  origin and the readers' own certificates): a reader's certificate is its relay server's and its
  client certificate towards its peers, so it must be valid for both (serverAuth and clientAuth:
  a reader is refused at construction otherwise) and name the IP address its relay server is
  reached at (else it does not relay: a warning says so). ``tensorwire certs DIR --reader IP``
  writes such a certificate; the development server certificate is one for the hosts it names;
- only HELLO and RELAY_GET (``PEER_OPCODES``), at most ``MAX_PEER_CONNECTIONS`` connections, bound to
  the one interface it was asked for (default: the one this host reaches the origin from).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorwire._aio import within
from tensorwire.errors import ProtocolError, VersionChanged, WaitTimeout
from tensorwire.security import Security, TlsFiles
from tensorwire.server import Handler, Request, Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.transport import TransportOptions
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode

MAX_GET_CHUNKS = 64
JOIN_GRACE = 2.0  # seconds a RELAY_GET waits for this reader to start holding a newer generation
MAX_PEER_CONNECTIONS = 32  # a relay server's downstream readers (one each, a few after reroutes)
PEER_IDLE_TIMEOUT = 120.0  # seconds a downstream's connection may sit idle on a relay server
PEER_OPCODES = frozenset((Opcode.HELLO, Opcode.RELAY_GET))  # all a relay server serves
_RELAY_TOKEN_CONTEXT = b"tensorwire relay peer v1"


@dataclass(slots=True)
class Holding:
    """The generation a reader is receiving or holds, and how far it has verified it."""

    prefix: str
    manifest: wr.Manifest
    buffers: Sequence[memoryview]
    verified: int = 0  # chunks 0 .. verified-1 are in memory and checked
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on each change


class RelayPeer:
    """Serves RELAY_GET from a reader's memory (see the module docstring)."""

    def __init__(self, max_wait: float = 30.0) -> None:
        self.max_wait = max_wait
        self._holding: Holding | None = None
        self._held = asyncio.Event()  # set (and replaced) each time a generation starts being held
        self.served = 0  # bytes sent downstream

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {Opcode.RELAY_GET: self._on_get}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        self.drop()

    def hold(self, prefix: str, manifest: wr.Manifest, buffers: Sequence[memoryview]) -> None:
        self.drop()
        self._holding = Holding(prefix, manifest, buffers)
        held, self._held = self._held, asyncio.Event()
        held.set()

    def advance(self, verified: int) -> None:
        holding = self._holding
        if holding is not None and verified > holding.verified:
            holding.verified = verified
            self._wake(holding)

    def drop(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            self._wake(holding)

    @staticmethod
    def _wake(holding: Holding) -> None:
        moved, holding.moved = holding.moved, asyncio.Event()
        moved.set()

    async def _on_get(self, req: Request) -> None:
        if req.header.data_len:
            raise ProtocolError("RELAY_GET carries no data")
        prefix, generation, first, count, wait_ms = wr.decode_get(req.meta)
        wait = min(wait_ms / 1000, self.max_wait)
        with req.waiting():
            holding = await self._coming(prefix, generation, min(wait, JOIN_GRACE))
        holding.manifest.locate(first)  # ProtocolError for a chunk outside the generation
        with req.waiting():
            holding = await self._verified(prefix, generation, first, wait)
        manifest = holding.manifest
        index, offset, length = manifest.span(first, min(count, MAX_GET_CHUNKS, holding.verified - first))
        record = TensorMeta(manifest.metas[index].name, torch.uint8, (length,), length, generation)
        self.served += length
        await req.reply(wm.encode_records([record]), [holding.buffers[index][offset : offset + length]])

    def _current(self, prefix: str, generation: int) -> Holding:
        holding = self._holding
        if holding is None or holding.prefix != prefix or holding.manifest.generation != generation:
            raise VersionChanged(f"this reader does not hold generation {generation} of {prefix!r}")
        return holding

    async def _coming(self, prefix: str, generation: int, wait: float) -> Holding:
        """The holding of ``generation``, waiting at most ``wait`` seconds for it if this reader
        holds nothing of ``prefix`` or an older generation (VersionChanged then, or at once)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            try:
                return self._current(prefix, generation)
            except VersionChanged:
                held, left = self._holding, until - loop.time()
                older = held is None or held.prefix != prefix or held.manifest.generation < generation
                if not older or left <= 0:
                    raise
            with contextlib.suppress(TimeoutError):
                await within(self._held.wait(), left)

    async def _verified(self, prefix: str, generation: int, first: int, wait: float) -> Holding:
        """The holding once chunk ``first`` is verified; WaitTimeout after ``wait`` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            holding = self._current(prefix, generation)
            if holding.verified > first:
                return holding
            left = until - loop.time()
            if left <= 0:
                raise WaitTimeout(
                    f"chunk {first} of generation {generation} of {prefix!r} not here within {wait:.3g}s"
                )
            try:
                await within(holding.moved.wait(), left)
            except TimeoutError:
                continue


# -- the relay server and its peers' credentials ------------------------------------------------
def relay_token(token: str | None) -> str | None:
    """What relay servers ask their peers for: HMAC-SHA256 of a fixed context under the cluster's
    token. Only holders of the token can make it; the origin does not accept it."""
    if token is None:
        return None
    return hmac.new(token.encode(), _RELAY_TOKEN_CONTEXT, hashlib.sha256).hexdigest()


def check_peer_tls(security: Security, scheme: str) -> None:
    """ValueError unless a reader of a ``scheme`` origin can serve and reach relay peers as the
    module docstring says: under tls://, its certificate (valid as a server's and a client's), key
    and the cluster's CA."""
    files = security.tls
    if scheme != "tls":
        return
    if files is None or files.cert is None or files.key is None or files.ca is None:
        raise ValueError(
            "a relay over tls:// needs this reader's certificate and key (its relay server's, and its "
            "client certificate towards its peers) and the cluster's CA (tls.ca: it checks the peers' "
            "certificates); pass them, or relay=False"
        )
    missing = _missing_usages(files.cert)
    if missing:
        raise ValueError(
            f"{files.cert} is not valid as a {' and a '.join(missing)} certificate: a relay reader's "
            "certificate serves its relay server and is its client certificate towards its peers, which "
            "ask for one (`tensorwire certs DIR --reader IP` writes one for the host at IP); or relay=False"
        )


def _certificate(path: Path) -> Any:
    """The first certificate in the PEM file at ``path`` (None if it cannot be read: the TLS layer
    then says why, when it loads it)."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None


def _missing_usages(path: Path) -> list[str]:
    """Which of "server" and "client" the certificate at ``path`` may not be used as (its extended
    key usage; a certificate without one may be used as either)."""
    from cryptography import x509

    cert = _certificate(path)
    try:
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) if cert else None
    except x509.ExtensionNotFound:
        usages = None
    eku = x509.oid.ExtendedKeyUsageOID
    if usages is None or eku.ANY_EXTENDED_KEY_USAGE in usages:
        return []
    wanted = {"server": eku.SERVER_AUTH, "client": eku.CLIENT_AUTH}
    return [role for role, oid in wanted.items() if oid not in usages]


def check_names(security: Security, host: str) -> None:
    """ValueError unless this reader's certificate (under TLS) names ``host``, the IP address its
    relay server is reached at: its peers check that it does."""
    from cryptography import x509

    path = security.tls.cert if security.tls is not None else None
    cert = _certificate(path) if path is not None else None
    if cert is None:
        return
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        named |= {name.lower() for name in names.get_values_for_type(x509.DNSName)}
    except x509.ExtensionNotFound:
        named = set()
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host.strip("[]")))
    if host.lower() not in named:
        raise ValueError(
            f"{path} does not name {host}, where this reader's relay server is reached (its peers "
            f"check it): `tensorwire certs DIR --reader {host}` writes one that does, or pass listen_host="
            "an address it names"
        )


def peer_options(options: TransportOptions, peer_timeout: float) -> TransportOptions:
    """How a reader connects to an upstream a peer registered: within ``peer_timeout``, offering the
    relay token (never the cluster's), its certificate checked against the cluster's CA only."""
    security = Security(tls=options.security.tls, token=relay_token(options.security.token))
    return options._replace(connect_timeout=min(options.connect_timeout, peer_timeout), security=security)


def serving_security(security: Security) -> Security:
    """What a relay server asks of its peers (the module docstring): the relay token and, under
    TLS, a client certificate signed by the cluster's CA."""
    files = security.tls
    tls = TlsFiles(cert=files.cert, key=files.key, ca=files.ca) if files is not None else None
    return Security(tls=tls, token=relay_token(security.token))


async def serve(
    peer: RelayPeer, origin: Address, security: Security, host: str | None, stall_timeout: float
) -> tuple[Server, str]:
    """Start ``peer``'s relay server on ``host`` (default: the address this host reaches
    ``origin`` from), port 0, the origin's scheme; (the server, the address to register)."""
    host = host or local_host_towards(origin)
    serving = serving_security(security)
    limits = ConnectionOptions(stall_timeout=stall_timeout, max_connections=MAX_PEER_CONNECTIONS,
                               idle_timeout=PEER_IDLE_TIMEOUT)  # fmt: skip
    options = ServerOptions(tls=serving.tls, token=serving.token, connections=limits)
    server = Server(options, store=TensorStore(capacity=0, max_tensors=1), extensions=[peer])
    serve_only(server, PEER_OPCODES)
    try:
        (address,) = await server.start(str(Address(origin.scheme, host, 0)))
    except BaseException:
        await server.close()
        raise
    bound = address.host
    if _unspecified(bound):  # asked for every interface: the others reach it where the origin does
        bound = local_host_towards(origin)
    try:
        if origin.scheme == "tls":
            check_names(security, bound)
    except BaseException:
        await server.close()
        raise
    return server, str(Address(address.scheme, bound, address.port))


def serve_only(server: Server, opcodes: Collection[int]) -> None:
    """Take every opcode but ``opcodes`` out of ``server``'s table (its sessions read it per
    request): a secondary listener serves what it is for and nothing a peer could fill or change."""
    for op in [op for op in server.handlers if op not in opcodes]:
        del server.handlers[op]


def local_host_towards(origin: Address) -> str:
    """The address this host reaches ``origin`` from (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(origin.host, origin.port or 1, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"cannot tell which local address reaches {origin}; pass listen_host") from exc


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
