"""Cases through the public client API: round trips of every dtype and shape, in-place gets,
batches and their versions, list/stat/delete, capacity, many requests in flight."""

from __future__ import annotations

import asyncio

import torch

from tensorwire import AsyncClient, errors
from tensorwire.testing.conformance.harness import Harness, random_tensor, same_bytes
from tensorwire.wire.dtypes import SUPPORTED_DTYPES


async def every_dtype_and_shape(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        for dtype in SUPPORTED_DTYPES:
            for shape in [(), (0, 3), (7,), (2, 3, 4)]:
                x = random_tensor(dtype, shape)
                await c.put(f"t/{dtype}/{len(shape)}", x)
                y = await c.get(f"t/{dtype}/{len(shape)}")
                assert same_bytes(x, y), f"{dtype} {shape} did not round-trip"


async def non_contiguous_is_sent_contiguous(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
        assert not x.is_contiguous()
        await c.put("nc", x)
        y = await c.get("nc")
        assert y.is_contiguous() and torch.equal(x, y)


async def get_into_out_in_place(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        x = torch.randn(1000, 33)
        await c.put("w", x)
        out = torch.zeros(1000, 33)
        ptr = out.data_ptr()
        got = await c.get("w", out=out)
        assert got is out and out.data_ptr() == ptr and torch.equal(out, x)
        strided = torch.zeros(33, 1000).t()  # a non-contiguous out is filled too
        await c.get("w", out=strided)
        assert torch.equal(strided, x)


async def out_mismatch_is_refused(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        await c.put("w", torch.ones(4))
        for bad in (torch.zeros(5), torch.zeros(4, dtype=torch.float64)):
            try:
                await c.get("w", out=bad)
            except errors.InvalidTensor:
                pass
            else:
                raise AssertionError("a mismatched out was accepted")
        assert torch.equal(await c.get("w"), torch.ones(4))  # the connection still works


async def large_tensor_many_chunks(h: Harness) -> None:
    async with h.server() as srv, h.client(srv, chunk_size=1 << 20) as c:
        x = random_tensor(torch.float32, (9 * (1 << 18) + 5,))  # 9 MiB + 20 bytes: 10 chunks
        await c.put("big", x)
        assert same_bytes(await c.get("big"), x)


async def compressible_and_mixed_tensors_round_trip(h: Harness) -> None:
    """Sparse (compressible) and random (incompressible) data in one batch and alone: with chunk
    compression on, chunks go compressed or raw, and every byte comes back the same."""
    async with h.server() as srv, h.client(srv, chunk_size=1 << 20) as c:
        sparse = torch.zeros(3 * (1 << 18) + 7)
        sparse[::11] = torch.randn(sparse[::11].numel())
        noise = random_tensor(torch.float32, (1 << 18,))
        await c.put_many(
            {"sparse": sparse, "noise": noise, "int8": torch.randint(-3, 3, (999_999,)).to(torch.int8)}
        )
        got = await c.get_many(["sparse", "noise", "int8"])
        assert same_bytes(got["sparse"], sparse) and same_bytes(got["noise"], noise)
        out = torch.empty_like(sparse)
        await c.get("sparse", out=out)
        assert same_bytes(out, sparse)


async def _put_batch(c: AsyncClient, items: dict[str, torch.Tensor], prefix: str) -> int:
    """``put_many(items)`` (every name under ``prefix``, nothing else there): all of them are listed
    with the batch's one version, and read back equal. Returns the version."""
    version = await c.put_many(items)
    metas = await c.list(prefix)
    assert len(metas) == len(items) and {m.version for m in metas} == {version}
    got = await c.get_many(list(items))
    assert all(torch.equal(got[k], v) for k, v in items.items())
    return version


async def a_batch_in_many_frames_is_one_put(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        items = {f"big/{i:05d}": torch.full((3,), float(i)) for i in range(2500)}  # three frames
        await _put_batch(c, items, "big/")


async def batches_are_atomic_and_versioned(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        items = {f"b/{i}": torch.full((i + 1,), float(i)) for i in range(50)}
        version = await _put_batch(c, items, "b/")
        newer = await c.put("b/0", torch.zeros(1))
        assert newer > version and (await c.stat("b/0")).version == newer
        try:  # one bad name refuses the whole batch
            await c.put_many({"b/ok": torch.ones(1), "b/../x": torch.ones(1)})
        except errors.InvalidName:
            pass
        else:
            raise AssertionError("a batch with an invalid name was accepted")
        assert [m.name for m in await c.list("b/ok")] == []


async def list_stat_delete(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        await c.put_many({"m/a": torch.ones(2, 3), "m/b": torch.ones(1), "n/c": torch.ones(1)})
        assert [m.name for m in await c.list("m/")] == ["m/a", "m/b"]
        meta = await c.stat("m/a")
        assert (meta.dtype, meta.shape, meta.nbytes) == (torch.float32, (2, 3), 24)
        await c.delete("m/a")
        for op in (c.get("m/a"), c.stat("m/a"), c.delete("m/a"), c.delete_many(["m/b", "zz"])):
            try:
                await op
            except errors.KeyNotFound:
                pass
            else:
                raise AssertionError("an operation on a missing key succeeded")
        assert [m.name for m in await c.list()] == ["m/b", "n/c"]  # delete_many removed nothing


async def capacity_is_enforced(h: Harness) -> None:
    async with h.server(capacity=1 << 20) as srv, h.client(srv) as c:
        await c.put("fits", torch.zeros(1 << 17))  # 512 KiB
        try:
            await c.put("too-big", torch.zeros(1 << 18))  # 1 MiB more
        except errors.CapacityExceeded:
            pass
        else:
            raise AssertionError("capacity was not enforced")
        assert [m.name for m in await c.list()] == ["fits"]
        await c.delete("fits")
        await c.put("too-big", torch.zeros((1 << 18) - 1024))  # the space came back (less a name's cost)


async def many_requests_in_flight(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        tensors = {f"c/{i}": torch.randn(1000 + i) for i in range(40)}
        await asyncio.gather(*(c.put(k, v) for k, v in tensors.items()))
        got = await asyncio.gather(*(c.get(k) for k in tensors))
        assert all(torch.equal(g, v) for g, v in zip(got, tensors.values(), strict=True))
