"""The Ray part of ``bench peers``: Ray's object store on one node next to tensorwire.

Ray, as a new user runs it: a local ``ray.init()`` (small object store, no dashboard, its workers
at the niceness of the rest, ``start_ray``; its start is not timed), ``ray.put`` of a
``--ray-size`` numpy array from the driver, ``ray.get`` of such an object into a preallocated
buffer inside an actor (timed inside the actor), an actor call that returns 1 KiB (round trip
from the driver), and ``--many`` single ``ray.put`` s of 1 KiB. Next to
it, tensorwire over shm:// and tcp:// (a server in a child process): put, get(out=) of the same
size, a 1 KiB get round trip, and ``put_many`` of ``--many`` 1 KiB tensors (one call: what a user
would do with many small tensors; Ray has no batched put). Ratios above 1: tensorwire better.

Ray Direct Transport (RDT), in the same Ray session: one actor's method returns a tensor of each
``--rdt-sizes`` (64 MiB and 256 MiB) and another actor's method takes it, timed from the first
call to the second's answer, three ways: ``tensor_transport="tensorwire"``
(``tensorwire.ray.transport``), ``tensor_transport="gloo"`` (Ray's own, over a
``torch_gloo`` collective group of the two actors) and no transport (Ray's object store). The
``ray_rdt_*`` keys are the largest size's; ``ray_rdt_<way>_gbps_<N>mib`` each size's. Between
rounds, untimed, the sender's tensorwire store is let free the last object (Ray frees it
asynchronously), as it would be between two steps of a training loop. One sender, one receiver and
one gloo group serve every size: starting an actor (a process that imports torch) and a group
costs more than all of a size's rounds.

Every wait on Ray is bounded by ``RAY_TIMEOUT`` and its error names what it waited for.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

import tensorwire
from tensorwire.bench.fastpaths import p50_us, ratio
from tensorwire.bench.transfer import _median_seconds
from tensorwire.types import KiB, MiB

Result = dict[str, float | int | str | None]
SMALL_BYTES = KiB
TRANSPORTS = ("shm", "tcp")
_TW = ("put_gbps", "get_gbps", "get_us", "small_per_s")
_VS = ("put", "get", "call", "small")
RDT_WAYS = ("tw", "gloo", "object_store")
RDT_KEYS = (*(f"ray_rdt_{w}_gbps" for w in RDT_WAYS), "ray_rdt_tw_vs_gloo")
KEYS = (
    "ray_put_gbps", "ray_get_gbps", "ray_call_us", "ray_small_per_s",
    *(f"tw_{t}_{k}" for t in TRANSPORTS for k in _TW),
    *(f"tw_{t}_vs_ray_{k}" for t in TRANSPORTS for k in _VS),
    *RDT_KEYS,
)  # fmt: skip
RDT_FREE_TIMEOUT = 60.0  # seconds the sender's store gets to free an object between rounds
RAY_TIMEOUT = 180.0  # seconds one Ray call may take: an actor's first call waits for its start


def missing() -> str | None:
    """Why Ray cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'tensorwire[ray]' (or tensorwire[peers])"
    return None


def answer(ray: Any, ref: Any, what: str) -> Any:
    """``ray.get(ref)`` within ``RAY_TIMEOUT``; a timeout says what did not answer."""
    try:
        return ray.get(ref, timeout=RAY_TIMEOUT)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"Ray: {what} did not answer in {RAY_TIMEOUT:.0f} s") from None


def _getter_class(ray: Any) -> Any:
    @ray.remote(num_cpus=0)
    class Getter:
        """An actor with a preallocated buffer that ``ray.get`` s objects into it."""

        def __init__(self, nbytes: int) -> None:
            self.buf = np.ones(nbytes, dtype=np.uint8)  # pages faulted in now, not in the timing

        def get_into(self, refs: list[Any]) -> float:
            # A ref inside a list is not resolved by Ray before the call: the get is timed here.
            start = time.perf_counter()
            np.copyto(self.buf, ray.get(refs[0]))
            return time.perf_counter() - start

        def echo(self, payload: bytes) -> bytes:
            return payload

    return Getter


# What ray.init raises when its own fixed 30 s wait ran out: for the control store's port file
# (RuntimeError), or for the raylet to register with it (a plain Exception).
_RAY_START_TIMEOUTS = ("Timed out waiting for file", "The current node timed out during startup")


