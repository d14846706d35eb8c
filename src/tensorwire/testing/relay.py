"""A relay origin for tests (``origin``: a server with a ``RelayCoordinator`` and small chunks, so that
a transfer is many chunks and a fault lands mid-transfer), a model's tensors, bit-exact checks,
where a tensor's memory lies (``segment_mapping``: a view of a shared-memory segment, or a copy),
a connection that speaks the relay's opcodes by hand and stays open (``RelayConn``: a hostile
reader), a registered reader whose relay server never has a chunk to forward (``stalled_peer``),
and readers' TLS certificates (``reader_certs``, ``leaf_cert``)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import tensorwire
from tensorwire import transport
from tensorwire._aio import LoopThread
from tensorwire.broadcast import peer as relay_peer
from tensorwire.broadcast.chains import Chains
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.broadcast.peer import RelayPeer
from tensorwire.broadcast.source import StoreSource
from tensorwire.security import Security, TlsFiles, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig
from tensorwire.transport import FrameChannel, TransportOptions
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode

PREFIX = "policy/"
CHUNK = 16 << 10  # small: a transfer is many chunks, so faults land mid-transfer


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(256, 300, generator=gen),  # 300 KiB: 19 chunks
        "fc1.bias": torch.randn(256, generator=gen).to(torch.bfloat16),
        "fc2.weight": torch.randn(64, 256, generator=gen).to(torch.float16),
        "steps": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(1000, generator=gen) > 0.5,
        "empty": torch.empty(0),
    }


def blank_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def model_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(v.nbytes for v in tensors.values())


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def segment_mapping(tensor: torch.Tensor) -> str | None:
    """The permissions ("r--s": read-only, shared) of the mapping of a tensorwire segment that
    ``tensor``'s memory lies in, or None when it lies in none (a private copy)."""
    segments = str(ws.shm_dir() / ws.PREFIX)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(segments):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= tensor.data_ptr() < high:
                    return fields[1]
    return None


@contextmanager
def origin(
    token: str | None = None, chains: Chains | None = None, *, generations: bool = False, keep: int = 2
) -> Iterator[tuple[ServerThread, RelayCoordinator]]:
    """A server whose coordinator relays its plain versioned tensors in CHUNK-byte chunks, or (with
    ``generations``) its published generations, as ``tensorwire serve`` does; it keeps the last
    ``keep`` generations of a prefix."""
    store = TensorStore()
    config = GenerationConfig(keep=keep)
    with ServerThread(options=ServerOptions(token=token, generations=config), store=store) as srv:
        if generations:
            coordinator = RelayCoordinator.of(srv.server, chains)
        else:
            coordinator = RelayCoordinator(StoreSource(store, chunk_bytes=CHUNK), chains)
            srv.server.extend(coordinator)
        yield srv, coordinator


def publish(url: str, tensors: dict[str, torch.Tensor], token: str | None = None) -> int:
    with tensorwire.connect(url, token=token) as client:
        return client.put_many({PREFIX + k: v for k, v in tensors.items()})


@contextmanager
def subscribers(
    url: str, prefix: str, targets: list[dict[str, torch.Tensor]], **options: Any
) -> Iterator[list[tensorwire.Subscriber]]:
    """One ``Subscriber`` per target on loopback (``options``: its keyword arguments), all closed
    on the way out."""
    subs: list[tensorwire.Subscriber] = []
    try:
        for target in targets:
            subs.append(tensorwire.Subscriber(url, prefix, target, listen_host="127.0.0.1", **options))
        yield subs
    finally:
        for sub in subs:
            sub.close()


