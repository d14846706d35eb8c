"""bench/tls_loop.py: the ssl module's own stream, and its peer's bound on what a request asks."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from tensorwire.bench import tls_loop
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.security.tls import client_ssl_context


def test_the_loop_moves_the_bytes_and_its_peer_refuses_a_count_past_its_buffer(tmp_path: Path) -> None:
    certs = write_dev_certs(tmp_path)
    port, stop = tls_loop._start(certs, 4096)
    try:
        data, out = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)
        with tls_loop.SslLoop(port, certs["ca"]) as loop:
            loop.put("ignored", data)
            loop.get("ignored", out)
        assert torch.equal(out, data)  # through TLS both ways, as the last put left the peer's buffer
        context = client_ssl_context(TlsFiles(ca=certs["ca"]))
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with raw, context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(tls_loop._REQUEST.pack(tls_loop.GET, 4097))  # one byte past the buffer
            assert tls.recv(1) == b""  # the connection ends; nothing was sent
        with tls_loop.SslLoop(port, certs["ca"]) as loop:  # the next connection is served
            loop.get("ignored", out := torch.ones(1024))
        assert torch.equal(out, data)
    finally:
        stop()


def test_tls_is_judged_by_the_lower_of_put_and_get_each_over_the_loops_own() -> None:
    report = tls_loop.report(2.0, 1.0, tls_put=1.5, tls_get=0.9)
    assert report == {"tls_ssl_loop_put_gbps": 2.0, "tls_ssl_loop_get_gbps": 1.0, "tls_vs_ssl_loop": 0.75}
