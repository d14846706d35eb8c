"""``tensorwire bench engines``: updating the weights of vLLM engines through tensorwire (the
``tensorwire.vllm`` backend) next to what CPU vLLM users do today, measured in the same run.

One float32 Llama checkpoint of about ``--mib`` MiB (random weights: ``engine_models``), one vLLM
engine started from it (a second one only for the two-engine figure), one tensorwire server in this
process. Every round changes every weight, as a training step does. Measured:

- ``tw_update_s``: a full update through tensorwire, the trainer's ``send_weights``: publish to the
  store, then the engine reads the generation into staging, checks it and applies it with
  ``load_weights``. The first round (fresh staging) is ``tw_first_update_s``; ``tw_update_s`` is
  the median of the rounds after ``WARMUP`` (every chunk changed: read through the relay).
  ``tw_publish_s``: the publish part of those rounds; ``tw_pause_s``: the engines' update call,
  for which the engine stops serving (it read the generation as it was published: this is the
  apply), against ``load_s`` in ``tw_pause_vs_load``.
- ``rpc_update_s``: ``llm.collective_rpc(fn, args=(state_dict,))``, ``fn`` handing it to the
  model's ``load_weights`` through vLLM's in-place reload (``rpc_load``): the state dict pickled
  to the engine core, then to its worker process (the callable and the pickling need
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). Median of the rounds after ``WARMUP``.
- ``bound_s``: the model's bytes through one plain loopback socket stream between two processes
  (sendall -> recv_into) plus ``load_weights`` alone (``load_s``: the reload timed inside the
  worker during the rpc rounds, on tensors already there).
- ``delta_update_bytes_ratio``: 1% of the weights changed (leading slices of the largest tensors)
  and published again: the bytes the origin sent for that update (the server's per-request
  counters: every answer's data, manifests included) / the model's bytes.
- ``origin_egress_ratio``: a second engine; both read a new prefix (fresh staging on both): bytes
  the origin sent for that one full update / the model's bytes. ``origin_egress_warm_ratio``: the
  next full update (every weight changed again) to both, their staging warm.

Targets: ``tw_vs_rpc`` <= 0.5, ``tw_vs_bound`` <= 1.3, ``delta_update_bytes_ratio`` <= 0.05,
``origin_egress_ratio`` <= 1.1. Needs vLLM (the engines' virtualenv: ``make bench-engines``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from tensorwire.bench.children import Child, serve_requests, spawned, starting
from tensorwire.bench.engine_models import build_llama, engine_args
from tensorwire.bench.report import show, table
from tensorwire.store.generation_config import DEFAULT_KEEP
from tensorwire.types import MiB

VOCAB = 512  # engine_models' default: the embeddings stay small beside the layers
DELTA_FRACTION = 0.01
# Rounds run before the measured ones, each way: the store keeps DEFAULT_KEEP generations, so the
# first publishes land in fresh pages until a retired generation's buffers come back (3x slower
# here); a training run is past them after its third step.
WARMUP = DEFAULT_KEEP + 1
TIMEOUT = 600.0


@dataclass(frozen=True)
class Setup:
    mib: int = 256
    rounds: int = 3  # full updates each way (tensorwire's first one is reported on its own)
    engines: int = 2  # 1: leave out the two-engine figure
    timeout: float = TIMEOUT

    @property
    def shape(self) -> tuple[int, int]:
        """(hidden, layers) of a Llama of about ``mib`` MiB in float32: a layer holds 9 hidden^2
        weights (q, o: h^2; k, v: h^2/2; gate, up, down: 2 h^2), the embeddings 2 x vocab x hidden."""
        hidden = 256 if self.mib <= 32 else 1024 if self.mib < 512 else 1536
        layer, embeddings = 9 * hidden * hidden * 4, 2 * VOCAB * hidden * 4
        return hidden, max(1, round((self.mib * MiB - embeddings) / layer))


# -- what runs in the engine's worker (collective_rpc pickles these by reference) --------------------
class Pickled:
    """A state dict as a collective_rpc argument. vLLM decodes a utility call's arguments without
    their types, so a tensor passed as is arrives as a ``[dtype, shape, buffer index]`` list (its
    out-of-band buffer lost): an object msgpack does not know is pickled instead, tensors and all
    (with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the callable needs anyway)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state


