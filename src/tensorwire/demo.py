"""A self-contained tour: a real TCP server on loopback, a model's state dict round-tripped bit-exactly,
and the throughput of one big tensor each way. ``tensorwire demo`` or ``python -m tensorwire.demo``."""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from rich.console import Console
from rich.table import Table

from tensorwire.client import Client, connect
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.types import GiB, MiB

ROUNDS = 3  # the first puts land in fresh server pages (no pooled buffer yet): report the best round


def main(size_mb: int = 64) -> dict[str, float | int | bool]:
    """Run the demo; return its numbers. Raises SystemExit(1) if any tensor came back changed."""
    state = model_state()
    size = size_mb * MiB
    store = TensorStore(capacity=size + GiB)  # room for the big tensor and the model, whatever size_mb
    with ServerThread(["tcp://127.0.0.1:0"], store=store) as server, connect(server.url) as client:
        url = server.url  # a closed server has no addresses left to report
        model_ok = round_trip_state(client, state)
        put_s, get_s, big_ok = time_big_tensor(client, size)
    result: dict[str, float | int | bool] = {
        "tensors": len(state),
        "bytes": sum(_nbytes(t) for t in state.values()),
        "bit_exact": model_ok and big_ok,
        "size_mb": size_mb,
        "put_gbps": size / put_s / 1e9,
        "get_gbps": size / get_s / 1e9,
    }
    _print_summary(result, server_url=url)
    if not result["bit_exact"]:
        raise SystemExit(1)
    return result


def model_state() -> dict[str, torch.Tensor]:
    """A small MLP's state dict (weights, BatchNorm buffers incl. an int64 counter) plus a bf16 and
    an int64 tensor, so the round trip covers several dtypes and a 0-dim tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.BatchNorm1d(256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    model(torch.randn(32, 64))  # one training-mode step moves the BatchNorm running stats off 0/1
    state = {f"demo/model/{k}": v.detach() for k, v in model.state_dict().items()}
    state["demo/extra/embedding_bf16"] = torch.randn(1000, 64).to(torch.bfloat16)
    state["demo/extra/token_ids"] = torch.randint(0, 50_000, (4096,), dtype=torch.int64)
    return state


def round_trip_state(client: Client, state: Mapping[str, torch.Tensor]) -> bool:
    """Put all tensors in one atomic batch, get them back in one snapshot, compare the bytes."""
    client.put_many(state)
    got = client.get_many(list(state))
    return all(same_bytes(state[name], got[name]) for name in state)


def time_big_tensor(client: Client, size: int) -> tuple[float, float, bool]:
    """Best put and get(out=...) times of a ``size``-byte float32 tensor, and whether it came back intact."""
    tensor = torch.rand(size // 4)
    out = torch.empty_like(tensor)
    put_s = get_s = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        client.put("demo/big", tensor)
        put_s = min(put_s, time.perf_counter() - start)
        start = time.perf_counter()
        client.get("demo/big", out=out)
        get_s = min(get_s, time.perf_counter() - start)
    return put_s, get_s, same_bytes(tensor, out)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality: same dtype and shape, same bytes (NaNs and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_raw(a), _raw(b))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _print_summary(result: Mapping[str, float | int | bool], server_url: str) -> None:
    ok = "[green]OK[/green]" if result["bit_exact"] else "[bold red]FAILED[/bold red]"
    table = Table(title=f"tensorwire demo ({server_url})", show_header=False)
    table.add_row("state dict tensors", str(result["tensors"]))
    table.add_row("state dict bytes", f"{result['bytes']:,}")
    table.add_row("bit-exact", ok)
    table.add_row(f"put {result['size_mb']} MiB", f"{result['put_gbps']:.2f} GB/s")
    table.add_row(f"get {result['size_mb']} MiB (out=)", f"{result['get_gbps']:.2f} GB/s")
    Console().print(table)


if __name__ == "__main__":
    main()
