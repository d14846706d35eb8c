"""A host share (``Subscriber(share=...)``) is a listener of its own, held to the origin's rules: a
follower reads and nothing else (no put, no publish), followers that pin generations until its
store is full fail themselves, not their leader's update, and only for as long as a view's pin
lasts, and a leader that proves itself to the origin with a client certificate shares only with a
token (docs/protocol.md §16)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire.errors import ProtocolError
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import blank_like, model_tensors, origin, reader_certs, same_bytes

PLAIN = "policy/"  # plain versioned tensors under a common prefix, 16 KiB relay chunks
TOKEN = "s3cret"


def test_a_follower_reads_the_share_and_can_change_nothing_in_it() -> None:
    model = model_tensors(1)
    with origin(token=TOKEN) as (srv, _), tensorwire.connect(srv.url, token=TOKEN) as trainer:
        trainer.put_many({PLAIN + k: v for k, v in model.items()})
        with tensorwire.Subscriber(srv.url, PLAIN, blank_like(model), token=TOKEN, listen_host="127.0.0.1",
                                   deltas=False, share="shm://127.0.0.1:0") as leader:  # fmt: skip
            generation = leader.update(30)
            with tensorwire.connect(leader.share_url, token=TOKEN) as follower:
                with pytest.raises(ProtocolError):  # a small tensor (inline) and a large one (segment)
                    follower.put("policy/x", torch.ones(4))
                with pytest.raises(ProtocolError):
                    follower.put("policy/y", torch.ones(1 << 16))
            # Its control port speaks the frame protocol to anyone on the host: a publish through it.
            raw_url = leader.share_url.replace("shm://", "tcp://")
            with tensorwire.connect(raw_url, token=TOKEN) as raw, pytest.raises(ProtocolError):
                raw.publish("policy", {"fc1.weight": torch.zeros(256, 300)})
            with tensorwire.HostReader(leader.share_url, PLAIN, token=TOKEN) as reader:
                assert reader.update(10) == generation and same_bytes(reader.tensors, model)


def test_followers_that_fill_the_share_do_not_fail_their_leader(caplog: pytest.LogCaptureFixture) -> None:
    with origin() as (srv, _), tensorwire.connect(srv.url) as trainer:
        trainer.put_many({PLAIN + k: v for k, v in model_tensors(0).items()})
        target = blank_like(model_tensors(0))
        with tensorwire.Subscriber(srv.url, PLAIN, target, listen_host="127.0.0.1", deltas=False,
                                   share="shm://127.0.0.1:0") as leader:  # fmt: skip
            leader.update(30)
            held: list[dict[str, torch.Tensor]] = []  # every generation's views: each pins its own
            with tensorwire.HostReader(leader.share_url, PLAIN) as reader, caplog.at_level(logging.WARNING):
                for seed in range(1, 12):
                    trainer.put_many({PLAIN + k: v for k, v in model_tensors(seed).items()})
                    number = leader.update(30)  # its own update brought it, whatever the share says
                    assert same_bytes(target, model_tensors(seed)) and leader.generation == number
                    reader.update(10)
                    held.append(dict(reader.tensors))
                    if leader.share_failures:
                        break
            assert leader.share_failures >= 1
            assert any("host share did not take" in r.getMessage() for r in caplog.records)
            del held


def test_a_leader_with_a_client_certificate_and_no_token_cannot_share(tmp_path: Path) -> None:
    _, reader = reader_certs(tmp_path)
    with pytest.raises(ValueError, match="give it a token"):
        tensorwire.Subscriber("tls://127.0.0.1:1", "policy", {"w": torch.zeros(4)}, tls=reader,
                              relay=False, share="shm://127.0.0.1:0")  # fmt: skip


def test_a_followers_views_pin_the_share_only_for_a_while() -> None:
    """A follower keeps every generation's views: once their pins run out (``share_lease_seconds``,
    as ``--max-lease-seconds`` bounds them on a server) the share takes new generations again, and
    the views it still holds read on (their segments are never reused)."""
    with origin() as (srv, _), tensorwire.connect(srv.url) as trainer:
        trainer.put_many({PLAIN + k: v for k, v in model_tensors(0).items()})
        blank = blank_like(model_tensors(0))
        with tensorwire.Subscriber(srv.url, PLAIN, blank, listen_host="127.0.0.1", deltas=False,
                                   share="shm://127.0.0.1:0", share_lease_seconds=2.0) as leader:  # fmt: skip
            leader.update(30)
            held: list[dict[str, torch.Tensor]] = []
            seeds = iter(range(1, 1000))
            with tensorwire.HostReader(leader.share_url, PLAIN) as reader:
                while not leader.share_failures and len(held) < 12:
                    trainer.put_many({PLAIN + k: v for k, v in model_tensors(next(seeds)).items()})
                    leader.update(30)
                    reader.update(10)
                    held.append(dict(reader.tensors))
                assert leader.share_failures >= 1  # the follower's pins filled it

                def shared_again() -> bool:
                    trainer.put_many({PLAIN + k: v for k, v in model_tensors(next(seeds)).items()})
                    number = leader.update(30)
                    with tensorwire.HostReader(leader.share_url, PLAIN) as fresh:
                        return fresh.update(10) == number

                wait_for(shared_again, 20, "the share to take a new generation again", interval=0.2)
                assert same_bytes(held[0], model_tensors(1))  # still the generation it was, views and all
