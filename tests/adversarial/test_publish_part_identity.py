"""Who may speak for a multi-part publish (docs/protocol.md §14.8; issue 32, class 2): its 16-byte
id is its credential, so the server never shows it (an error every part hears, and the server's
log, name a hash of it, not the id or a piece of it), and the same id under another prefix is
another transaction: a part there can neither join nor abort this one."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

import tensorwire
from tensorwire.errors import ConnectionLost, PublishAborted, WaitTimeout
from tensorwire.server.options import ServerOptions
from tensorwire.store.generations import GenerationConfig


def _pieces(txn: bytes) -> set[str]:
    """Every run of 4 bytes of ``txn``, as hex: what an error must not carry."""
    text = txn.hex()
    return {text[i : i + 8] for i in range(0, len(text) - 7, 2)}


def test_errors_and_logs_never_show_a_transactions_id(caplog: pytest.LogCaptureFixture) -> None:
    txn = os.urandom(16)
    config = GenerationConfig(max_wait_seconds=5.0)
    with (
        tensorwire.ServerThread(options=ServerOptions(generations=config)) as srv,
        caplog.at_level(logging.DEBUG),
        tensorwire.connect(srv.url, retries=0) as c,
    ):
        with pytest.raises(WaitTimeout) as timed_out:
            c.publish_part("p", {"x": torch.zeros(1)}, txn=txn, index=0, count=2, timeout=0.3)
        with pytest.raises(WaitTimeout) as late:  # remembered: a late part hears the same
            c.publish_part("p", {"y": torch.zeros(1)}, txn=txn, index=1, count=2, timeout=0.3)
    said = str(timed_out.value) + str(late.value) + caplog.text
    assert "transaction #" in str(timed_out.value)
    assert not any(piece in said for piece in _pieces(txn))


def test_the_same_id_under_another_prefix_is_another_transaction() -> None:
    txn = os.urandom(16)
    with tensorwire.ServerThread() as srv:
        parts = srv.server.generation_ops.parts

        async def main() -> None:
            async with await tensorwire.aconnect(srv.url) as a, await tensorwire.aconnect(srv.url) as b:
                mine = asyncio.ensure_future(
                    a.publish_part("mine", {"x": torch.zeros(2)}, txn=txn, index=0, count=2, timeout=10)
                )
                # the same id and index under another prefix, from a connection that then closes
                other = await tensorwire.aconnect(srv.url)
                theirs = asyncio.ensure_future(
                    other.publish_part("other", {"x": torch.zeros(2)}, txn=txn, index=0, count=2, timeout=10)
                )
                while len(parts.open) < 2:
                    await asyncio.sleep(0.01)
                await other.close()  # aborts its own transaction, not ours
                with pytest.raises(ConnectionLost):  # its client closed under it
                    await theirs
                while ("other", txn) not in parts.aborted:  # once the server has seen it close
                    await asyncio.sleep(0.01)
                assert isinstance(parts.aborted[("other", txn)], PublishAborted)
                assert not mine.done()
                done = await b.publish_part(
                    "mine", {"y": torch.ones(2)}, txn=txn, index=1, count=2, timeout=10
                )
                assert await mine == done and done.names == ("mine/x", "mine/y")

        asyncio.run(asyncio.wait_for(main(), 30))
