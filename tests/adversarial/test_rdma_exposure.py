"""rdma://: what the transfer engine's own ports expose (issue 32, class 3 and 4).

* The library opens the engine's ports on every interface whatever address it is given; an
  engine asked for loopback must not be reachable from another interface (checked from a network
  namespace the test makes, joined by a veth pair; skipped where namespaces are not allowed).
* In TCP mode the engine checks a peer's address once per request, then writes for as long as the
  peer sends: a peer that began a write into a put's buffer and stalls must not be able to change
  the tensor once it is stored, nor a later put's, whether the put was released, committed, or its
  connection cut (nor may that end the process).
* A client in TCP mode registers none of its buffers: registered memory is what any engine peer
  can read and write, and the engine needs none to move a caller's bytes in that mode.

Real servers on loopback, a raw TCP peer speaking the engine's data protocol."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
from collections.abc import Iterator

import pytest
import torch

from tensorwire import Server, TensorStore
from tensorwire._aio import run
from tensorwire.client.batches import TensorBatch
from tensorwire.security import Security
from tensorwire.server.rdma import RdmaService
from tensorwire.testing import rdma as kit
from tensorwire.transport import FrameChannel, TransportOptions, open_channel
from tensorwire.transport.rdma import RdmaTransport
from tensorwire.transport.rdma_sockets import tcp_sockets
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.frame import Opcode

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
BIG = 1 << 20
ENGINE_WRITE = 1  # the engine's TCP data protocol: u64 size | u64 address | u8 opcode (+7 padding)


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _service(server: Server) -> RdmaService:
    return next(e for e in server.extensions if isinstance(e, RdmaService))


async def _server() -> tuple[Server, list[int]]:
    """A server on rdma://127.0.0.1 and the ports its engine's start opened (not its own listener)."""
    before = {s.inode for s in tcp_sockets()}
    server = Server(store=TensorStore(1 << 30))
    await server.start("rdma://127.0.0.1:0")
    ports = sorted({s.port for s in tcp_sockets() if s.inode not in before and s.state == "0A"})
    return server, [p for p in ports if p != server.addresses[0].port]


def _data_port(server: Server, ports: list[int]) -> int:
    rpc = int(_service(server).engine.session.rpartition(":")[2])
    (data,) = [p for p in ports if p != rpc]
    return data


async def _channel(server: Server) -> FrameChannel:
    return await open_channel(server.addresses[0], TransportOptions(5.0, 5.0, security=Security()), what="t")


async def _reserve(channel: FrameChannel, name: str) -> tuple[int, int]:
    meta = TensorMeta(name, torch.uint8, (BIG,), BIG)
    reader = await channel.call(Opcode.RDMA_PUT, wm.encode_records([meta]), what="RDMA_PUT")
    reservation = reader.u64()
    (ref,) = wr.decode_refs(reader, 1)
    reader.done()
    return reservation, ref.address


def _stored(server: Server, name: str) -> bytes:
    (entry,) = server.store.acquire([name])
    try:
        return bytes(entry.data)
    finally:
        server.store.release([entry])


@pytest.mark.parametrize("ended_by", ["release", "commit", "closed connection"])
def test_a_stalled_engine_write_cannot_change_what_is_stored(ended_by: str) -> None:
    """A peer sends the head of a write into a put's buffer (the engine checks it then, once) and
    a first few bytes, and stalls. The put ends (released; committed with the right bytes, which
    its client writes over the peer's; or its connection cut), later puts are stored, and the
    peer sends the rest: every stored tensor keeps the bytes its own client wrote, and the server
    lives on."""

    async def case() -> None:
        server, ports = await _server()
        try:
            channel = await _channel(server)
            assert isinstance(channel, RdmaTransport)
            reservation, address = await _reserve(channel, "x")
            good = torch.arange(BIG, dtype=torch.int64).to(torch.uint8)
            with socket.create_connection(("127.0.0.1", _data_port(server, ports)), timeout=10) as peer:
                peer.sendall(struct.pack("<QQB7x", BIG, address, ENGINE_WRITE) + b"\xee" * 4096)
                await asyncio.sleep(0.2)  # not synchronisation: the peer's first bytes land first
                if ended_by == "release":
                    await channel.call(Opcode.RDMA_END, wr.encode_end(reservation, wr.End.RELEASE), what="x")
                elif ended_by == "commit":
                    await _commit(channel, reservation, address, good)
                else:
                    await channel.close()
                    channel = await _channel(server)
                    assert isinstance(channel, RdmaTransport)
                if ended_by != "commit":
                    await channel.put(TensorBatch([("x", good)]))
                await channel.put(TensorBatch([("y", good.flip(0))]))
                with contextlib.suppress(OSError):  # the server may have cut the peer meanwhile
                    peer.sendall(b"\xee" * (BIG - 4096))
                await asyncio.sleep(0.3)  # not synchronisation: a window for a wrong write to land
            assert _stored(server, "x") == bytes(good.numpy())
            assert _stored(server, "y") == bytes(good.flip(0).numpy())
            await channel.close()
        finally:
            await server.close()

    run(case())


