"""The server warns about a listener reachable beyond loopback with neither TLS nor a token, and
asks the listener what it offers (``encrypted``, ``networked``) instead of reading its scheme."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions


def test_only_the_plaintext_network_listener_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    certs = write_dev_certs(tmp_path)
    files = TlsFiles(certs["server"], certs["server_key"])
    urls = [
        "tcp://0.0.0.0:0",
        "tls://0.0.0.0:0",
        "grpcs://0.0.0.0:0",
        "memory://exposure",
        "tcp://127.0.0.1:0",
    ]
    with (
        caplog.at_level(logging.WARNING, logger="tensorwire"),
        ServerThread(urls, ServerOptions(tls=files)) as srv,
    ):
        listeners = {a.scheme + ("-lo" if a.host == "127.0.0.1" else ""): a for a in srv.addresses}
        offered = {str(li.address.scheme): (li.encrypted, li.networked) for li in srv.server._listeners}
    warned = [r.getMessage() for r in caplog.records if "neither TLS nor a token" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(str(listeners["tcp"])), warned
    assert offered["tls"] == (True, True) and offered["grpcs"] == (True, True)
    assert offered["memory"] == (False, False)