def start_ray(ray: Any, **options: Any) -> None:
    """``ray.init`` with Ray's workers at the niceness of the processes beside them, once more if
    one of Ray's own waits for its processes to start ran out. The Ray tests start it this way too.

    Ray starts its workers at niceness 15 (``worker_niceness``): beside processes busy at 0 (a
    loaded host, ``make test``'s workers) such a worker gets a sliver of a core, and an actor took
    60-75 s to answer its first call here, against 5 s at 0; its figures would measure the host's
    other load. On a loaded host a first start has also missed one of Ray's fixed 30 s waits, its
    control store never having written a log line or its raylet never registering (the second
    start is said on stderr)."""
    options["_system_config"] = {"worker_niceness": 0, **options.get("_system_config", {})}
    try:
        ray.init(**options)
    except Exception as exc:
        if not any(said in str(exc) for said in _RAY_START_TIMEOUTS):
            raise
        ray.shutdown()
        print(f"Ray did not start ({exc}); starting it again", file=sys.stderr)
        ray.init(**options)


def ray_figures(args: argparse.Namespace) -> Result:
    """Ray's four figures; Ray is started and shut down here, its start outside the timing."""
    import ray

    store = max(128 * MiB, 6 * args.ray_size, 4 * args.many * SMALL_BYTES, 3 * max(args.rdt_sizes, default=0))
    start_ray(ray, object_store_memory=store, include_dashboard=False, num_cpus=2, log_to_driver=False)
    try:
        # First: the many small puts below leave Ray freeing 10k objects for seconds after.
        rdt = _rdt_guarded(ray, args)
        array = np.random.randint(0, 255, args.ray_size, dtype=np.uint8)
        getter = _getter_class(ray).remote(args.ray_size)
        answer(ray, getter.echo.remote(b""), "the getter actor's first call")  # it has started
        put_s = _median_seconds(lambda: ray.put(array), args.iters)
        gets = []
        for _ in range(args.iters + 1):
            ref = ray.put(array)
            gets.append(answer(ray, getter.get_into.remote([ref]), "the getter's get"))
            del ref
        payload = bytes(SMALL_BYTES)
        echo = getter.echo
        call_us = p50_us(lambda: answer(ray, echo.remote(payload), "an echo"), min(args.small_iters, 500))
        small = np.ones(SMALL_BYTES, dtype=np.uint8)
        start = time.perf_counter()
        refs = [ray.put(small) for _ in range(args.many)]
        small_s = time.perf_counter() - start
        del refs
        ray.kill(getter)
        return {
            "ray_put_gbps": args.ray_size / put_s / 1e9,
            "ray_get_gbps": args.ray_size / statistics.median(gets[1:]) / 1e9,
            "ray_call_us": call_us,
            "ray_small_per_s": args.many / small_s,
            "ray_version": ray.__version__,
            **rdt,
        }
    finally:
        ray.shutdown()


