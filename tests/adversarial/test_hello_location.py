"""HELLO's location (host, rack, host identity, shm:// listener) comes from the server: a hostile or
broken one may send a label of any length and any bytes (terminal escapes for `tensorwire status`,
a non-loopback "shm://" listener to send a prefer_local client elsewhere). The client bounds and
checks each field before it keeps one; servers from before the field still work."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tensorwire
from tensorwire import topology
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.types import Limits
from tensorwire.wire import meta as wm

WANTS = wm.HELLO_WANTS_STORE_ID | wm.HELLO_WANTS_LOCATION


def _answer(where: wm.Whereabouts) -> bytes:
    info = wm.ServerInfo(1, Limits(), 10, 0, codecs=6, store_id=7, where=where)
    return wm.encode_hello_response(info, with_codecs=True, wants=WANTS)


def test_oversized_and_unprintable_labels_are_refused() -> None:
    with pytest.raises(LimitExceeded, match="exceeds 255"):
        wm.decode_hello_response(wm.MetaReader(_answer(wm.Whereabouts("h" * 300, "", 1, "")), Limits()))
    for hostile in (wm.Whereabouts("evil\x1b]0;pwned\x07", "", 1, ""), wm.Whereabouts("h", "r 1", 1, "")):
        with pytest.raises(ProtocolError, match="printable ASCII"):
            wm.decode_hello_response(wm.MetaReader(_answer(hostile), Limits()))
    with pytest.raises(ProtocolError, match="host must be 1 to 255"):  # a host label is never empty
        wm.decode_hello_response(wm.MetaReader(_answer(wm.Whereabouts("", "", 1, "")), Limits()))
    good = wm.decode_hello_response(wm.MetaReader(_answer(wm.Whereabouts("h1", "", 9, "")), Limits()))
    assert good.where == wm.Whereabouts("h1", "", 9, "") and good.store_id == 7


def test_a_server_with_a_hostile_host_label_is_refused_at_connect() -> None:
    hostile = topology.Location("evil\x1b[2J\n")
    refused = pytest.raises(ProtocolError, match="the server's host")
    with ServerThread(["tcp://127.0.0.1:0"], ServerOptions(location=hostile)) as srv, refused:
        tensorwire.connect(srv.url, retries=0)


def test_a_non_loopback_shm_listener_is_never_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:
        real = srv.server.whereabouts()
        far = real._replace(shm="shm://203.0.113.9:7070")
        monkeypatch.setattr(wm, "encode_hello_response", _with_where(wm.encode_hello_response, far))
        with tensorwire.connect(srv.url, prefer_local=True, retries=0) as c:
            assert c.transport == "tcp" and c.local_fallback is None


def test_a_server_from_before_the_location_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    old = wm.encode_hello_response
    monkeypatch.setattr(wm, "encode_hello_response", lambda info, with_codecs=False, wants=0: old(
        info, with_codecs, wants & wm.HELLO_WANTS_STORE_ID))  # fmt: skip
    with (
        ServerThread(["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]) as srv,
        tensorwire.connect(srv.url, prefer_local=True, retries=0) as c,
    ):
        assert c.transport == "tcp"
        assert c._async._transport.info.where is None  # type: ignore[union-attr]
        assert c._async._transport.info.store_id == srv.server.store_id  # type: ignore[union-attr]
        c.put("t", torch.ones(3))


def _with_where(encode: Callable[..., bytes], where: wm.Whereabouts) -> Callable[..., bytes]:
    def patched(info: wm.ServerInfo, with_codecs: bool = False, wants: int = 0) -> bytes:
        return encode(wm.ServerInfo(info.version, info.limits, info.capacity, info.used, info.codecs,
                                    info.store_id, where), with_codecs, wants)  # fmt: skip

    return patched
