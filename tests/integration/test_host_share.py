"""Per-host fan-out with real processes (README, "Publish once, read by many"): one leader process
reads from the origin and shares each generation over shm://; two follower processes read it as
views of the leader's segments, bit-exact, at the leader's generation, with no network bytes; the
origin sends the model about once; a leader killed with SIGKILL fails its followers clearly and
at once, while the views they hold stay readable."""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire.errors import AuthenticationError, ConnectError, ConnectionLost
from tensorwire.server import ServerThread
from tensorwire.store.shm import clean_stale
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import model_bytes, model_tensors, origin, same_bytes, segment_mapping
from tensorwire.wire import shm as ws

PREFIX = "policy"
TOKEN = "s3cret"
FOLLOWERS = 2

# The leader: a Subscriber that shares; it prints its share address, then one generation per update.
_LEADER = """
import sys
import tensorwire
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import blank_like, model_tensors

sub = tensorwire.Subscriber(sys.argv[1], "policy", blank_like(model_tensors(1)), token=sys.argv[2],
                            listen_host="127.0.0.1", share="shm://127.0.0.1:0")
print(sub.share_url, flush=True)
for line in sys.stdin:
    print(sub.update(timeout=30), flush=True)
"""

# A follower: per command ("update" or "wait") the generation its views hold, each tensor's sha256,
# and the mapping each view of 64 KiB or more lies in (a read-only segment: a view, not a copy).
_FOLLOWER = """
import hashlib, json, sys
import torch
import tensorwire
from tensorwire.testing.process import wait_for
from tensorwire.testing.relay import segment_mapping

reader = tensorwire.HostReader(sys.argv[1], "policy", token=sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    try:
        n = reader.wait_and_update(30) if line.strip() == "wait" else reader.update(10)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        continue
    big = [v for v in reader.tensors.values() if v.nbytes >= 64 << 10]
    print(json.dumps({
        "generation": n,
        "sha": {k: hashlib.sha256(v.reshape(-1).view(torch.uint8).numpy()).hexdigest()
                for k, v in reader.tensors.items()},
        "views": [segment_mapping(v) for v in big],
    }), flush=True)
"""


