"""The relay with real servers on loopback: N Subscribers read one generation bit-exactly while
the origin sends its bytes about once (docs/protocol.md §15)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from prometheus_client import generate_latest

import tensorwire
from tensorwire import cli, transport
from tensorwire._aio import run
from tensorwire.broadcast.coordinator import RelayCoordinator, parse_networks
from tensorwire.errors import AuthenticationError, InvalidTensor
from tensorwire.security import TlsFiles
from tensorwire.server import ServerThread, metrics
from tensorwire.server.options import ServerOptions
from tensorwire.testing.process import ServerProcess, run_threads, wait_for
from tensorwire.testing.relay import (
    PREFIX,
    RelayConn,
    blank_like,
    leaf_cert,
    model_bytes,
    model_tensors,
    origin,
    publish,
    reader_certs,
    same_bytes,
    subscribers,
)
from tensorwire.transport import TransportOptions
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode


def test_four_subscribers_in_threads_read_bit_exact_and_the_origin_sends_about_once() -> None:
    with origin() as (srv, _):
        _four_read(srv.url)
        served = srv.server.status()["relay"]["served_bytes"][PREFIX]
        assert 0 < served <= 1.1 * model_bytes(model_tensors(1))
        scraped = metrics.parse(generate_latest(srv.server.registry).decode())
        assert scraped["tensorwire_relay_served_bytes_total"] == [({"prefix": PREFIX}, served)]


def _four_read(url: str) -> None:
    model = model_tensors(1)
    generation = publish(url, model)
    targets = [blank_like(model) for _ in range(4)]
    with subscribers(url, PREFIX, targets) as subs:
        got = [0] * 4

        def read(i: int) -> None:
            got[i] = subs[i].update(timeout=30)

        run_threads(read, 4, timeout=60)
        assert got == [generation] * 4
        assert all(same_bytes(model, t) for t in targets)
        stats = subs[0].stats()
        (gen,) = stats["generations"]
        assert gen["model_bytes"] == model_bytes(model)
        assert gen["served_bytes"] <= 1.1 * model_bytes(model), stats  # about once, not 4x
        assert gen["readers"] == 4 and gen["done"] == 4
        assert subs[0].update(timeout=30) == generation  # nothing newer: nothing moves


def test_a_second_generation_reaches_every_reader() -> None:
    with origin() as (srv, _):
        _second_generation(srv.url)


def _second_generation(url: str) -> None:
    first = model_tensors(1)
    publish(url, first)
    targets = [blank_like(first) for _ in range(3)]
    with subscribers(url, PREFIX, targets) as subs:
        run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
        second = model_tensors(2)
        g2 = publish(url, second)
        got = [0] * 3

        def read(i: int) -> None:
            got[i] = subs[i].update(timeout=30)

        run_threads(read, 3, timeout=60)
        assert got == [g2] * 3
        assert all(same_bytes(second, t) for t in targets)


def test_a_reader_without_the_token_never_joins_and_a_relay_server_wants_it_too() -> None:
    model = model_tensors(1)
    with origin(token="s3cret") as (srv, coordinator):
        publish(srv.url, model, token="s3cret")
        for token in (None, "wrong"):
            stranger = tensorwire.Subscriber(
                srv.url, PREFIX, blank_like(model), token=token, listen_host="127.0.0.1"
            )
            with stranger, pytest.raises(AuthenticationError):
                stranger.update(timeout=30)
        assert coordinator.chains.readers() == 0
        target = blank_like(model)
        with tensorwire.Subscriber(
            srv.url, PREFIX, target, token="s3cret", listen_host="127.0.0.1"
        ) as member:
            member.update(timeout=30)
            assert same_bytes(model, target)
            # Its relay server is a tensorwire server with the same token: a stranger gets nothing.
            body = wr.encode_get(PREFIX, member.generation, 0, 1, 0)
            with pytest.raises(AuthenticationError):
                run(_relay_get(member.relay_address, body))
            assert member.peer.served == 0


async def _relay_get(address: str, body: bytes) -> None:
    channel = await transport.open_channel(address, TransportOptions(5.0, 5.0), what="a stranger")
    try:
        await channel.call(Opcode.RELAY_GET, body, what="RELAY_GET")
    finally:
        await channel.close()


def test_published_generations_relay_and_wait_and_update_follows_the_publisher() -> None:
    model = model_tensors(1)
    with origin(generations=True) as (srv, _), tensorwire.connect(srv.url) as trainer:
        first = trainer.publish("policy", model)
        targets = [blank_like(model) for _ in range(3)]
        with subscribers(srv.url, "policy", targets) as subs:
            run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
            assert [s.generation for s in subs] == [first.number] * 3
            assert all(same_bytes(model, t) for t in targets)
            second = model_tensors(2)
            waiting = threading.Thread(target=lambda: subs[0].wait_and_update(30), daemon=True)
            waiting.start()
            g2 = trainer.publish("policy", second)
            waiting.join(60)
            assert subs[0].generation == g2.number and same_bytes(second, targets[0])
            (gen,) = [g for g in subs[0].stats()["generations"] if g["generation"] == first.number]
            assert gen["served_bytes"] <= 1.1 * model_bytes(model)


def test_tensorwire_serve_relays_its_generations_to_four_readers() -> None:
    model = {k: v.repeat(20, 1) if v.dim() == 2 else v for k, v in model_tensors(3).items()}  # ~8 MiB
    with ServerProcess() as srv, tensorwire.connect(srv.url) as trainer:
        generation = trainer.publish("policy", model)
        targets = [blank_like(model) for _ in range(4)]
        with subscribers(srv.url, "policy", targets) as subs:
            run_threads(lambda i: subs[i].update(timeout=60), 4, timeout=90)
            assert all(s.generation == generation.number for s in subs)
            assert all(same_bytes(model, t) for t in targets)
            (gen,) = subs[0].stats()["generations"]
            assert gen["readers"] == 4 and gen["served_bytes"] <= 1.1 * model_bytes(model), gen


def test_over_tls_every_hop_is_tls_with_the_token(tmp_path: Path) -> None:
    """Every hop is TLS and asks what the origin asks: a client certificate signed by the cluster's
    CA (each reader's certificate serves both ways) and the token (the relay's, derived from it)."""
    served, reader_files = reader_certs(tmp_path)
    model = model_tensors(1)
    with ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=served, token="tok")) as srv:
        RelayCoordinator.of(srv.server)
        with tensorwire.connect(srv.url, token="tok", tls=reader_files) as trainer:
            trainer.publish("policy", model)
        targets = [blank_like(model) for _ in range(3)]
        with subscribers(srv.url, "policy", targets, token="tok", tls=reader_files) as subs:
            run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
            assert all(same_bytes(model, t) for t in targets)
            assert all(s.relay_address.startswith("tls://") for s in subs)
            (gen,) = subs[0].stats()["generations"]
            assert gen["dropped"] == 0 and gen["served_bytes"] == model_bytes(model)


def test_a_reader_whose_tensors_cannot_take_the_generation_leaves_the_relay() -> None:
    model = model_tensors(1)
    with origin() as (srv, coordinator):
        publish(srv.url, model)
        wrong = blank_like(model)
        wrong["fc1.weight"] = torch.zeros(3)
        with tensorwire.Subscriber(srv.url, PREFIX, wrong, listen_host="127.0.0.1") as sub:
            with pytest.raises(InvalidTensor):
                sub.update(timeout=30)
            assert coordinator.chains.readers() == 0 and sub.generation == 0
            assert torch.equal(wrong["fc1.weight"], torch.zeros(3))  # nothing written


@pytest.mark.parametrize("cert", ["server", "reader-127.0.0.1"])
def test_over_tls_readers_relay_with_the_certificates_tensorwire_certs_writes(
    tmp_path: Path, cert: str
) -> None:
    """The README's setup: `tensorwire certs DIR` (its server certificate serves a reader on the
    origin's host; `--reader IP` writes one per reader host), the origin asking for the token."""
    result = CliRunner().invoke(cli.main, ["certs", str(tmp_path), "--reader", "127.0.0.1"])
    assert result.exit_code == 0, result.output
    origin_files = TlsFiles(cert=tmp_path / "server.pem", key=tmp_path / "server-key.pem")
    reader = TlsFiles(cert=tmp_path / f"{cert}.pem", key=tmp_path / f"{cert}-key.pem", ca=tmp_path / "ca.pem")
    model = model_tensors(1)
    with ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=origin_files, token="tok")) as srv:
        RelayCoordinator.of(srv.server)
        with tensorwire.connect(srv.url, token="tok", tls=TlsFiles(ca=reader.ca)) as trainer:
            trainer.publish("policy", model)
        targets = [blank_like(model) for _ in range(3)]
        with subscribers(srv.url, "policy", targets, token="tok", tls=reader) as subs:
            run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
            assert all(same_bytes(model, t) for t in targets)
            (gen,) = subs[0].stats()["generations"]
            assert gen["dropped"] == 0 and gen["readers"] == 3, gen  # every hop took the others' certificates
            assert gen["served_bytes"] == model_bytes(model)  # once: not one origin read per reader


