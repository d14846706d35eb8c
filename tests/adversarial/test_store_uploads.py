"""Item 13: resumable-upload slots are not a pool one client can drain for the others.

Eight abandoned 8 KiB resumable uploads from one client made another client's 64 MiB put fail
with LimitExceeded. Now small puts keep no upload state (``--resumable-min-bytes``), each client
host holds at most ``--uploads-per-client`` (a new one replaces its own least recently touched
idle upload), and a full table (``--max-uploads``) replaces the least recently touched idle one.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

import torch

import tensorwire
from tensorwire.errors import ErrorCode
from tensorwire.testing.process import ServerProcess
from tensorwire.types import Address, KiB, Limits, MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import HEADER_BYTES, Header, Opcode, decode_header, encode_frame_head

CHUNK = 4 * KiB
SMALL = TensorMeta("small", torch.uint8, (8 * KiB,), 8 * KiB)


@contextlib.contextmanager
def connection(url: str, source: str = "127.0.0.1") -> Iterator[socket.socket]:
    """A raw connection to ``url`` from the loopback address ``source`` (another client host)."""
    address = Address.parse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.bind((source, 0))
        sock.connect((address.host, address.port))
        yield sock
    finally:
        sock.close()


def resumable_frame(upload: int, meta: TensorMeta, offset: int, data_len: int) -> bytes:
    block = wm.encode_resumable(upload, offset, meta)
    header = Header(1, Opcode.PUT_RESUMABLE, 0, ChecksumKind.XXH3_64, 1, len(block), CHUNK, data_len)
    return encode_frame_head(header, block)


def abandon(url: str, upload: int, meta: TensorMeta, source: str = "127.0.0.1") -> None:
    """Send a resumable upload of ``meta`` whose first chunk is good and second damaged, and go
    away: the server keeps the upload (resumable from the good chunk) unless it is too small."""
    chunk = bytes(CHUNK)
    good = chunk + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, chunk))
    bad = chunk + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, chunk) ^ 1)
    assert meta.nbytes == 2 * CHUNK
    with connection(url, source) as sock:
        sock.sendall(resumable_frame(upload, meta, 0, meta.nbytes) + good + bad)
        header, reader = reply(sock)
        assert header.is_error and wm.decode_error(reader)[0] == ErrorCode.CORRUPT_FRAME


def resume_point(url: str, upload: int, meta: TensorMeta, source: str = "127.0.0.1") -> int:
    """What the server answers a client that asks where to resume ``upload``."""
    with connection(url, source) as sock:
        sock.sendall(resumable_frame(upload, meta, wm.RESUME_QUERY, 0))
        header, reader = reply(sock)
        assert not header.is_error, wm.decode_error(reader)
        return reader.u64()


def reply(sock: socket.socket) -> tuple[Header, wm.MetaReader]:
    header = decode_header(recv_exactly(sock, HEADER_BYTES), Limits())
    return header, wm.MetaReader(recv_exactly(sock, header.meta_len), Limits())


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        assert got, "the server closed the connection"
        out += got
    return bytes(out)


def test_abandoned_small_uploads_take_no_slot_from_a_large_put() -> None:
    """The issue's case (the old table had --max-connections slots): abandoned small resumable
    puts leave nothing behind, and a large resumable put of another client goes through."""
    with ServerProcess(capacity="256MiB", extra=["--max-connections", "10"]) as srv:
        for upload in range(1, 13):
            abandon(srv.url, upload, SMALL)
        with tensorwire.connect(srv.url, retries=0, resumable_bytes=64 * MiB) as c:
            c.put("big", torch.ones(16 * MiB))  # 64 MiB: PUT_RESUMABLE, which needs a slot
        assert resume_point(srv.url, 1, SMALL) == 0  # no state was kept for a small put


def test_one_client_host_cannot_take_another_hosts_uploads() -> None:
    """With 2 uploads per client: a client that abandons many replaces only its own; another
    host's uploads keep their verified bytes, and each client sees only its own uploads."""
    limits = ["--max-uploads", "8", "--uploads-per-client", "2", "--resumable-min-bytes", "4KiB"]
    with ServerProcess(capacity="64MiB", extra=limits) as srv:
        abandon(srv.url, 101, SMALL)
        abandon(srv.url, 102, SMALL)
        for upload in range(1, 10):  # another host abandons nine uploads
            abandon(srv.url, upload, SMALL, source="127.0.0.2")
        assert resume_point(srv.url, 101, SMALL) == CHUNK  # the victim's uploads are all there
        assert resume_point(srv.url, 102, SMALL) == CHUNK
        assert resume_point(srv.url, 9, SMALL, source="127.0.0.2") == CHUNK  # its newest two
        assert resume_point(srv.url, 8, SMALL, source="127.0.0.2") == CHUNK
        assert resume_point(srv.url, 1, SMALL, source="127.0.0.2") == 0  # its oldest were replaced
        assert resume_point(srv.url, 101, SMALL, source="127.0.0.2") == 0  # not another's upload


def test_a_full_table_replaces_the_least_recently_touched_idle_upload() -> None:
    limits = ["--max-uploads", "3", "--uploads-per-client", "3", "--resumable-min-bytes", "4KiB"]
    with ServerProcess(capacity="64MiB", extra=limits) as srv:
        for upload in (1, 2, 3):
            abandon(srv.url, upload, SMALL)
        assert resume_point(srv.url, 1, SMALL) == CHUNK  # touched: 2 is now the least recent
        abandon(srv.url, 4, SMALL, source="127.0.0.2")
        assert [resume_point(srv.url, u, SMALL) for u in (1, 2, 3)] == [CHUNK, 0, CHUNK]
        assert resume_point(srv.url, 4, SMALL, source="127.0.0.2") == CHUNK
