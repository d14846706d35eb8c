"""Addresses a reader registers, and the relay servers behind them: an address is the registering
connection's own IP (or one in the origin's --relay-networks) and scheme (no plain text under a TLS
origin, no third host, no name, no loopback unless the origin listens on loopback only); any other
is not registered (the reader reads from the origin, counted); one that does not serve costs an
honest reader one short stall, then the origin; the origin's token never goes to it; and every
reader's relay server asks what the origin asks and serves nothing but RELAY_GET
(docs/protocol.md §15.4)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.broadcast.peer import relay_token
from tensorwire.errors import AuthenticationError, ProtocolError, TransportError
from tensorwire.security import TlsFiles
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import (
    PREFIX,
    RelayConn,
    blank_like,
    model_bytes,
    model_tensors,
    origin,
    publish,
    reader_certs,
    same_bytes,
)
from tensorwire.types import TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode


@contextmanager
def black_hole() -> Iterator[str]:
    """An address that accepts TCP connections (the kernel's backlog) and never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def harvester() -> Iterator[tuple[str, bytearray]]:
    """An address that keeps the first bytes each connection sends it (a HELLO), then hangs up."""
    heard = bytearray()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        sock.settimeout(0.2)
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = sock.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(2.0)
                    with suppress(OSError):
                        heard.extend(conn.recv(4096))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"tcp://127.0.0.1:{sock.getsockname()[1]}", heard
        finally:
            stop.set()
            thread.join(10)


@pytest.mark.parametrize(
    "relay", ["tcp://10.1.2.3:7000", "tcp://localhost:7000", "tcp://0.0.0.0:7000", "tcp://[::1]:7000"]
)
def test_a_reader_registers_only_the_ip_its_connection_comes_from(relay: str) -> None:
    with origin() as (srv, coordinator), RelayConn(srv.url) as conn:
        publish(srv.url, model_tensors(1))
        manifest, placement = conn.join(relay)  # not an error: it reads from the origin
        assert manifest.chunks and placement == wr.Placement(0, 0, "")
        assert coordinator.chains.readers() == 0 and coordinator.unadmitted_by["address"] == 1
        assert coordinator.status()["relay"]["unadmitted"] == 1
        assert conn.join("tcp://127.0.0.1:7000")[1].reader != 0  # its own address: registered


def test_a_loopback_address_is_refused_unless_the_origin_listens_on_loopback_only() -> None:
    # An origin reachable from other hosts: a reader connected over loopback registering 127.0.0.1
    # would point the remote readers behind it at their own loopback.
    with ServerThread(["tcp://0.0.0.0:0"]) as srv:
        coordinator = RelayCoordinator.of(srv.server)
        local = srv.url.replace("0.0.0.0", "127.0.0.1")
        with tensorwire.connect(local) as trainer:
            trainer.publish("policy", {"w": torch.ones(8)})
        with RelayConn(local) as conn:
            assert conn.join("tcp://127.0.0.1:7000", prefix="policy")[1] == wr.Placement(0, 0, "")
            assert coordinator.chains.readers() == 0 and coordinator.unadmitted_by["address"] == 1


def test_the_operator_may_allow_addresses_other_than_the_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:  # --relay-networks 127.0.0.0/8
        coordinator = RelayCoordinator.of(srv.server, networks=["127.0.0.0/8"])
        with tensorwire.connect(srv.url) as trainer:
            trainer.publish("policy", {"w": torch.ones(8)})
        with RelayConn(srv.url) as conn, RelayConn(srv.url) as other:
            assert conn.join("tcp://127.0.0.2:7000", prefix="policy")[1].reader != 0  # a data NIC, NAT
            assert other.join("tcp://10.1.2.3:7000", prefix="policy")[1].reader == 0  # outside: not
            assert coordinator.chains.readers() == 1


def test_under_a_tls_origin_no_plain_text_address_is_accepted(tmp_path: Path) -> None:
    served, reader = reader_certs(tmp_path)
    with ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=served, token="tok")) as srv:
        coordinator = RelayCoordinator.of(srv.server)
        files = {"tls": TlsFiles(ca=reader.ca, cert=reader.cert, key=reader.key)}
        with tensorwire.connect(srv.url, token="tok", **files) as trainer:
            trainer.publish("policy", {"w": torch.ones(8)})
        with RelayConn(srv.url, token="tok", tls=reader) as conn:
            assert conn.join("tcp://127.0.0.1:7000", prefix="policy")[1] == wr.Placement(0, 0, "")
            assert coordinator.chains.readers() == 0 and coordinator.unadmitted_by["address"] == 1
            assert conn.join("tls://127.0.0.1:7000", prefix="policy")[1].reader != 0


