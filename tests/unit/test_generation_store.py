"""Generations without a network: the root digest and its check (``verify=True``), the manifest's
wire form, and the store's retention and leases on an injected clock."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorwire.client.generations import verify_read
from tensorwire.errors import DigestMismatch, GenerationRetired, InvalidName, LimitExceeded, ProtocolError
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig, Generations
from tensorwire.types import ChunkSums, GenerationManifest, Limits, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.tensors import byte_view

CHUNK = 64  # a small chunk size, so that small tensors have several chunks


def manifest_of(tensors: dict[str, torch.Tensor]) -> GenerationManifest:
    sums = tuple(
        ChunkSums(TensorMeta.of(n, t).with_version(1), wg.chunk_checksums(byte_view(t), CHUNK))
        for n, t in sorted(tensors.items())
    )
    digest = wg.root_digest(sums, CHUNK, wg.CHECKSUM_KIND)
    gen = wg.Generation("p", 1, digest, tuple(sorted(tensors)), sum(t.nbytes for t in tensors.values()))
    return GenerationManifest(gen, CHUNK, int(wg.CHECKSUM_KIND), sums)


TENSORS = {"p/a": torch.arange(100, dtype=torch.float32), "p/b": torch.ones(3, 5, dtype=torch.bfloat16)}


def test_the_root_digest_is_order_free_and_sees_every_field() -> None:
    manifest = manifest_of(TENSORS)
    sums = manifest.tensors
    assert wg.root_digest(reversed(sums), CHUNK, wg.CHECKSUM_KIND) == manifest.generation.digest
    a = sums[0]
    changed = [
        dataclasses.replace(a, checksums=(a.checksums[0] ^ 1, *a.checksums[1:])),
        dataclasses.replace(a, meta=a.meta._replace(name="p/c")),
        dataclasses.replace(a, meta=a.meta._replace(shape=(10, 10))),
        dataclasses.replace(a, meta=a.meta._replace(dtype=torch.int32)),
    ]
    digests = {wg.root_digest([c, sums[1]], CHUNK, wg.CHECKSUM_KIND) for c in changed}
    assert manifest.generation.digest not in digests and len(digests) == len(changed)
    # The version (the generation number) is not hashed: the same bytes, the same digest.
    renumbered = [dataclasses.replace(s, meta=s.meta.with_version(7)) for s in sums]
    assert wg.root_digest(renumbered, CHUNK, wg.CHECKSUM_KIND) == manifest.generation.digest


def test_verify_passes_and_catches_a_changed_chunk_or_a_tampered_manifest() -> None:
    manifest = manifest_of(TENSORS)
    digest = manifest.generation.digest
    verify_read(manifest, {k: v.clone() for k, v in TENSORS.items()}, digest)
    bad = TENSORS["p/a"].clone()
    bad[40] = -1.0  # byte 160: chunk 2
    with pytest.raises(DigestMismatch, match="chunk 2 of 'p/a'"):
        verify_read(manifest, {"p/a": bad}, digest)
    # A manifest whose checksums were changed to match tampered bytes no longer matches the root.
    entry = manifest.tensors[0]
    forged = dataclasses.replace(entry, checksums=wg.chunk_checksums(byte_view(bad), CHUNK))
    tampered = dataclasses.replace(manifest, tensors=(forged, manifest.tensors[1]))
    with pytest.raises(DigestMismatch, match="root digest"):
        verify_read(tampered, {"p/a": bad}, digest)
    with pytest.raises(DigestMismatch, match="read as"):
        verify_read(manifest, {"p/a": bad.view(torch.int32)}, digest)


def test_the_manifest_round_trips_and_its_counts_are_checked() -> None:
    manifest = manifest_of(TENSORS)
    raw = wg.encode_manifest(manifest)
    assert wg.decode_manifest(wm.MetaReader(raw, Limits())) == manifest
    # One checksum too few for 'p/a' (it has 7 chunks of 64 bytes): refused, not trusted.
    short = dataclasses.replace(manifest.tensors[0], checksums=manifest.tensors[0].checksums[:-1])
    bad = wg.encode_manifest(dataclasses.replace(manifest, tensors=(short, manifest.tensors[1])))
    with pytest.raises(ProtocolError, match="one per chunk"):
        wg.decode_manifest(wm.MetaReader(bad, Limits()))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def publish(gens: Generations, prefix: str, value: float) -> int:
    store = gens.store
    metas = [TensorMeta(f"{prefix}/w", torch.float32, (4,), 16)]
    res = store.reserve(metas)
    res.buffers[0].cast("B")[:] = torch.full((4,), float(value)).numpy().tobytes()
    return gens.publish(prefix, res, [wg.chunk_checksums(res.buffers[0])]).number


def test_retention_leases_and_pins_on_a_clock() -> None:
    clock = Clock()
    store = TensorStore(capacity=1 << 20)
    gens = Generations(store, GenerationConfig(keep=2, max_lease_seconds=10), clock)
    owner = object()
    assert [publish(gens, "m", g) for g in (1, 2)] == [1, 2]
    gens.lease(owner, "m", 1, 60)  # granted 10 s
    reading = gens.pin("m", 2)
    publish(gens, "m", 3)
    publish(gens, "m", 4)
    assert gens.find("m", 1).generation.number == 1  # leased
    with pytest.raises(GenerationRetired, match="generation 2 of 'm' is retired; the oldest kept is 1"):
        gens.find("m", 2)
    held = store.kept
    gens.unpin(reading)  # the last reader of generation 2 lets go: its memory goes
    assert store.kept < held
    clock.now = 10.5
    with pytest.raises(GenerationRetired, match="the oldest kept is 3"):
        gens.find("m", 1)
    gens.close()
    assert store.kept == 0 and store.used == 0


def test_prefixes_are_bounded_and_never_nest() -> None:
    gens = Generations(TensorStore(capacity=1 << 20), GenerationConfig(max_prefixes=2))
    publish(gens, "a/b", 1)
    with pytest.raises(InvalidName, match="nests"):
        gens.admit("a")
    with pytest.raises(InvalidName, match="nests"):
        gens.admit("a/b/c")
    publish(gens, "c", 1)
    with pytest.raises(LimitExceeded, match="at most 2"):
        gens.admit("d")
    assert gens.prefix_of(["a/b/w"]) == "a/b"
    with pytest.raises(InvalidName, match="one prefix"):
        gens.prefix_of(["a/b/w", "c/w"])


def _publish_mib(gens: Generations, prefix: str, mib: int = 2) -> None:
    meta = TensorMeta(f"{prefix}/w", torch.uint8, (mib << 20,), mib << 20)
    res = gens.store.reserve([meta])
    gens.publish(prefix, res, [wg.chunk_checksums(b) for b in res.buffers])


def test_a_retired_generations_buffers_serve_the_next_one_within_the_capacity() -> None:
    store = TensorStore(capacity=64 << 20)  # pool limit 16 MiB
    gens = Generations(store, GenerationConfig(keep=2))
    for _ in range(3):  # the third publish retires the first: its buffer waits in the pool
        _publish_mib(gens, "p")
    assert store.pool.fresh == 6 << 20 and store.pool.held == 2 << 20
    _publish_mib(gens, "p")  # lands in the first one's memory
    assert store.pool.fresh == 6 << 20
    assert store.used + store.pool.held <= store.capacity


def test_the_pool_of_retired_buffers_gives_way_to_a_put_that_needs_the_room() -> None:
    store = TensorStore(capacity=12 << 20)  # pool limit 3 MiB
    gens = Generations(store, GenerationConfig(keep=1))
    _publish_mib(gens, "p")
    _publish_mib(gens, "p")  # retires the first: 2 MiB pooled, 2 MiB kept (and its name)
    assert store.pool.held == 2 << 20
    _publish_mib(gens, "q", mib=9)  # the pool lets its buffer go: store and pool within the capacity
    assert store.pool.held == 0 and store.used + store.pool.held <= store.capacity
