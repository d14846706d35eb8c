"""DIGEST (the server extension ``dataset scatter`` checks what landed with) against hostile peers,
on real servers and sockets: a request of too many names, an answer that would outgrow the
server's metadata limit, a server that answers for names nobody asked about, and the hashing of
large tensors kept off the threads the store's own work runs on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from tensorwire import ServerThread, TensorStore, connect
from tensorwire.dataset import DigestService
from tensorwire.dataset.digest import MAX_NAMES, encode_request, fetch_digests
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.server.core import Request
from tensorwire.server.options import ServerOptions
from tensorwire.transport import TransportOptions, open_transport
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode


def _served(limits: Limits | None = None) -> ServerThread:
    store = TensorStore(1 << 30)
    options = ServerOptions(limits=limits or Limits())
    return ServerThread(options=options, store=store, extensions=[DigestService(store)])


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with _served() as srv:
        yield srv


def _on(url: str, work: Callable[[FramedTransport], Awaitable[None]]) -> None:
    async def run() -> None:
        conn = await open_transport(Address.parse(url), TransportOptions(5.0, 5.0))
        assert isinstance(conn, FramedTransport)
        try:
            await work(conn)
        finally:
            await conn.close()

    asyncio.run(run())


def test_a_digest_of_too_many_names_is_refused_and_the_server_goes_on(server: ServerThread) -> None:
    with connect(server.url) as client:
        client.put("d/x", torch.arange(4))

    async def work(conn: FramedTransport) -> None:
        names = [f"d/{i}" for i in range(MAX_NAMES + 1)]
        with pytest.raises(LimitExceeded, match=f"at most {MAX_NAMES}"):
            await conn.call(Opcode.DIGEST, encode_request(names), what="too many digests")
        assert list(await fetch_digests(conn, ["d/x"])) == ["d/x"]  # the connection goes on

    _on(server.url, work)


def test_a_digest_answer_over_the_metadata_limit_is_refused(tmp_path: Any) -> None:
    """Each answer record is larger than the name that asked for it (dtype, shape, sizes, the
    digest): 50 long names of 8-D tensors fit a 48 KiB request, not a 48 KiB answer."""
    with _served(Limits(max_meta_bytes=48 << 10)) as srv:
        names = [f"d/{i:02d}-" + "n" * 896 for i in range(50)]
        with connect(srv.url) as client:
            for name in names:
                client.put(name, torch.zeros((1, 1, 1, 1, 1, 1, 1, 2)))

        async def work(conn: FramedTransport) -> None:
            with pytest.raises(LimitExceeded, match="metadata limit"):
                await fetch_digests(conn, names)
            assert len(await fetch_digests(conn, names[:10])) == 10

        _on(srv.url, work)


class _Liar:
    """A server extension that answers DIGEST for a name of its own choosing (a hostile server)."""

    def frame_handlers(self) -> Mapping[int, Callable[[Request], Awaitable[None]]]:
        return {Opcode.DIGEST: self._lie}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        return None

    async def _lie(self, request: Request) -> None:
        request.meta.u8()
        wm.decode_names(request.meta)
        meta = TensorMeta("not/asked", torch.uint8, (3,), 3, 1)
        record = wm.encode_record(meta) + (7).to_bytes(8, "little")
        await request.reply((2).to_bytes(4, "little") + record + record)


def test_a_sender_takes_digests_only_of_names_it_asked_for() -> None:
    with ServerThread(extensions=[_Liar()]) as liar:  # type: ignore[list-item]

        async def work(conn: FramedTransport) -> None:
            with pytest.raises(ProtocolError, match="not asked for"):
                await fetch_digests(conn, ["asked/a", "asked/b"])

        _on(liar.url, work)


def test_large_tensors_are_hashed_on_the_digest_services_own_threads(server: ServerThread) -> None:
    """Not on the event loop's default executor, which the store's commits use: a flood of
    DIGESTs queues behind itself."""
    with connect(server.url) as client:
        client.put("d/big", torch.zeros(1 << 20, dtype=torch.int32))  # 4 MiB: hashed off the loop

    async def work(conn: FramedTransport) -> None:
        assert list(await fetch_digests(conn, ["d/big"])) == ["d/big"]

    _on(server.url, work)
    assert any(t.name.startswith("tw-digest") for t in threading.enumerate())
    with pytest.raises(ValueError, match="at least 1"):
        DigestService(TensorStore(1 << 20), hash_threads=0)