def test_upstreams_that_never_serve_cost_a_reader_one_short_stall_then_the_origin() -> None:
    model = model_tensors(1)
    with origin() as (srv, _coordinator), black_hole() as a, black_hole() as b, black_hole() as c:
        publish(srv.url, model)
        fakes = [RelayConn(srv.url) for _ in range(3)]
        try:
            for fake, hole in zip(fakes, (a, b, c), strict=True):
                fake.join(hole)  # a chain of three: the honest reader joins behind the last
            target = blank_like(model)
            with tensorwire.Subscriber(
                srv.url, PREFIX, target, listen_host="127.0.0.1", peer_timeout=0.5,
                connect_timeout=30.0, stall_timeout=30.0,
            ) as sub:  # fmt: skip
                sub.update(timeout=20)  # past one 30 s connect or stall, it would run out of time
                assert same_bytes(model, target)
                (gen,) = sub.stats()["generations"]
                assert gen["dropped"] == 1  # the one it tried; then the origin, not the next fake
        finally:
            for fake in fakes:
                fake.close()


def test_an_upstream_that_serves_slowly_gets_half_the_time_left_then_the_origin() -> None:
    model = model_tensors(1)
    done = threading.Event()

    def crawl(chunks: int) -> None:  # the upstream verifies, so forwards, a chunk every 0.2 s
        done.wait(0.2)

    with origin() as (srv, coordinator):
        publish(srv.url, model)
        slow = tensorwire.Subscriber(srv.url, PREFIX, blank_like(model), listen_host="127.0.0.1", window=1,
                                     progress=crawl)  # fmt: skip
        crawling = threading.Thread(target=lambda: slow.update(timeout=60), daemon=True)
        try:
            crawling.start()
            wait_for(lambda: coordinator.chains.readers() == 1, 10, "the slow reader to join")
            target = blank_like(model)
            with tensorwire.Subscriber(srv.url, PREFIX, target, listen_host="127.0.0.1") as honest:
                honest.update(timeout=3)  # from the slow one, whole, it would take over 4 s
                assert same_bytes(model, target)
                assert honest.received < model_bytes(model) + 1  # no chunk twice
        finally:
            done.set()
            crawling.join(30)
            slow.close()


def test_the_origins_token_goes_only_to_the_origin() -> None:
    model = model_tensors(1)
    with origin(token="s3cret") as (srv, _), harvester() as (address, heard):
        publish(srv.url, model, token="s3cret")
        with RelayConn(srv.url, token="s3cret") as hostile:
            hostile.join(address)
            target = blank_like(model)
            with tensorwire.Subscriber(
                srv.url, PREFIX, target, token="s3cret", listen_host="127.0.0.1", peer_timeout=0.5
            ) as sub:
                sub.update(timeout=20)
        assert same_bytes(model, target)
    assert heard, "the reader never reached the address the hostile reader registered"
    assert b"s3cret" not in heard
    relay = relay_token("s3cret")
    assert relay is not None and relay.encode() in heard  # what it sent instead


def test_a_relay_server_asks_for_the_relay_token_and_serves_only_relay_gets() -> None:
    model = model_tensors(1)
    with origin(token="tok") as (srv, _):
        publish(srv.url, model, token="tok")
        with tensorwire.Subscriber(
            srv.url, PREFIX, blank_like(model), token="tok", listen_host="127.0.0.1"
        ) as sub:
            sub.update(timeout=20)
            assert sub.relay_address.startswith("tcp://127.0.0.1:")  # the interface it was asked for
            for token in (None, "tok"):  # the cluster's token is the origin's, not the relay's
                with pytest.raises(AuthenticationError):
                    RelayConn(sub.relay_address, token=token).close()
            with RelayConn(sub.relay_address, token=relay_token("tok")) as peer:
                put = wm.encode_records([TensorMeta("x", torch.uint8, (4,), 4)])
                for opcode, body in ((Opcode.PUT, put), (Opcode.GEN_WAIT, wg.encode_wait(PREFIX, 0, 60_000))):
                    with pytest.raises(ProtocolError, match="does not serve"):
                        peer.call(opcode, body)


def test_over_tls_a_relay_server_asks_for_a_client_certificate(tmp_path: Path) -> None:
    served, reader = reader_certs(tmp_path)
    model = {"w": torch.ones(64)}
    with ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=served, token="tok")) as srv:
        RelayCoordinator.of(srv.server)
        files = {"tls": TlsFiles(ca=reader.ca, cert=reader.cert, key=reader.key)}
        with tensorwire.connect(srv.url, token="tok", **files) as trainer:
            trainer.publish("policy", model)
        with tensorwire.Subscriber(
            srv.url, "policy", blank_like(model), token="tok", tls=reader, listen_host="127.0.0.1"
        ) as sub:
            sub.update(timeout=20)
            no_cert = TlsFiles(ca=reader.ca)
            with pytest.raises((AuthenticationError, TransportError)):
                RelayConn(sub.relay_address, token=relay_token("tok"), tls=no_cert).close()
            RelayConn(sub.relay_address, token=relay_token("tok"), tls=reader).close()  # a peer's: in
        with pytest.raises(ValueError, match="cluster's CA"):  # a relay over TLS needs it to check peers
            tensorwire.Subscriber(
                srv.url, "policy", blank_like(model), token="tok", tls=TlsFiles(reader.cert, reader.key)
            )