def rpc_load(worker: Any, sent: Pickled) -> float:
    """What CPU vLLM users do today: the state dict, sent whole, into the model's ``load_weights``
    through vLLM's in-place reload (``Worker.reload_weights``: the layerwise reload around it that
    tensorwire's apply runs too; a bare ``model.load_weights`` fails on a CPU engine, whose loaded
    parameters lost their ``weight_loader``). Returns the seconds it took, the tensors already in
    the worker."""
    started = time.perf_counter()
    worker.reload_weights(weights_iterator=sent.state.items())
    return time.perf_counter() - started


# -- the pieces --------------------------------------------------------------------------------------
def start_engine(folder: Path) -> Any:
    from vllm import LLM

    return LLM(**engine_args(folder))


def stop_engine(llm: Any) -> None:
    """The engine core process ends here, not at the interpreter's exit."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def engines_of(folder: Path, count: int) -> Iterator[list[Any]]:
    llms: list[Any] = []
    try:
        for _ in range(count):
            llms.append(start_engine(folder))
        yield llms
    finally:
        while llms:
            stop_engine(llms.pop())


def origin(conn: Connection, capacity: int) -> None:
    """The origin, a child process as ``tensorwire serve`` would be (in the trainer's process it
    would share the GIL with the trainer's publish): a store of ``capacity`` bytes with the relay.
    Ready with its url; each request answers the data bytes it has sent so far."""
    from tensorwire import ServerThread, TensorStore
    from tensorwire.broadcast.coordinator import RelayCoordinator

    with starting(conn):
        server = ServerThread(["tcp://127.0.0.1:0"], store=TensorStore(capacity))
        RelayCoordinator.of(server.server)  # the relay, as `tensorwire serve` has it
        conn.send(("ready", server.url))
    try:
        serve_requests(conn, lambda _: sent_bytes(server))
    finally:
        server.close()


def sent_bytes(server: Any) -> int:
    """Data bytes a server answered with so far, every operation and transport (manifests too)."""
    return sum(row.sent for row in list(server.server.counts.rows.values()))


def origin_sent(server: Child) -> int:
    server.tell("sent")
    sent = server.answer(60.0)
    assert isinstance(sent, int)
    return sent


def trainer_for(url: str, prefix: str, llms: list[Any], model: torch.nn.Module, timeout: float) -> Any:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import tensorwire.vllm
    from tensorwire.vllm.trainer import TensorwireTrainerInitInfo

    info = TensorwireTrainerInitInfo(rank=0, url=url, prefix=prefix, timeout=timeout)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=tensorwire.vllm.Engines(llms), source=ModuleSource(model)
    )


def timing(owner: Any, method: str) -> list[float]:
    """Times each call of ``owner.method`` into the list: ``trainer.publisher.publish`` (the
    trainer's side of ``send_weights``), ``trainer.apply`` (the engines' update calls, for which
    they stop serving: with prefetch, the generation is read already and this is the apply)."""
    times: list[float] = []
    call = getattr(owner, method)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - started)

    setattr(owner, method, wrapped)
    return times


@torch.no_grad()
def change_all(model: torch.nn.Module) -> None:
    """Every weight changes, by fresh noise: no chunk's delta is smaller than the chunk (a tiny
    step, a scale of 1.001, changes few bits, and deltas would send less than the model)."""
    for p in model.parameters():
        p.add_(torch.randn_like(p), alpha=1e-2)


@torch.no_grad()
def change_some(model: torch.nn.Module, fraction: float) -> int:
    """Change leading slices of the largest tensors, ``fraction`` of the model's elements in all
    (contiguous runs: the changed chunks are about the changed bytes). Returns the bytes changed."""
    total = sum(p.numel() for p in model.parameters())
    left = int(total * fraction)
    changed = 0
    for p in sorted(model.parameters(), key=lambda p: -p.numel()):
        n = min(left, p.numel() // 8)  # spread over several tensors, as a partial update would be
        p.view(-1)[:n].add_(1e-3)
        left, changed = left - n, changed + n * p.element_size()
        if left <= 0:
            break
    return changed


def timed(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def socket_gbps(nbytes: int) -> float:
    from tensorwire.bench.ps_comm import socket_gbps as plain_socket

    return plain_socket(nbytes, iters=2)


# -- the measurements --------------------------------------------------------------------------------
def one_engine(setup: Setup, url: str, server: Child, llm: Any, model: torch.nn.Module) -> dict[str, Any]:
    """collective_rpc and tensorwire full updates (``WARMUP`` rounds each first, then
    ``setup.rounds`` measured), then a 1% delta, on one engine."""
    sent = Pickled({n: p.detach() for n, p in model.named_parameters()})
    rpc: list[float] = []
    loads: list[float] = []
    for _ in range(WARMUP + setup.rounds):
        started = time.perf_counter()
        loads.extend(llm.collective_rpc(rpc_load, args=(sent,), timeout=setup.timeout))
        rpc.append(time.perf_counter() - started)
    trainer = trainer_for(url, "bench/engines", [llm], model, setup.timeout)
    publishes, pauses = timing(trainer.publisher, "publish"), timing(trainer, "apply")
    tw: list[float] = []
    tw_sent: list[int] = []
    for _ in range(WARMUP + setup.rounds):
        change_all(model)
        before = origin_sent(server)
        tw.append(timed(trainer.send_weights))
        tw_sent.append(origin_sent(server) - before)
    changed = change_some(model, DELTA_FRACTION)
    before = origin_sent(server)
    delta_s = timed(trainer.send_weights)
    delta_bytes = origin_sent(server) - before
    trainer.shutdown()
    return {
        "tw_first_update_s": tw[0],
        "tw_update_s": statistics.median(tw[WARMUP:]),
        "tw_update_bytes": tw_sent[-1],  # the origin's, for the last full round
        "tw_rounds_s": tw,
        "tw_publish_rounds_s": publishes[: len(tw)],
        "rpc_rounds_s": rpc,
        "tw_publish_s": statistics.median(publishes[WARMUP : len(tw)]),
        "tw_pause_rounds_s": pauses[: len(tw)],
        "tw_pause_s": statistics.median(pauses[WARMUP : len(tw)]),
        "rpc_update_s": statistics.median(rpc[WARMUP:]),
        "load_s": statistics.median(loads[WARMUP:]),
        "delta_update_s": delta_s,
        "delta_changed_bytes": changed,
        "delta_update_bytes": delta_bytes,
    }


def two_engines(
    setup: Setup, url: str, server: Child, llms: list[Any], model: torch.nn.Module
) -> dict[str, Any]:
    """One full update to both engines on a new prefix (fresh staging), then one more, warm."""
    trainer = trainer_for(url, "bench/engines2", llms, model, setup.timeout)
    sent: list[int] = []
    seconds: list[float] = []
    for _ in range(2):
        change_all(model)
        before = origin_sent(server)
        seconds.append(timed(trainer.send_weights))
        sent.append(origin_sent(server) - before)
    trainer.shutdown()
    return {"two_engines_update_s": seconds[0], "origin_sent_bytes": sent[0],
            "two_engines_warm_update_s": seconds[1], "origin_sent_warm_bytes": sent[1]}  # fmt: skip


def run(setup: Setup) -> dict[str, Any]:
    import tensorwire.vllm

    # collective_rpc sends a callable (pickled); the CPU engine's KV cache kept small (2 engines)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tensorwire.vllm.register()
    hidden, layers = setup.shape
    two: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tw-bench-engines-") as tmp:
        folder = Path(tmp)
        model = build_llama(folder, 0, hidden=hidden, layers=layers, vocab=VOCAB)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        gbps = socket_gbps(nbytes)
        with spawned() as children:
            # the kept generations of 2 prefixes, and one being published
            children.append(Child(origin, 6 * nbytes + 256 * MiB))
            server = children[0]
            url = str(server.ready())
            with engines_of(folder, 1) as llms:
                one = one_engine(setup, url, server, llms[0], model)
                if setup.engines > 1:
                    llms.append(start_engine(folder))
                    two = two_engines(setup, url, server, llms, model)
    return summary(setup, nbytes, gbps, one, two)


Figures = dict[str, Any]


def summary(setup: Setup, nbytes: int, gbps: float, one: Figures, two: Figures) -> Figures:
    hidden, layers = setup.shape
    link_s = nbytes / (gbps * 1e9)
    bound = link_s + one["load_s"]
    result: dict[str, Any] = {
        "device": "cpu", "model_mib": round(nbytes / MiB, 1), "model_bytes": nbytes, "hidden": hidden,
        "layers": layers, "dtype": "float32", "engines": setup.engines, "rounds": setup.rounds,
        **one, "socket_gbps": gbps, "link_s": link_s, "bound_s": bound,
        "tw_vs_rpc": one["tw_update_s"] / one["rpc_update_s"], "tw_vs_bound": one["tw_update_s"] / bound,
        "tw_pause_vs_load": one["tw_pause_s"] / one["load_s"],
        "delta_update_bytes_ratio": one["delta_update_bytes"] / nbytes,
        "delta_changed_ratio": one["delta_changed_bytes"] / nbytes,
        "tw_update_bytes_ratio": one["tw_update_bytes"] / nbytes,
    }  # fmt: skip
    if two:
        result.update(two)
        result["origin_egress_ratio"] = two["origin_sent_bytes"] / nbytes
        result["origin_egress_warm_ratio"] = two["origin_sent_warm_bytes"] / nbytes
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--mib", type=int, default=d.mib, help="the model's size in MiB, float32 (256)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="full updates each way (3)")
    parser.add_argument("--engines", type=int, choices=(1, 2), default=d.engines,
                        help="2: also the two-engine update (origin egress)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for one update")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.rounds < 1:
        parser.error("--mib and --rounds are at least 1")
    return show(run(Setup(args.mib, args.rounds, args.engines, args.timeout)), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    head = (f"vLLM weight update, Llama {r['model_mib']:,.0f} MiB float32 ({r['layers']} layers of "
            f"hidden {r['hidden']}), CPU engines, tensorwire vs collective_rpc")  # fmt: skip
    rows = [
        ("tensorwire full update", f"{r['tw_update_s']:.3f} s",
         f"first {r['tw_first_update_s']:.3f} s; publish {r['tw_publish_s']:.3f} s"),
        ("collective_rpc(state_dict)", f"{r['rpc_update_s']:.3f} s",
         f"tw_vs_rpc {r['tw_vs_rpc']:.3f} (target <= 0.5)"),
        ("bound", f"{r['bound_s']:.3f} s", f"socket {r['link_s']:.3f} s + load_weights {r['load_s']:.3f} s: "
         f"tw_vs_bound {r['tw_vs_bound']:.3f} (target <= 1.3)"),
        ("1% delta update", f"{r['delta_update_s']:.3f} s",
         f"origin sent {r['delta_update_bytes_ratio']:.4f} x model (target <= 0.05)"),
    ]  # fmt: skip
    if "origin_egress_ratio" in r:
        rows.append(("2 engines, full update", f"{r['two_engines_update_s']:.3f} s",
                     f"origin sent {r['origin_egress_ratio']:.3f} x model (target <= 1.1); warm "
                     f"{r['origin_egress_warm_ratio']:.3f} x"))  # fmt: skip
    return table(head, rows, 9)


if __name__ == "__main__":
    main()
