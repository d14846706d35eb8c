"""Coordinator URLs: what ``parse_url`` accepts, and the message for each thing it refuses; the
factory's table and its refusals. Nothing here contacts a coordinator."""

from __future__ import annotations

import pytest

from tensorwire.coordinator import COORDINATORS, open_coordinator
from tensorwire.coordinator.codec import check_slot, leader_key
from tensorwire.coordinator.url import DEFAULT_PORT, DEFAULT_PREFIX, Endpoint, parse_url
from tensorwire.errors import UnsupportedTransport
from tensorwire.security import TlsFiles


def test_one_host_with_port_and_prefix() -> None:
    url = parse_url("etcd://10.0.0.5:2380/jobs/a")
    assert url.scheme == "etcd"
    assert url.endpoints == (Endpoint("10.0.0.5", 2380),)
    assert url.prefix == "/jobs/a"


def test_defaults_port_and_prefix() -> None:
    url = parse_url("etcds://etcd.example.com")
    assert url.endpoints == (Endpoint("etcd.example.com", DEFAULT_PORT),)
    assert url.prefix == DEFAULT_PREFIX
    assert parse_url("etcd://h/").prefix == DEFAULT_PREFIX
    assert parse_url("etcd://h/x/").prefix == "/x"


def test_several_hosts_and_ipv6() -> None:
    url = parse_url("etcd://a:1,[::1]:2379,[fe80::1]/p")
    assert url.endpoints == (Endpoint("a", 1), Endpoint("::1", 2379), Endpoint("fe80::1", DEFAULT_PORT))
    assert [e.target for e in url.endpoints] == ["a:1", "[::1]:2379", "[fe80::1]:2379"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("10.0.0.5:2379", "no scheme"),
        ("etcd://", "empty host"),
        ("etcd://a,,b/p", "empty host"),
        ("etcd://a:0/p", "port '0' is not in 1-65535"),
        ("etcd://a:65536/p", "not in 1-65535"),
        ("etcd://a:-1/p", "not in 1-65535"),
        ("etcd://a:2379x/p", "not in 1-65535"),
        ("etcd://a:\u0663/p", "not in 1-65535"),
        ("etcd://a:99999999999999999999/p", "not in 1-65535"),
        ("etcd://user:pw@a:2379/p", "holds credentials"),
        ("etcd://a/p?x=1", "query or fragment"),
        ("etcd://a/p#f", "query or fragment"),
        ("etcd://a b/p", "not a host name"),
        ("etcd://-a/p", "not a host name"),
        ("etcd://[::1/p", "bad IPv6 endpoint"),
        ("etcd://[zz::1]:1/p", "not an IPv6 address"),
        ("etcd://a/p q", "key prefix"),
        ("etcd://a/p//q", "key prefix"),
        ("etcd://a/p/../q", "key prefix"),
        ("etcd://a/p\x00", "key prefix"),
        ("etcd://a/" + "x" * 300, "key prefix"),
        ("etcd://" + ",".join(["a"] * 17), "over 16"),
        ("etcd://a/" + "x" * 3000, "over 2048"),
    ],
)
def test_refusals_name_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_url(url)
    assert says in str(caught.value)


def test_the_factory_table_and_its_refusals() -> None:
    assert set(COORDINATORS) == {"etcd", "etcds"}
    with pytest.raises(UnsupportedTransport, match="zookeeper:// is not one of etcd://, etcds://"):
        open_coordinator("zookeeper://a:2181/p")
    with pytest.raises(ValueError, match="TLS is etcds://"):
        open_coordinator("etcd://a/p", tls=TlsFiles())


def test_the_etcd_coordinator_refuses_half_credentials_and_unbounded_timeouts() -> None:
    pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")
    with pytest.raises(ValueError, match="both a user and a password"):
        open_coordinator("etcd://a/p", user="u")
    with pytest.raises(ValueError, match="timeout"):
        open_coordinator("etcd://a/p", timeout=0)


@pytest.mark.parametrize("slot", ["", "a/b", "..", ".", "a b", "x" * 129, "é", "a\n"])
def test_slot_names_stay_one_key_component(slot: str) -> None:
    with pytest.raises(ValueError, match="slot name"):
        check_slot(slot)


def test_leader_key_layout() -> None:
    assert leader_key("/tw", "slot-0.a_b") == b"/tw/slots/slot-0.a_b/leader"