class RelayConn:
    """One connection to ``url`` that stays open (its registrations live as long as it does),
    sending relay requests built by hand: what a hostile reader sends. ``close`` ends it."""

    def __init__(self, url: str, token: str | None = None, tls: TlsFiles | None = None) -> None:
        self._loop = LoopThread("tensorwire-relay-conn")
        options = TransportOptions(5.0, 10.0, security=Security(tls=tls, token=token))
        try:
            opening = transport.open_channel(url, options, what="a test's relay connection")
            self._channel: FrameChannel = self._loop.call(opening, 15.0, f"connecting to {url}")
        except BaseException:
            self._loop.stop()
            raise

    def call(self, opcode: int, body: bytes, sink: bool = False) -> tuple[wm.MetaReader, list[TensorMeta]]:
        """One request; with ``sink``, its answer's data lands in fresh buffers (records returned)."""
        landed: list[TensorMeta] = []

        def land(metas: list[TensorMeta]) -> list[memoryview]:
            landed.extend(metas)
            return [memoryview(bytearray(m.nbytes)) for m in metas]

        what = Opcode(opcode).name
        call = self._channel.call(opcode, body, sink=land if sink else None, what=what)
        return self._loop.call(call, 30.0, what), landed

    def join(self, relay: str, prefix: str = PREFIX, after: int = 0) -> tuple[wr.Manifest, wr.Placement]:
        reader, _ = self.call(Opcode.RELAY_JOIN, wr.encode_join(prefix, after, relay))
        return wr.decode_join_reply(reader, 1 << 20)

    def report(
        self, generation: int, reader: int, what: wr.Report, upstream: int = 0, prefix: str = PREFIX
    ) -> wr.Placement:
        body = wr.encode_report(prefix, generation, reader, what, upstream)
        answer, _ = self.call(Opcode.RELAY_REPORT, body)
        return wr.decode_report_reply(answer)

    def close(self) -> None:
        try:
            self._loop.call(self._channel.close(), 10.0, "closing a test's relay connection")
        finally:
            self._loop.stop()

    def __enter__(self) -> RelayConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def stalled_peer(url: str, prefix: str = PREFIX, token: str | None = None) -> Iterator[wr.Placement]:
    """A reader registered in the relay of ``prefix``'s newest generation (its placement) whose
    relay server takes connections and requests but never has a chunk to forward: what a reader
    whose own upstream stalls looks like to the readers behind it, or a hostile one."""
    loop = LoopThread("tensorwire-stalled-peer")
    peer = RelayPeer(max_wait=300.0)
    try:
        serving = relay_peer.serve(peer, Address.parse(url), Security(token=token), "127.0.0.1", 300.0)
        server, address = loop.call(serving, 15.0, "starting a stalled relay server")
        try:
            with RelayConn(url, token=token) as conn:
                manifest, placement = conn.join(address, prefix)
                buffers = [memoryview(bytearray(m.nbytes)) for m in manifest.metas]

                async def hold() -> None:  # holds the generation, verifies nothing of it
                    peer.hold(prefix, manifest, buffers)

                loop.call(hold(), 5.0, "holding the generation")
                yield placement
        finally:
            loop.call(server.close(), 15.0, "closing a stalled relay server")
    finally:
        loop.stop()


def reader_certs(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> tuple[TlsFiles, TlsFiles]:
    """A development CA in ``directory`` and (the origin's files, a reader's): a reader's certificate
    serves both ways (serverAuth for its relay server, naming ``hosts``; clientAuth towards its peers
    and the origin), as a relay over TLS needs (broadcast/peer.py)."""
    paths = write_dev_certs(directory, hosts)
    served = TlsFiles(cert=paths["server"], key=paths["server_key"], ca=paths["ca"])
    return served, leaf_cert(directory, "reader", server=True, client=True, hosts=hosts)


def leaf_cert(
    directory: Path, name: str, *, server: bool, client: bool, hosts: tuple[str, ...] = ("127.0.0.1",)
) -> TlsFiles:
    """A certificate (``name``.pem, ``name``-key.pem) signed by the development CA in ``directory``
    (``write_dev_certs``), naming ``hosts``, valid as a server's and/or a client's as asked."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    eku = x509.oid.ExtendedKeyUsageOID
    usages = [oid for oid, wanted in ((eku.SERVER_AUTH, server), (eku.CLIENT_AUTH, client)) if wanted]
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, f"tensorwire test {name}")])
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return TlsFiles(cert=cert_path, key=key_path, ca=directory / "ca.pem")
