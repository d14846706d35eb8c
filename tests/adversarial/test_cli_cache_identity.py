"""A client cache keyed by version must also key by the store: a restarted in-memory server on
the same port counts versions from 1 again, so version 1 of ``x`` there is other bytes than the
cached version 1 of ``x``. The server says who it is in HELLO (``store_id``); old peers still work."""

from __future__ import annotations

import pytest
import torch

import tensorwire
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for
from tensorwire.types import Address, Limits
from tensorwire.wire import meta as wm


def _restart_on_same_port(old: ServerThread) -> ServerThread:
    port = Address.parse(old.url).port
    old.close()
    return ServerThread([f"tcp://127.0.0.1:{port}"])


def _put_as_another_client(url: str, value: torch.Tensor) -> int:
    with tensorwire.connect(url) as other:
        return other.put("x", value)


def test_a_restarted_server_reusing_versions_is_not_served_from_cache() -> None:
    first = ServerThread(["tcp://127.0.0.1:0"])
    try:
        with tensorwire.connect(first.url, cache_bytes=1 << 20, retries=5, backoff=0.05) as c:
            old_version = _put_as_another_client(first.url, torch.zeros(8))
            assert torch.equal(c.get("x"), torch.zeros(8))  # cached at (store A, version 1)
            second = _restart_on_same_port(first)
            first = second
            assert _put_as_another_client(second.url, torch.ones(8)) == old_version  # same version
            assert torch.equal(c.get("x"), torch.ones(8)), "served store A's bytes for store B's version"
            assert torch.equal(c.get("x"), torch.ones(8)) and c._async.cache.hits >= 1  # B is cached
    finally:
        first.close()


def test_a_lease_does_not_outlive_the_store_it_was_confirmed_by() -> None:
    first = ServerThread(["tcp://127.0.0.1:0"])
    try:
        with tensorwire.connect(first.url, cache_bytes=1 << 20, cache_lease=3600.0, retries=5) as c:
            _put_as_another_client(first.url, torch.zeros(8))
            assert torch.equal(c.get("x"), torch.zeros(8))
            assert torch.equal(c.get("x"), torch.zeros(8)) and c._async.cache.hits == 1  # leased
            second = _restart_on_same_port(first)
            first = second
            wait_for(lambda: c._async._transport is None or c._async._transport.closed, 10, "the drop")
            _put_as_another_client(second.url, torch.ones(8))
            assert torch.equal(c.get("x"), torch.ones(8))
    finally:
        first.close()


def test_hello_carries_the_store_id_only_when_asked() -> None:
    info = wm.ServerInfo(1, Limits(), 10, 0, codecs=6, store_id=0xABCDEF)
    plain = wm.encode_hello_response(info)
    with_codecs = wm.encode_hello_response(info, with_codecs=True)
    asked = wm.encode_hello_response(info, with_codecs=True, wants=wm.HELLO_WANTS_STORE_ID)
    assert len(plain) == 48 and len(with_codecs) == 49 and len(asked) == 57  # old clients see no change
    assert wm.decode_hello_response(wm.MetaReader(asked, Limits())).store_id == 0xABCDEF
    request = wm.encode_hello_request(1, 1, None, None, wm.HELLO_WANTS_STORE_ID)
    reader = wm.MetaReader(request, Limits())
    assert wm.decode_hello_request(reader)[3] == wm.Compression(0, 0)
    assert wm.decode_hello_wants(reader) == wm.HELLO_WANTS_STORE_ID


def test_two_servers_have_different_store_ids_and_clients_learn_them() -> None:
    with (
        ServerThread() as a,
        ServerThread() as b,
        tensorwire.connect(a.url) as ca,
        tensorwire.connect(b.url) as cb,
    ):
        ca.ping()
        cb.ping()
        ids = {ca._async._transport.info.store_id, cb._async._transport.info.store_id}  # type: ignore[union-attr]
        assert len(ids) == 2 and 0 not in ids


def test_a_server_from_before_store_ids_still_serves_and_nothing_is_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An older server reads no ``wants`` byte and so refuses the HELLO (bytes left over): the
    # client asks again as before, and caches nothing, since it cannot tell stores apart.
    monkeypatch.setattr(wm, "decode_hello_wants", lambda reader: 0)
    with ServerThread() as srv, tensorwire.connect(srv.url, cache_bytes=1 << 20) as c:
        c.put("x", torch.ones(2))
        assert torch.equal(c.get("x"), torch.ones(2)) and torch.equal(c.get("x"), torch.ones(2))
        assert c._async.cache.hits == 0 and c._async.cache.unverifiable == 2
