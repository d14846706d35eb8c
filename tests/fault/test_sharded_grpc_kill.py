"""A process SIGKILLed halfway through its gRPC PublishPart (its connection dies with it): the
other part's call is answered at once with PublishAborted (not at the transaction's timeout),
nothing of the new generation is visible, the previous one stays readable, and the server's held
bytes return to what they were. The gRPC twin of tests/fault/test_sharded_faults.py's killed rank."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire.client.ranges import RangeRead
from tensorwire.errors import PublishAborted
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for
from tensorwire.wire.tensors import byte_view

# The victim: part 1 of 2 of txn (hex), one 1 MiB tensor, of which it sends the first half and
# then stops (writing READY) until it is killed.
VICTIM = """
import asyncio, sys, time
from pathlib import Path
import grpc, torch
from tensorwire.types import TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.rpc import SERVICE, encode_chunk, info_of, part_info

target, txn, ready = sys.argv[1], bytes.fromhex(sys.argv[2]), Path(sys.argv[3])
size, cut = 1 << 20, 1 << 16
meta = TensorMeta("p/b", torch.uint8, (size,), size)
head = part_info(wg.PartHead("p", txn, 1, 2, 20000))

async def chunks():
    for start in range(0, size // 2, cut):
        piece = bytes(cut)
        first = start == 0
        yield encode_chunk(piece, ChecksumKind.XXH3_64, checksum(ChecksumKind.XXH3_64, piece),
                           info_of(meta) if first else None, head if first else None)
    ready.write_text("halfway")
    await asyncio.sleep(600)  # SIGKILLed long before

async def main():
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_unary(f"/{SERVICE}/PublishPart", None, pb.GenerationInfo.FromString)
        await call(chunks(), timeout=600)

asyncio.run(main())
"""


def test_a_process_killed_halfway_through_its_grpc_part_aborts_the_transaction_at_once(
    tmp_path: Path,
) -> None:
    with ServerThread(["grpc://127.0.0.1:0"]) as srv:
        address = srv.addresses[0]
        store = srv.server.store
        with tensorwire.connect(srv.url) as client:
            before = client.publish_part("p", {"a": torch.arange(8.0)}, txn=os.urandom(16), index=0,
                                         count=1, timeout=5)  # fmt: skip
        held = store.used
        txn = os.urandom(16)
        ready = tmp_path / "ready"
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM, f"{address.host}:{address.port}", txn.hex(), str(ready)]
        )
        try:

            async def main() -> None:
                async with await tensorwire.aconnect(srv.url) as c:
                    other = asyncio.ensure_future(
                        c.publish_part("p", {"a": torch.zeros(8)}, txn=txn, index=0, count=2, timeout=20)
                    )
                    while not ready.exists() or store.reserved < (1 << 20):
                        assert victim.poll() is None, "the victim ended by itself"
                        await asyncio.sleep(0.02)
                    victim.send_signal(signal.SIGKILL)
                    # At once: well before the transaction's 20 s timeout (WaitTimeout).
                    aborted = r"aborted: (the call that sent its part 1 closed|part 1 failed)"
                    with pytest.raises(PublishAborted, match=aborted):
                        await asyncio.wait_for(other, 8)

            asyncio.run(asyncio.wait_for(main(), 40))
        finally:
            victim.kill()
            victim.wait(10)
        parts = srv.server.generation_ops.parts
        wait_for(lambda: not parts.open and store.reserved == 0 and store.used == held, 10, "bytes freed")
        latest = srv.server.generations.latest("p")
        assert latest is not None and latest.number == before.number  # nothing of the new one
        with tensorwire.connect(srv.url) as client, client.read_generation("p") as read:
            assert read.generation == before
            out = torch.zeros(8)
            read.read([RangeRead("p/a", 0, byte_view(out))])
            assert torch.equal(out, torch.arange(8.0))
