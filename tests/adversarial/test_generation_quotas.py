"""Tables of generation state one client could fill for everyone (issue 32, class 4): prefixes
(``--prefixes-per-client``, and GEN_DROP gives one back: the table is not one only a restart
empties), multi-part publishes per client host (``--transactions-per-client``, over all its
connections); and every bound a refusal names is a flag ``tensorwire serve`` has."""

from __future__ import annotations

import asyncio
import os

import click
import pytest
import torch

import tensorwire
from tensorwire.cli.serve import serve
from tensorwire.client.ranges import RangeRead
from tensorwire.errors import KeyNotFound, LimitExceeded, WaitTimeout
from tensorwire.server.options import ServerOptions
from tensorwire.store.generation_config import FLAGS, GenerationConfig
from tensorwire.testing.process import wait_for
from tensorwire.wire.tensors import byte_view


def test_every_bound_a_refusal_names_is_a_serve_flag_that_sets_it() -> None:
    flags = {opt for param in serve.params if isinstance(param, click.Option) for opt in param.opts}
    assert set(FLAGS.values()) <= flags
    assert GenerationConfig().most("max_parts") == "at most 4096 (--max-parts)"
    ctx = serve.make_context("serve", ["--max-prefixes", "7", "--transactions-per-client", "3"])
    assert ctx.params["max_prefixes"] == 7
    assert ctx.params["transactions_per_client"] == 3


def test_one_client_makes_a_bounded_number_of_prefixes_and_a_drop_gives_one_back() -> None:
    config = GenerationConfig(prefixes_per_client=2, max_prefixes=10)
    with (
        tensorwire.ServerThread(options=ServerOptions(generations=config)) as srv,
        tensorwire.connect(srv.url) as c,
    ):
        store = srv.server.store
        c.publish("p1", {"x": torch.zeros(1 << 16)})
        c.publish("p2", {"x": torch.zeros(1)})
        c.publish("p1", {"x": torch.ones(1 << 16)})  # a prefix it has is no new one
        with pytest.raises(
            LimitExceeded, match=r"made 2 prefixes with generations: at most 2 \(--prefixes-per-client\)"
        ):
            c.publish("p3", {"x": torch.zeros(1)})
        assert c.drop_generations("p1") == 2
        assert store.kept < 1 << 16  # its memory went with it
        with pytest.raises(KeyNotFound):
            c.manifest("p1")
        with pytest.raises(KeyNotFound):
            c.drop_generations("p1")
        c.publish("p3", {"x": torch.zeros(1)})  # room again
        with pytest.raises(KeyNotFound):
            c.drop_generations("_ps/job")  # the server's own prefixes are not a client's to drop


def test_a_prefix_dropped_while_it_is_leased_ends_the_lease_and_frees_its_memory() -> None:
    with tensorwire.ServerThread() as srv, tensorwire.connect(srv.url) as c:
        c.publish("busy", {"x": torch.arange(10.0)})
        lease = c.lease("busy", 1, 30)
        with c.read_generation("busy") as read:
            assert c.drop_generations("busy") == 1
            assert srv.server.generations.leases == 0  # the leases ended with the prefix
            with pytest.raises(KeyNotFound, match="no prefix with generations"):
                read.read([RangeRead("busy/x", 0, byte_view(torch.empty(10)))])
        lease.release()  # nothing left to release: no error
        assert srv.server.store.kept == 0


def test_one_client_host_has_parts_in_a_bounded_number_of_transactions() -> None:
    config = GenerationConfig(transactions_per_owner=2, transactions_per_client=3, max_transactions=10,
                              max_wait_seconds=5.0)  # fmt: skip
    with tensorwire.ServerThread(options=ServerOptions(generations=config)) as srv:
        parts = srv.server.generation_ops.parts

        async def part(c: tensorwire.AsyncClient) -> asyncio.Future[object]:
            coro = c.publish_part("t", {"x": torch.zeros(1)}, txn=os.urandom(16), index=0, count=2, timeout=2)
            return asyncio.ensure_future(coro)

        async def main() -> None:
            a, b = await tensorwire.aconnect(srv.url), await tensorwire.aconnect(srv.url)
            try:
                held = [await part(a), await part(a)]
                with pytest.raises(LimitExceeded, match=r"at most 2 \(--transactions-per-connection\)"):
                    await (await part(a))
                held.append(await part(b))
                await _until(lambda: len(parts.open) == 3)
                with pytest.raises(
                    LimitExceeded, match=r"parts in 3 publishes: at most 3 \(--transactions-per-client\)"
                ):
                    await (await part(b))
                for future in held:
                    with pytest.raises(WaitTimeout):
                        await future
            finally:
                await a.close()
                await b.close()

        asyncio.run(main())
        wait_for(lambda: not parts.open and not parts._client_txns, 10, "every transaction to be uncounted")


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