def test_a_reader_certificate_that_cannot_be_a_clients_is_refused_at_construction(tmp_path: Path) -> None:
    served, _ = reader_certs(tmp_path)  # server.pem: the origin's, and a reader's (both usages)
    only_server = leaf_cert(tmp_path, "server-only", server=True, client=False)
    only_client = TlsFiles(cert=tmp_path / "client.pem", key=tmp_path / "client-key.pem", ca=served.ca)
    for files, usage in ((only_server, "client"), (only_client, "server")):
        with pytest.raises(ValueError, match=rf"not valid as a {usage}.*tensorwire certs DIR --reader"):
            tensorwire.Subscriber("tls://127.0.0.1:1", "policy", {"w": torch.zeros(4)}, tls=files, token="t")
    # Not relaying, it needs no such certificate.
    tensorwire.Subscriber(
        "tls://127.0.0.1:1", "policy", {"w": torch.zeros(4)}, tls=only_client, relay=False
    ).close()


def test_a_reader_relaying_on_another_address_than_it_connects_from_still_updates() -> None:
    """A multi-homed reader (its relay on a data interface, `listen_host`) or one behind NAT: its
    address is not the one its connection comes from, so the origin does not register it (counted),
    and the reader reads from the origin; with the operator's --relay-networks it relays."""
    model = model_tensors(1)
    with origin() as (srv, coordinator):
        generation = publish(srv.url, model)
        target = blank_like(model)
        with tensorwire.Subscriber(srv.url, PREFIX, target, listen_host="127.0.0.2") as sub:
            assert sub.update(timeout=30) == generation and same_bytes(model, target)
            assert sub.reader_id == 0 and coordinator.unadmitted_by["address"] == 1
        coordinator.networks = parse_networks(["127.0.0.0/8"])  # tensorwire serve --relay-networks
        targets = [blank_like(model), blank_like(model)]
        with (
            tensorwire.Subscriber(srv.url, PREFIX, targets[0], listen_host="127.0.0.2") as first,
            tensorwire.Subscriber(srv.url, PREFIX, targets[1], listen_host="127.0.0.3") as second,
        ):
            first.update(timeout=30)
            second.update(timeout=30)
            assert all(same_bytes(model, t) for t in targets) and first.reader_id and second.reader_id
            assert first.peer.served > 0  # the second read from the first, at 127.0.0.2