class Child:
    """A python child speaking one line per command; always killed by the test that made it."""

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"waited {timeout}s for a line from child {self.proc.pid}")
        return self.proc.stdout.readline().strip()

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def ask(self, command: str, timeout: float = 30.0) -> str:
        self.send(command)
        return self.line(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@dataclass
class Host:
    origin: ServerThread
    trainer: tensorwire.Client
    leader: Child
    share_url: str
    followers: list[Child]


@contextlib.contextmanager
def _host() -> Iterator[Host]:
    """An origin in this process, a leader process, FOLLOWERS follower processes (started together:
    each imports torch)."""
    children: list[Child] = []
    with (
        origin(token=TOKEN, generations=True) as (srv, _),
        tensorwire.connect(srv.url, token=TOKEN) as trainer,
    ):
        try:
            leader = Child(_LEADER, srv.url, TOKEN)
            children.append(leader)
            share_url = leader.line(60)
            assert share_url.startswith("shm://127.0.0.1:")
            followers = [Child(_FOLLOWER, share_url, TOKEN) for _ in range(FOLLOWERS)]
            children += followers
            assert [f.line(60) for f in followers] == ["ready"] * FOLLOWERS
            yield Host(srv, trainer, leader, share_url, followers)
        finally:
            for child in children:
                child.kill()
            clean_stale(ws.shm_dir())  # what the killed leader left


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    """One host for the tests that leave it working. Each shares the generation it reads itself
    (``share``): they pass alone, in any order, and split across pytest-xdist workers."""
    with _host() as made:
        yield made


@pytest.fixture
def own_host() -> Iterator[Host]:
    """A host of the test's own, for the test that kills its leader."""
    with _host() as made:
        yield made


def share(host: Host, seed: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Publish model ``seed`` at the origin and have the leader read it: (its generation, the model)."""
    model = model_tensors(seed)
    generation = host.trainer.publish(PREFIX, model).number
    assert host.leader.ask("update") == str(generation)
    return generation, model


def sha(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.reshape(-1).view(torch.uint8).numpy()).hexdigest() for k, v in tensors.items()
    }


def answers(host: Host, command: str) -> list[dict[str, Any]]:
    for follower in host.followers:
        follower.send(command)
    return [json.loads(follower.line(30)) for follower in host.followers]


def test_followers_read_the_leaders_generation_as_views_and_the_origin_sends_it_once(host: Host) -> None:
    served = host.origin.server.status()["relay"]["served_bytes"].get(PREFIX, 0)
    generation, model = share(host, 1)
    expected = sha(model)
    for got in answers(host, "update"):
        assert got["generation"] == generation
        assert got["sha"] == expected
        assert got["views"] == ["r--s"], "a follower's tensor is not a read-only view of a leader's segment"
    served = host.origin.server.status()["relay"]["served_bytes"][PREFIX] - served
    assert 0 < served <= 1.1 * model_bytes(model)  # one network copy into the host, not one per rank


def test_a_waiting_follower_wakes_on_the_leaders_next_generation(host: Host) -> None:
    waiter = host.followers[0]
    waiter.ask("update")  # holds what the leader shares now (an error if nothing yet): waits for the next
    waiter.send("wait")
    generation, second = share(host, 2)
    got = json.loads(waiter.line(30))
    assert got["generation"] == generation and got["sha"] == sha(second)


def test_a_reader_needs_the_leaders_token_and_its_views_are_read_only(host: Host) -> None:
    number, model = share(host, 3)
    for token in (None, "wrong"):
        with (
            tensorwire.HostReader(host.share_url, PREFIX, token=token) as stranger,
            pytest.raises(AuthenticationError),
        ):
            stranger.update(10)
    with tensorwire.HostReader(host.share_url, PREFIX, token=TOKEN) as reader:
        assert reader.update(10) == number == host.trainer.manifest(PREFIX).generation.number
        assert segment_mapping(reader.tensors["fc1.weight"]) == "r--s"
        into = {k: torch.zeros_like(v) for k, v in model.items()}
    with tensorwire.HostReader(host.share_url, PREFIX, token=TOKEN, into=into) as copier:
        assert copier.update(10) == number
        assert same_bytes(into, model)  # copied once into the caller's tensors
        assert all(segment_mapping(t) is None for t in copier.tensors.values())


def test_a_half_done_update_is_never_shared_and_a_viewed_generation_outlives_its_retirement() -> None:
    """In one process: an update that fails after writing half the leader's tensors shares
    nothing; a follower's views of generation 1 keep generation 1's bytes while the leader shares
    three more (it keeps two), and the leader frees generation 1 once those views are gone."""
    first, plain = model_tensors(1), "policy/"  # plain versioned tensors, 16 KiB relay chunks
    with origin() as (srv, _), tensorwire.connect(srv.url) as trainer:
        trainer.put_many({plain + k: v for k, v in first.items()})
        target = {k: torch.zeros_like(v) for k, v in first.items()}
        chunks = [10**9]  # the leader's update fails once this many chunks are in

        def progress(verified: int) -> None:
            if verified >= chunks[0]:
                raise RuntimeError("the leader dies half-way")

        with tensorwire.Subscriber(srv.url, plain, target, listen_host="127.0.0.1", deltas=False,
                                   progress=progress, share="shm://127.0.0.1:0") as leader:  # fmt: skip
            g1 = leader.update(30)
            with tensorwire.HostReader(leader.share_url, plain) as reader:
                assert reader.update(10) == g1
                held = dict(reader.tensors)
                chunks[0] = 5
                trainer.put_many({plain + k: v for k, v in model_tensors(2).items()})
                with pytest.raises(RuntimeError):
                    leader.update(30)
                assert not same_bytes(target, first)  # the leader's tensors are a mix now
                assert reader.update(10) == g1 and same_bytes(reader.tensors, first)
                chunks[0] = 10**9
                for seed in (3, 4, 5):
                    trainer.put_many({plain + k: v for k, v in model_tensors(seed).items()})
                    leader.update(30)
                assert reader.update(10) == leader.generation
                assert same_bytes(reader.tensors, model_tensors(5))
                assert same_bytes(held, first)  # retired (keep=2) but not freed: a view holds it
                store = leader.share.server.store if leader.share else None
                assert store is not None
                pinned = store.kept
                del held
                wait_for(lambda: store.kept < pinned, 10, "generation 1 to be freed once its views are")


def test_a_leader_killed_fails_its_followers_at_once_and_held_views_stay_readable(own_host: Host) -> None:
    host = own_host
    _, model = share(host, 4)
    held = tensorwire.HostReader(host.share_url, PREFIX, token=TOKEN)
    try:
        number = held.update(10)
        views = dict(held.tensors)
        assert {got["generation"] for got in answers(host, "update")} == {number}  # nothing newer to wait for
        parked = host.followers[1]
        parked.send("wait")  # parked in GEN_WAIT on the leader's server when it dies
        host.leader.proc.send_signal(signal.SIGKILL)
        host.leader.proc.wait(10)
        started = time.monotonic()
        failures = [json.loads(parked.line(10))] + [json.loads(f.ask("update", 10)) for f in host.followers]
        assert time.monotonic() - started < 10
        for failure in failures:
            assert failure["error"] in ("ConnectionLost", "ConnectError"), failure
            assert host.share_url in failure["message"], failure
        with pytest.raises((ConnectError, ConnectionLost), match=host.share_url):
            held.update(10)
        assert held.generation == number
        assert sha(views) == sha(model)  # the pages stay mapped after the leader is gone
    finally:
        held.close()


def test_a_share_that_cannot_start_leaves_no_loop_thread_behind() -> None:
    """The constructor raises, so nobody can close the Subscriber: it must stop its loop itself."""
    before = sum(t.name == "tensorwire-subscriber" for t in threading.enumerate())
    with pytest.raises(ValueError, match="shm://"):
        tensorwire.Subscriber("tcp://127.0.0.1:1", "p", {"w": torch.zeros(4)}, share="tcp://127.0.0.1:0")
    assert sum(t.name == "tensorwire-subscriber" for t in threading.enumerate()) == before
