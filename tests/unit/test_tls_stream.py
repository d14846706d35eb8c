"""A tls:// stream reads every record that has arrived in one call (up to the buffer, and at most
~1 MiB past the first record): one SSL read returns one record of at most 16 KiB, and a trip
through the event loop for each cost more than decrypting it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.security.tls import client_ssl_context, server_ssl_context
from tensorwire.transport import tls
from tensorwire.transport.base import ByteStream
from tensorwire.types import Address, KiB

SENT = 256 * KiB  # 16 records; far less than loopback's socket buffers hold
RECORD = 16 * KiB


async def _reads(tmp_path: Path) -> list[int]:
    """What each ``recv_into`` returned while reading ``SENT`` bytes that were all sent first."""
    certs = write_dev_certs(tmp_path)
    sent, read = asyncio.Event(), asyncio.Event()

    async def serve(stream: ByteStream) -> None:
        await stream.send([bytes(range(256)) * (SENT // 256)])
        sent.set()
        await asyncio.wait_for(read.wait(), 10.0)  # keep the connection while the client reads

    context = server_ssl_context(TlsFiles(certs["server"], certs["server_key"]))
    listener = await tls.listen(Address("tls", "127.0.0.1", 0), serve, context)
    client = client_ssl_context(TlsFiles(ca=certs["ca"]))
    stream = await tls.connect(Address("tls", "localhost", listener.address.port), 10.0, client)
    try:
        await asyncio.wait_for(sent.wait(), 10.0)
        buf = memoryview(bytearray(SENT))
        reads: list[int] = []
        while sum(reads) < SENT:
            reads.append(await asyncio.wait_for(stream.recv_into(buf[sum(reads) :]), 10.0))
        assert bytes(buf) == bytes(range(256)) * (SENT // 256)
        return reads
    finally:
        read.set()
        await stream.close()
        await listener.close()


def test_one_read_takes_every_record_that_has_arrived(tmp_path: Path) -> None:
    reads = asyncio.run(_reads(tmp_path))
    # Record by record it took 16 reads; all of them are in, so a few reads take them all.
    assert len(reads) <= 4, reads
    assert max(reads) > RECORD, reads