def test_a_server_closed_under_a_parked_engine_write_ends_cleanly() -> None:
    """The server stops (its engine closes) while a peer's write into a put's buffer is parked in
    the engine: the close returns, the peer's connection is cut, and this process goes on (a new
    server starts and serves)."""

    async def case() -> None:
        server, ports = await _server()
        channel = await _channel(server)
        _, address = await _reserve(channel, "x")
        with socket.create_connection(("127.0.0.1", _data_port(server, ports)), timeout=10) as peer:
            peer.sendall(struct.pack("<QQB7x", BIG, address, ENGINE_WRITE) + b"\xee" * 4096)
            await asyncio.sleep(0.2)  # not synchronisation: the write is under way in the engine
            await channel.close()
            await server.close()
            peer.settimeout(10)
            with contextlib.suppress(OSError):
                assert peer.recv(1) == b""  # cut by the engine's close
        again, _ = await _server()
        try:
            channel = await _channel(again)
            assert isinstance(channel, RdmaTransport)
            await channel.put(TensorBatch([("x", torch.ones(BIG, dtype=torch.uint8))]))
            await channel.close()
        finally:
            await again.close()

    run(case())


async def _commit(channel: RdmaTransport, reservation: int, address: int, data: torch.Tensor) -> None:
    """Write ``data`` into the reserved buffer through the client's engine, then commit it."""
    view = data.numpy().data.cast("B")
    with channel.cache.using(view) as local:
        await channel.engine.write(channel.peer.session, local, address, BIG, timeout=10.0)
    chunk = channel._chunk_size
    sums = [wr.chunk_checksums(channel._checksum, view, chunk)]
    await channel.call(Opcode.RDMA_END, wr.encode_end(reservation, wr.End.COMMIT, chunk, sums), what="commit")


