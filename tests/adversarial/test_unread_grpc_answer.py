"""A gRPC peer that never reads a unary answer keeps it in the server's memory: grpcio holds the
message until it is sent. DownloadTensor's answer (up to 256 MiB each) counts against the capacity
until the call is over, so a few such peers cannot take memory nothing accounts for.

The peer here speaks HTTP/2 by hand and opens every stream with a flow-control window of 0, so the
server can send the answer's headers but not its data: what a reader that stalls looks like."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire.errors import CapacityExceeded
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import wait_for

MiB = 1 << 20
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _HEADERS, _DATA = 4, 1, 0
_ACK = _END_STREAM = 1
_END_HEADERS = 4
_INITIAL_WINDOW_SIZE = 4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK header field, literal without indexing, no Huffman coding (RFC 7541 §6.2.2)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


@pytest.fixture
def stalled_download() -> Iterator[tuple[TensorStore, socket.socket, int]]:
    """A server holding a 16 MiB tensor, and a raw connection that asked for it and reads nothing."""
    store = TensorStore(capacity=40 * MiB)
    with ServerThread(["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], store=store) as server:
        with tensorwire.connect(server.url) as client:
            client.put("big", torch.ones(4 * MiB))
        base = store.used
        host, port = str(server.addresses[1]).removeprefix("grpc://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0, struct.pack(">HI", _INITIAL_WINDOW_SIZE, 0)))
            sock.recv(4096)  # the server's SETTINGS
            sock.sendall(_frame(_SETTINGS, _ACK, 0))
            fields = [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                      (":path", "/tensor_service.TensorService/DownloadTensor"),
                      ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
            message = b"\x0a\x03big"  # TensorRequest(tensor_name="big")
            body = b"\x00" + struct.pack(">I", len(message)) + message
            headers = _frame(_HEADERS, _END_HEADERS, 1, b"".join(_literal(k, v) for k, v in fields))
            sock.sendall(headers + _frame(_DATA, _END_STREAM, 1, body))
            yield store, sock, base


def test_an_unread_answer_counts_against_the_capacity_until_the_call_ends(
    stalled_download: tuple[TensorStore, socket.socket, int],
) -> None:
    store, sock, base = stalled_download
    wait_for(lambda: store.used >= base + 16 * MiB, 10, "the unread answer to be counted")
    with pytest.raises(CapacityExceeded):  # 16 MiB stored + 16 MiB held: another 16 MiB does not fit
        store.reserve([tensorwire.TensorMeta("other", torch.float32, (4 * MiB,), 16 * MiB)])
    sock.close()  # the call ends: its answer is let go
    wait_for(lambda: store.used == base, 10, "the answer's bytes to be released")