def _rdt_classes(ray: Any) -> tuple[Any, Any]:
    """The sender and receiver actor classes; made after the transport is registered (Ray checks
    a method's ``tensor_transport`` when the class is defined)."""

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Sender:
        def __init__(self) -> None:
            self.t = torch.empty(0)

        def make(self, nbytes: int) -> tuple[int, float]:
            """The tensor the next rounds send (pages faulted in now, not in the timing)."""
            self.t = torch.rand(nbytes // 4)
            return self.t.numel(), float(self.t[-1])

        @ray.method(tensor_transport="tensorwire")  # type: ignore[untyped-decorator]
        def tw(self) -> torch.Tensor:
            return self.t

        @ray.method(tensor_transport="gloo")  # type: ignore[untyped-decorator]
        def gloo(self) -> torch.Tensor:
            return self.t

        def object_store(self) -> torch.Tensor:
            return self.t

        def tw_objects(self) -> int:
            from tensorwire.ray.transport import local_store_stats

            return local_store_stats()["objects"]

    @ray.remote(num_cpus=0, enable_tensor_transport=True)
    class Receiver:
        def take(self, t: torch.Tensor) -> tuple[int, float]:
            return t.numel(), float(t[-1])

    return Sender, Receiver


def _rdt_round(ray: Any, sender: Any, receiver: Any, way: str, expect: tuple[int, float]) -> float:
    start = time.perf_counter()
    ref = getattr(sender, way).remote()
    got = answer(ray, receiver.take.remote(ref), f"the receiver of a tensor over {way}")
    seconds = time.perf_counter() - start
    if tuple(got) != expect:
        raise RuntimeError(f"RDT over {way}: the receiver got {got}, not {expect}")
    del ref
    if way == "tw":  # untimed: the store frees the object before the next round reuses its room
        deadline = time.monotonic() + RDT_FREE_TIMEOUT
        while answer(ray, sender.tw_objects.remote(), "the sender's store") and time.monotonic() < deadline:
            time.sleep(0.01)
    return seconds


def rdt_figures(ray: Any, args: argparse.Namespace) -> Result:
    """Actor to actor through Ray's RDT: tensorwire, Ray's gloo, Ray's object store (module doc)."""
    from tensorwire.ray import transport

    transport.register()
    sender_cls, receiver_cls = _rdt_classes(ray)
    sender, receiver = sender_cls.remote(), receiver_cls.remote()
    gloo_group = "tensorwire-bench"
    gloo_missing: str | None = "not started"
    try:
        answer(ray, receiver.take.remote(torch.ones(1)), "the receiver actor's first call")
        gloo_missing = _gloo_group(sender, receiver, gloo_group)
        result = _rdt_sizes(ray, sender, receiver, args, skip={"gloo"} if gloo_missing else set())
    finally:
        if gloo_missing is None:
            with contextlib.suppress(Exception):  # the actors go next anyway
                from ray.experimental.collective import destroy_collective_group

                destroy_collective_group(gloo_group)
        ray.kill(sender)
        ray.kill(receiver)
    largest = max(args.rdt_sizes) // MiB
    for way in RDT_WAYS:
        result[f"ray_rdt_{way}_gbps"] = result[f"ray_rdt_{way}_gbps_{largest}mib"]
    g = result.get
    result["ray_rdt_tw_vs_gloo"] = ratio(g("ray_rdt_tw_gbps"), g("ray_rdt_gloo_gbps"))  # type: ignore[arg-type]
    sizes = ", ".join(f"{n // MiB} MiB" for n in args.rdt_sizes)
    notes = [f"actor to actor, {sizes}, median of {args.iters}"]
    if gloo_missing is not None:
        notes.append(f"Ray's gloo RDT: {gloo_missing}")
    result["ray_rdt_note"] = "; ".join(notes)
    return result


def _rdt_sizes(ray: Any, sender: Any, receiver: Any, args: argparse.Namespace, skip: set[str]) -> Result:
    """Each size's rounds each way (the first round of each: warm-up); the ways in ``skip``: None."""
    result: Result = {}
    for nbytes in args.rdt_sizes:
        expect = tuple(answer(ray, sender.make.remote(nbytes), "the sender actor"))
        for way in RDT_WAYS:
            key = f"ray_rdt_{way}_gbps_{nbytes // MiB}mib"
            if way in skip:
                result[key] = None
                continue
            times = [_rdt_round(ray, sender, receiver, way, expect) for _ in range(args.iters + 1)]
            result[key] = nbytes / statistics.median(times[1:]) / 1e9
    return result


def _rdt_guarded(ray: Any, args: argparse.Namespace) -> Result:
    """``rdt_figures``, or None for each with the error (the object store's figures stand)."""
    try:
        return rdt_figures(ray, args)
    except Exception as exc:
        return {**dict.fromkeys(RDT_KEYS), "ray_rdt_note": f"failed: {type(exc).__name__}: {exc}"}


def _gloo_group(sender: Any, receiver: Any, name: str) -> str | None:
    """Put the two actors in a gloo collective group (Ray's gloo RDT needs one); why not, or None."""
    try:
        from ray.experimental.collective import create_collective_group

        create_collective_group([sender, receiver], backend="torch_gloo", name=name)
    except Exception as exc:  # the figure is None and says why; the others still run
        return f"no collective group: {type(exc).__name__}: {exc}"
    return None


def tw_figures(url: str, args: argparse.Namespace) -> dict[str, float]:
    """tensorwire doing what Ray did, over ``url``."""
    data = torch.rand(args.ray_size // 4)
    out = torch.zeros_like(data)
    small = {f"peers/small/{i:05d}": torch.rand(SMALL_BYTES // 4) for i in range(args.many)}
    with tensorwire.connect(url) as client:
        client.put("peers/x", data)  # the server's second buffer (it alternates two on overwrites)
        put_s = _median_seconds(lambda: client.put("peers/x", data), args.iters)
        get_s = _median_seconds(lambda: client.get("peers/x", out=out), args.iters)
        if not torch.equal(out, data):
            raise RuntimeError(f"peers/x came back different over {url}")
        client.put("peers/one", torch.rand(SMALL_BYTES // 4))
        one = torch.zeros(SMALL_BYTES // 4)
        get_us = p50_us(lambda: client.get("peers/one", out=one), args.small_iters)
        start = time.perf_counter()
        client.put_many(small)
        many_s = time.perf_counter() - start
    return {
        "put_gbps": args.ray_size / put_s / 1e9,
        "get_gbps": args.ray_size / get_s / 1e9,
        "get_us": get_us,
        "small_per_s": args.many / many_s,
    }


def measure(urls: list[str], args: argparse.Namespace) -> Result:
    """Ray's figures and tensorwire's over shm:// and tcp:// (``urls``: the server's, tcp first)."""
    by_scheme = {url.split(":", 1)[0]: url for url in urls}
    result: Result = {}
    for t in TRANSPORTS:
        tw = tw_figures(by_scheme[t], args)
        result.update({f"tw_{t}_{k}": v for k, v in tw.items()})
    result.update(ray_figures(args))
    for t in TRANSPORTS:
        g = result.get
        result[f"tw_{t}_vs_ray_put"] = ratio(g(f"tw_{t}_put_gbps"), g("ray_put_gbps"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_get"] = ratio(g(f"tw_{t}_get_gbps"), g("ray_get_gbps"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_call"] = ratio(g("ray_call_us"), g(f"tw_{t}_get_us"))  # type: ignore[arg-type]
        result[f"tw_{t}_vs_ray_small"] = ratio(g(f"tw_{t}_small_per_s"), g("ray_small_per_s"))  # type: ignore[arg-type]
    result["ray_note"] = f"Ray {result.pop('ray_version')} local; tensorwire small puts: one put_many"
    return result


def rows(r: Result, f: Any) -> list[tuple[str, str, str]]:
    """The table rows of the Ray figures; ``f`` is the table's number formatter."""
    if "ray_note" not in r:
        return []
    if r["ray_put_gbps"] is None:
        return [("Ray", "n/a", str(r["ray_note"]))]
    out = [
        ("Ray put", f"{f(r['ray_put_gbps'], '.3f')} GB/s", str(r.get("ray_note", ""))),
        ("Ray get in an actor", f"{f(r['ray_get_gbps'], '.3f')} GB/s", ""),
        ("Ray 1 KiB actor call p50", f"{f(r['ray_call_us'], '.1f')} us", ""),
        ("Ray small puts", f"{f(r['ray_small_per_s'], ',.0f')} /s", "single ray.put each"),
    ]
    if r.get("ray_rdt_tw_gbps") is not None:
        out += [
            ("Ray RDT tensorwire", f"{f(r['ray_rdt_tw_gbps'], '.3f')} GB/s",
             f"{f(r['ray_rdt_tw_vs_gloo'], '.2f')} x Ray's gloo RDT; {r.get('ray_rdt_note', '')}"),
            ("Ray RDT gloo", f"{f(r['ray_rdt_gloo_gbps'], '.3f')} GB/s", ""),
            ("Ray RDT object store", f"{f(r['ray_rdt_object_store_gbps'], '.3f')} GB/s", "no transport"),
        ]  # fmt: skip
    for t in TRANSPORTS:
        out += [
            (f"{t}:// put", f"{f(r[f'tw_{t}_put_gbps'], '.3f')} GB/s",
             f"{f(r[f'tw_{t}_vs_ray_put'], '.2f')} x Ray"),
            (f"{t}:// get(out=)", f"{f(r[f'tw_{t}_get_gbps'], '.3f')} GB/s",
             f"{f(r[f'tw_{t}_vs_ray_get'], '.2f')} x Ray"),
            (f"{t}:// 1 KiB get p50", f"{f(r[f'tw_{t}_get_us'], '.1f')} us",
             f"{f(r[f'tw_{t}_vs_ray_call'], '.2f')} x faster than the actor call"),
            (f"{t}:// put_many 1 KiB", f"{f(r[f'tw_{t}_small_per_s'], ',.0f')} /s",
             f"{f(r[f'tw_{t}_vs_ray_small'], '.2f')} x Ray"),
        ]  # fmt: skip
    return out