def test_a_join_refused_for_its_address_reads_from_the_origin(caplog: pytest.LogCaptureFixture) -> None:
    """The origin refuses to register an address another connection holds (a reader that reconnected
    before the origin saw its old connection close, say): the reader joins again without one."""
    model = model_tensors(1)
    with origin() as (srv, coordinator):
        generation = publish(srv.url, model)
        target = blank_like(model)
        with tensorwire.Subscriber(srv.url, PREFIX, target, listen_host="127.0.0.1") as sub:
            address = sub._loop.call(sub._relay_url(), 10, "starting the relay server")
            with RelayConn(srv.url) as holder:
                assert holder.join(address)[1].reader != 0  # the address is taken
                with caplog.at_level(logging.WARNING, "tensorwire.broadcast"):
                    assert sub.update(timeout=30) == generation
            assert same_bytes(model, target) and sub.joins_refused == 1 and sub.reader_id == 0
            assert any("relay join refused" in r.getMessage() for r in caplog.records)
        # The origin forgets the reader when it sees its session end, which may be after close.
        wait_for(lambda: coordinator.chains.readers() == 0, 10, "the origin to see the reader leave")


def test_tensorwire_serve_relay_networks_lets_readers_relay_on_another_interface() -> None:
    model = model_tensors(4)
    networks = ["--relay-networks", "127.0.0.0/8"]
    with ServerProcess(extra=networks) as srv, tensorwire.connect(srv.url) as trainer:
        generation = trainer.publish("policy", model)
        targets = [blank_like(model), blank_like(model)]
        with (
            tensorwire.Subscriber(srv.url, "policy", targets[0], listen_host="127.0.0.2") as first,
            tensorwire.Subscriber(srv.url, "policy", targets[1], listen_host="127.0.0.3") as second,
        ):
            assert first.update(timeout=30) == second.update(timeout=30) == generation.number
            assert all(same_bytes(model, t) for t in targets)
            assert first.reader_id and second.reader_id and first.peer.served > 0  # relayed, at 127.0.0.2
