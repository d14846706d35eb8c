"""An upstream that has served nothing yet in a generation is not trusted with a reader's time: it
gets ``peer_timeout`` to its first chunk, not a whole stall. And one stalled (or hostile) peer does
not cost the honest readers strung behind it their place: a reader that had to route around its own
upstream is not dropped by the first report of the reader waiting on it (docs/protocol.md §15.3)."""

from __future__ import annotations

import threading
import time

import tensorwire
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import (
    PREFIX,
    blank_like,
    model_tensors,
    origin,
    publish,
    same_bytes,
    stalled_peer,
)

STALL = 30.0  # each later chunk may keep a reader waiting this long: far more than the test takes


def test_an_upstream_that_has_served_nothing_gets_peer_timeout_to_its_first_chunk() -> None:
    model = model_tensors(1)
    with origin() as (srv, coordinator):
        publish(srv.url, model)
        with stalled_peer(srv.url) as stalled:
            assert stalled.reader != 0
            target = blank_like(model)
            started = time.monotonic()
            with tensorwire.Subscriber(srv.url, PREFIX, target, listen_host="127.0.0.1", peer_timeout=0.5,
                                       stall_timeout=STALL) as sub:  # fmt: skip
                sub.update(timeout=4 * STALL)  # a stall's worth per chunk would be half of it (60 s)
                took = time.monotonic() - started
            assert same_bytes(model, target)
            (gen,) = coordinator.chains.stats(PREFIX)["generations"]  # type: ignore[misc]
            assert gen["dropped"] == 1  # the stalled one, reported once
    assert took < STALL / 2, f"the reader waited {took:.1f}s on an upstream that never sent a chunk"


def test_readers_behind_a_stalled_peer_keep_their_place() -> None:
    """A, stalled; B behind it; C behind B. B's first chunk never comes, so C has nothing either:
    B routes around A, and C, which waited on B meanwhile, reads from the origin but does not get B
    dropped: only A is."""
    model = model_tensors(2)
    with origin() as (srv, coordinator):
        publish(srv.url, model)
        with stalled_peer(srv.url) as stalled:
            targets = [blank_like(model), blank_like(model)]
            options = {"listen_host": "127.0.0.1", "peer_timeout": 0.5, "stall_timeout": STALL, "window": 1}
            subs = [tensorwire.Subscriber(srv.url, PREFIX, t, **options) for t in targets]
            started = time.monotonic()
            try:
                b = threading.Thread(target=subs[0].update, args=(4 * STALL,), daemon=True)
                b.start()
                wait_for(lambda: coordinator.chains.readers() == 2, 10, "B to join behind the stalled peer")
                subs[1].update(4 * STALL)
                b.join(4 * STALL)
                took = time.monotonic() - started
                assert not b.is_alive() and all(same_bytes(model, t) for t in targets)
                assert took < STALL / 2, f"B and C waited {took:.1f}s behind a peer that never sent a chunk"
                (gen,) = coordinator.chains.stats(PREFIX)["generations"]  # type: ignore[misc]
                assert gen["dropped"] == 1, gen  # A only
                assert subs[0].reader_id and subs[1].reader_id  # both still registered, upstreams
            finally:
                for sub in subs:
                    sub.close()
            assert stalled.reader != 0
