"""A server advertises its shm:// listener in HELLO and this client dials it (``local_listener``).
The host in that address is the server's word: this client dials it only as a loopback address
written as one, or ``localhost`` itself. Spellings that ``is_loopback`` accepts for a listen address
but that name a host to look up (``localhost.``) are refused: a resolver that sent
them to DNS would let a spoofer pick where the client goes, token in hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tensorwire import topology
from tensorwire.transport import local_listener
from tensorwire.wire import shm as ws
from tensorwire.wire.meta import Whereabouts


def _advertising(shm: str) -> object:
    where = Whereabouts("h", "", topology.host_identity(ws.shm_dir()), shm)
    return SimpleNamespace(info=SimpleNamespace(where=where))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "[::1]", "[::ffff:127.0.0.1]", "localhost"])
def test_a_loopback_address_or_localhost_is_dialed(host: str) -> None:
    listener = local_listener(_advertising(f"shm://{host}:7000"))  # type: ignore[arg-type]
    assert listener is not None and listener.port == 7000


@pytest.mark.parametrize("host", ["localhost.", "LOCALHOST.", "evil.example", "10.0.0.1", "0.0.0.0"])
def test_a_name_to_resolve_or_another_host_is_not(host: str) -> None:
    assert local_listener(_advertising(f"shm://{host}:7000")) is None  # type: ignore[arg-type]