def test_a_client_in_tcp_mode_registers_none_of_its_buffers() -> None:
    async def case() -> None:
        server, _ = await _server()
        try:
            channel = await _channel(server)
            assert isinstance(channel, RdmaTransport)
            data = torch.randn(BIG // 4)
            await channel.put(TensorBatch([("w", data)]))
            out = torch.empty_like(data)
            await channel.get(["w"], lambda metas: [out.numpy().data.cast("B")])
            assert torch.equal(out, data)
            assert channel.engine.registered == {}  # nothing of the caller's is reachable by engine peers
            await channel.close()
        finally:
            await server.close()

    run(case())


@contextlib.contextmanager
def _namespace() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (its name, this side's address)."""
    tag = f"{os.getpid() % 10000}"
    ns, host, inside = f"twx{tag}", f"twxh{tag}", f"twxn{tag}"
    subnet = f"10.91.{os.getpid() % 200}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        ip("netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"network namespaces are not allowed here: {exc}")
    try:
        ip("link", "add", host, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", ns)
        ip("addr", "add", f"{subnet}.1/24", "dev", host)
        ip("link", "set", host, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", inside)
        ip("netns", "exec", ns, "ip", "link", "set", inside, "up")
        yield ns, f"{subnet}.1"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", host)
        ip("netns", "del", ns)


def _reachable_from(ns: str, host: str, port: int) -> bool:
    probe = (
        "import socket,sys\n"
        "try:\n"
        f"    socket.create_connection(({host!r}, {port}), timeout=3).close()\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    command = ["ip", "netns", "exec", ns, "python3", "-c", probe]
    done = subprocess.run(command, check=False, capture_output=True, timeout=20)
    return done.returncode == 0


def test_an_engine_asked_for_loopback_is_not_reachable_from_another_interface() -> None:
    async def case(ns: str, host_address: str) -> None:
        server, ports = await _server()
        try:
            assert len(ports) == 2  # the handshake port and the data port (TCP mode)
            for port in ports:
                assert not await asyncio.to_thread(_reachable_from, ns, host_address, port), port
            status = server.status()["rdma"]["ports"]
            assert {p["port"] for p in status} == set(ports) and {p["accepts"] for p in status} == {
                "loopback"
            }
            with socket.create_connection(("127.0.0.1", ports[0]), timeout=5):
                pass  # still reachable where it was asked to be
        finally:
            await server.close()

    with _namespace() as (ns, host_address):
        run(case(ns, host_address))


def _other_local_address(besides: str) -> str | None:
    """An IPv4 address of this host on neither the loopback interface nor ``besides``."""
    done = subprocess.run(["ip", "-o", "-4", "addr", "show"], check=False, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[1] not in ("lo", besides):
            return parts[3].partition("/")[0]
    return None


def _refused_here(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return True
    return False


def test_an_engine_asked_for_another_address_accepts_connections_on_its_interface_only() -> None:
    """An engine asked for an address that is not loopback listens (the library's doing) on every
    interface; it is kept to the interface that holds the address: reachable from that interface's
    network and from this host through that address (a same-host client arrives on it too), not
    through loopback or another interface's address, and a client on this host moves tensors."""

    async def case(ns: str, host_address: str, device: str) -> None:
        before = {s.inode for s in tcp_sockets()}
        server = Server(store=TensorStore(1 << 30))
        await server.start(f"rdma://{host_address}:0")
        listening = {s.port for s in tcp_sockets() if s.inode not in before and s.state == "0A"}
        ports = sorted(listening - {server.addresses[0].port})
        other = _other_local_address(device)
        try:
            assert len(ports) == 2
            for port in ports:
                assert await asyncio.to_thread(_reachable_from, ns, host_address, port), port
                assert _refused_here("127.0.0.1", port), port
                assert other is None or _refused_here(other, port), (other, port)
                socket.create_connection((host_address, port), timeout=5).close()
            accepts = {p["accepts"] for p in server.status()["rdma"]["ports"]}
            assert accepts == {f"interface {device}"}, accepts
            channel = await _channel(server)
            assert isinstance(channel, RdmaTransport)
            data = torch.randn(BIG // 4)
            await channel.put(TensorBatch([("w", data)]))
            out = torch.empty_like(data)
            await channel.get(["w"], lambda metas: [out.numpy().data.cast("B")])
            assert torch.equal(out, data)
            await channel.close()
        finally:
            await server.close()

    with _namespace() as (ns, host_address):
        run(case(ns, host_address, f"twxh{os.getpid() % 10000}"))


def test_the_engines_idle_memory_counts_against_the_capacity_and_gives_way_to_a_put() -> None:
    """TCP mode: after a put, the buffer it landed in stays with the engine (charged to the store as
    ``rdma.engine``, as it was while the put landed in it); a later put whose landing buffer needs
    the room has it reclaimed (the engine's connections cut first) rather than refused, and the
    client's retry rides over the cut connection."""
    import tensorwire
    from tensorwire import ServerThread

    mib = 1 << 20
    with ServerThread(["rdma://127.0.0.1:0"], store=TensorStore(12 * mib)) as srv:
        with tensorwire.connect(srv.url) as client:
            client.put("a", torch.ones(4 * mib, dtype=torch.uint8))
            assert srv.server.store.charged.get("rdma.engine") == 4 * mib  # the idle landing
            client.delete("a")
            client.put("b", torch.ones(9 * mib, dtype=torch.uint8))  # 9 MiB + the idle 4 > 12: the idle goes
        assert _stored(srv.server, "b") == bytes([1]) * 9 * mib
        memory = srv.server.status()["rdma"]["engine_memory"]
        assert memory["reclaims"] >= 1
        # b's landing buffer (10 MiB) now idle and counted, beside what the store holds within its capacity
        assert srv.server.store.charged.get("rdma.engine") == memory["held"] == 10 * mib
        assert srv.server.store.used - memory["held"] <= 12 * mib
