"""gRPC benchmark: tensorwire's gRPC transport next to the two designs it should be judged against.

All three move one float32 tensor between this process and a server in a child process, over gRPC
on loopback, in the same run (the machine is shared and noisy: compare the ratios between runs,
not the absolute numbers):

* tensorwire: ``Server(...).start("grpc://127.0.0.1:0")`` and ``tensorwire.connect(url)``,
  ``put`` and ``get(out=...)`` into a preallocated tensor.
* naive: the design most gRPC tensor services start as, and the baseline tensorwire must beat by
  a wide margin: sync grpcio, the whole tensor as ONE unary message (``bytes(tensor.numpy())`` in a
  ``TensorRequest``), kept by the server as bytes in a dict and returned the same way; the client
  turns the answer back into a tensor (``np.frombuffer(...).copy()``).
* Arrow Flight: the established fast path for bulk data over gRPC (``pyarrow.flight``): the tensor
  as a zero-copy uint8 column in 4 MiB record batches, ``do_put`` / ``do_get`` + ``read_all()``,
  copied into a preallocated tensor. Reported as null when pyarrow is not installed.

* grpcio's own ceiling (``grpc_discard.py``): the same streams of raw messages into a handler that
  drops each one and out of one that sends a preallocated message, with nothing of tensorwire in
  them. ``grpc_put_vs_discard`` and ``grpc_get_vs_discard`` say how much of what grpcio can move
  tensorwire moves; the two take turns, round by round, so that each ratio compares the same moments.

Ratios are tensorwire / baseline (``put_vs_flight``, ``get_vs_flight``, ``put_vs_naive``,
``get_vs_naive``, ``grpc_put_vs_discard``, ``grpc_get_vs_discard``); the targets (>= 1x Flight,
>= 5x naive, >= 0.9x grpcio's ceiling) are shown in the table, never asserted.
Processes, placement and shutdown work as in ``transfer.py``: both use ``children.py``.

Run: ``python -m tensorwire.bench.grpc [--size 64MiB] [--iters 5] [--json] [--no-pin]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from collections.abc import Callable, Sequence
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
import torch

import tensorwire
from tensorwire.bench.children import (
    STOP_TIMEOUT,
    Child,
    add_run_options,
    pinned,
    placement,
    serve_until_stopped,
    spawned,
)
from tensorwire.bench.grpc_discard import discard_bulk, serve_discard
from tensorwire.bench.report import show, table, throughput_head
from tensorwire.bench.transfer import (
    _gbps,
    _median_seconds,
    _positive,
    _ratio,
    _serve_tensorwire,
    _timed,
    parse_size,
)
from tensorwire.bench.transfer_table import Result
from tensorwire.types import MiB
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire.tensors import byte_view

NAME = "bench/x"
FLIGHT_BATCH_BYTES = 4 * MiB
CALL_TIMEOUT = 600.0  # a deadline on every baseline call, so a wedged server fails the run, not hangs it
MESSAGE_SLACK = MiB  # room for the fields around the tensor bytes in the naive service's one message
MAX_MESSAGE = (1 << 31) - 1  # protobuf and grpcio refuse messages of 2 GiB or more
NAIVE_SERVICE = "naive.Naive"
TARGET_VS_FLIGHT = 1.0
TARGET_VS_NAIVE = 5.0
TARGET_VS_DISCARD = 0.9
Arrow = tuple[Any, Any]  # (pyarrow, pyarrow.flight); both untyped


# -- options ---------------------------------------------------------------------------------------
def _size(text: str) -> int:
    nbytes = parse_size(text)
    if nbytes + MESSAGE_SLACK > MAX_MESSAGE:
        # The naive baseline is one protobuf message; it cannot be measured above 2 GiB.
        raise argparse.ArgumentTypeError(f"size {text!r} does not fit one gRPC message (under 2 GiB)")
    return nbytes


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensorwire.bench.grpc", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=_size, default=parse_size("64MiB"), help="tensor size")
    parser.add_argument("--iters", type=_positive, default=5, help="timed iterations (after warm-up)")
    add_run_options(parser)
    return parser.parse_args(argv)


def _arrow() -> Arrow | None:
    """(pyarrow, pyarrow.flight), or None when pyarrow (the ``bench`` extra) is not installed."""
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.flight")
    except ImportError:
        return None


def _message_options(size: int) -> list[tuple[str, int]]:
    """grpcio options that let one message carry the whole tensor (the default limit is 4 MiB)."""
    limit = min(size + MESSAGE_SLACK, MAX_MESSAGE)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


# -- servers (child processes) ---------------------------------------------------------------------
def _serve_naive(conn: Connection, size: int) -> None:
    """Child: the naive unary service, sync grpcio on a thread pool."""

    def start() -> tuple[int, Callable[[], object]]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_message_options(size))
        server.add_generic_rpc_handlers((_naive_handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return port, lambda: server.stop(grace=None).wait(STOP_TIMEOUT)

    serve_until_stopped(conn, start)


def _naive_handler() -> Any:
    """``Upload`` keeps the request's bytes in a dict; ``Download`` answers them in one message."""
    stored: dict[str, tuple[bytes, list[int], str]] = {}  # name -> (data, shape, dtype)

    def upload(request: pb.TensorRequest, context: Any) -> pb.TensorResponse:
        stored[request.tensor_name] = (request.data, list(request.shape), request.dtype)
        return pb.TensorResponse(success=True)

    def download(request: pb.TensorRequest, context: Any) -> pb.TensorResponse:
        if request.tensor_name not in stored:
            return pb.TensorResponse(success=False, message=f"no tensor {request.tensor_name!r}")
        data, shape, dtype = stored[request.tensor_name]
        return pb.TensorResponse(success=True, data=data, shape=shape, dtype=dtype)

    def unary(handler: Callable[[pb.TensorRequest, Any], pb.TensorResponse]) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            handler,
            request_deserializer=pb.TensorRequest.FromString,
            response_serializer=pb.TensorResponse.SerializeToString,
        )

    return grpc.method_handlers_generic_handler(
        NAIVE_SERVICE, {"Upload": unary(upload), "Download": unary(download)}
    )


def _serve_flight(conn: Connection) -> None:
    """Child: an Arrow Flight server that keeps each uploaded table as it arrived."""

    def start() -> tuple[int, Callable[[], object]]:
        arrow = _arrow()
        if arrow is None:
            raise RuntimeError("pyarrow is not installed")
        server = _flight_server_class(arrow[1])("grpc://127.0.0.1:0")  # serving once constructed
        return server.port, server.shutdown

    serve_until_stopped(conn, start)


def _flight_server_class(flight: Any) -> type[Any]:
    # Defined here, not at module level: pyarrow is optional, and the base class comes from it.
    class TableServer(flight.FlightServerBase):  # type: ignore[misc]  # pyarrow is untyped (Any)
        def __init__(self, location: str) -> None:
            super().__init__(location)
            self.tables: dict[bytes, Any] = {}

        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            # read_all keeps the received batches' buffers: no copy into a new layout.
            self.tables[descriptor.path[0]] = reader.read_all()

        def do_get(self, context: Any, ticket: Any) -> Any:
            return flight.RecordBatchStream(self.tables[ticket.ticket])

    return TableServer


# -- clients (this process) ------------------------------------------------------------------------
def _against_discard(
    url: str, discard_port: int, data: torch.Tensor, iters: int
) -> tuple[float, float, float, float]:
    """(put_gbps, get_gbps) through ``tensorwire.connect("grpc://...")``, as transfer.py measures
    tcp, and grpcio's ceiling's (the discarding server at ``discard_port``) on the same bytes,
    taking turns: a put and a get of each per round, ``iters`` rounds, so that each ratio compares
    the same moments (measured one after the other, both ratios moved between 0.55 and 1.29 over
    three runs). The ceiling's client warms its own channel each round, outside the timing."""
    nbytes = data.numel() * data.element_size()
    out = torch.empty_like(data)
    out.zero_()  # touched once, so the timed gets measure transfer, not page faults
    times: dict[str, list[float]] = {"put": [], "get": []}
    ceiling: dict[str, list[float]] = {"put": [], "get": []}
    with tensorwire.connect(url) as client:
        if client.transport != "grpc":
            raise RuntimeError(f"expected the grpc transport, got {client.transport!r}")
        steps: dict[str, Callable[[], object]] = {
            "put": lambda: client.put("bench/x", data),
            "get": lambda: client.get("bench/x", out=out),
        }
        for warm in ("put", "put", "get"):  # two puts: the server alternates between two buffers
            steps[warm]()
        for _ in range(iters):
            for kind, step in steps.items():
                times[kind].append(_timed(step))
            put_gbps, get_gbps = discard_bulk(discard_port, nbytes, 1)
            ceiling["put"].append(put_gbps)
            ceiling["get"].append(get_gbps)
    if not torch.equal(out, data):
        raise RuntimeError("bench/x came back different from what was put over grpc://")
    put, get = (_gbps(nbytes, statistics.median(times[k])) for k in ("put", "get"))
    return put, get, statistics.median(ceiling["put"]), statistics.median(ceiling["get"])


def _naive_bulk(port: int, data: torch.Tensor, iters: int) -> tuple[float, float]:
    """(put_gbps, get_gbps) of the naive service, client side written the naive way too."""
    nbytes = data.numel() * data.element_size()
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=_message_options(nbytes)) as channel:
        upload = channel.unary_unary(
            f"/{NAIVE_SERVICE}/Upload",
            request_serializer=pb.TensorRequest.SerializeToString,
            response_deserializer=pb.TensorResponse.FromString,
        )
        download = channel.unary_unary(
            f"/{NAIVE_SERVICE}/Download",
            request_serializer=pb.TensorRequest.SerializeToString,
            response_deserializer=pb.TensorResponse.FromString,
        )
        received = torch.empty(0)

        def put() -> None:
            request = pb.TensorRequest(
                tensor_name=NAME, data=bytes(data.numpy()), shape=data.shape, dtype="float32"
            )
            _naive_check(upload(request, timeout=CALL_TIMEOUT))

        def get() -> None:
            nonlocal received
            reply = _naive_check(download(pb.TensorRequest(tensor_name=NAME), timeout=CALL_TIMEOUT))
            array = np.frombuffer(reply.data, dtype=reply.dtype).reshape(tuple(reply.shape))
            received = torch.from_numpy(array.copy())  # a copy: frombuffer of bytes is read-only

        put_s = _median_seconds(put, iters, warmup=2)  # the same warm-ups as tensorwire's put
        get_s = _median_seconds(get, iters)
    _check_same("naive", received, data)
    return _gbps(nbytes, put_s), _gbps(nbytes, get_s)


def _naive_check(reply: pb.TensorResponse) -> pb.TensorResponse:
    if not reply.success:
        raise RuntimeError(f"naive service failed: {reply.message}")
    return reply


def _flight_bulk(arrow: Arrow, port: int, data: torch.Tensor, iters: int) -> tuple[float, float]:
    """(put_gbps, get_gbps) through Arrow Flight, zero-copy on the way out where pyarrow allows."""
    pa, flight = arrow
    nbytes = data.numel() * data.element_size()
    descriptor = flight.FlightDescriptor.for_path(NAME)
    ticket = flight.Ticket(NAME.encode())
    options = flight.FlightCallOptions(timeout=CALL_TIMEOUT)
    out = torch.empty_like(data)
    out.zero_()  # touched once, as for tensorwire's get(out=)
    target = out.view(torch.uint8).numpy()  # shares out's memory
    client = flight.connect(f"grpc://127.0.0.1:{port}")
    try:

        def put() -> None:
            batches = _record_batches(pa, data)
            writer, _ = client.do_put(descriptor, batches[0].schema, options=options)
            for batch in batches:
                writer.write_batch(batch)
            writer.close()

        def get() -> None:
            table = client.do_get(ticket, options=options).read_all()
            _copy_column(table.column(0), target)

        put_s = _median_seconds(put, iters, warmup=2)
        get_s = _median_seconds(get, iters)
    finally:
        client.close()
    _check_same("flight", out, data)
    return _gbps(nbytes, put_s), _gbps(nbytes, get_s)


def _record_batches(pa: Any, data: torch.Tensor) -> list[Any]:
    """The tensor's bytes as one uint8 column in 4 MiB batches, all views of the tensor's memory."""
    view = byte_view(data)
    column = pa.Array.from_buffers(pa.uint8(), view.nbytes, [None, pa.py_buffer(view)])
    schema = pa.schema([("bytes", pa.uint8())])
    return [
        pa.record_batch([column.slice(start, FLIGHT_BATCH_BYTES)], schema=schema)
        for start in range(0, view.nbytes, FLIGHT_BATCH_BYTES)
    ]


def _copy_column(column: Any, target: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """Copy a chunked uint8 column into ``target``: one copy, from views of the received buffers."""
    filled = 0
    for chunk in column.chunks:
        part = chunk.to_numpy(zero_copy_only=True)
        target[filled : filled + len(part)] = part
        filled += len(part)
    if filled != len(target):
        raise RuntimeError(f"flight returned {filled} bytes, expected {len(target)}")


def _check_same(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if not torch.equal(got, expected):
        raise RuntimeError(f"{what}: {NAME} came back different from what was put")


# -- the run ---------------------------------------------------------------------------------------
def run(size: int, iters: int, pin: bool = True) -> Result:
    """Measure all three; every child process is gone when this returns or raises."""
    client_cpus, server_cpus = placement(pin)
    data = torch.rand(size // 4)
    arrow = _arrow()
    # Room for the stored tensor, the one being put over it and the store's reuse pool (as transfer.py).
    capacity = 4 * size + 64 * MiB
    flight_put: float | None = None
    flight_get: float | None = None
    with contextlib.ExitStack() as stack:
        children = stack.enter_context(spawned())  # first: also ends the ones started before an error
        # Start all children before waiting for any: each spends over a second importing torch.
        children.append(Child(_serve_tensorwire, capacity, ["grpc://127.0.0.1:0"], cpus=server_cpus))
        children.append(Child(_serve_naive, size, cpus=server_cpus))
        children.append(Child(serve_discard, cpus=server_cpus))
        if arrow is not None:
            children.append(Child(_serve_flight, cpus=server_cpus))
        ready = [child.ready() for child in children]
        bound, naive_port, discard_port = ready[0], ready[1], ready[2]
        assert isinstance(bound, list) and isinstance(naive_port, int) and isinstance(discard_port, int)
        url = bound[0]
        stack.enter_context(pinned(client_cpus))

        grpc_put, grpc_get, discard_put, discard_get = _against_discard(url, discard_port, data, iters)
        naive_put, naive_get = _naive_bulk(naive_port, data, iters)
        if arrow is not None:
            assert isinstance(ready[3], int)
            flight_put, flight_get = _flight_bulk(arrow, ready[3], data, iters)
    return {
        "grpc_put_gbps": grpc_put,
        "grpc_get_gbps": grpc_get,
        "naive_put_gbps": naive_put,
        "naive_get_gbps": naive_get,
        "grpc_discard_put_gbps": discard_put,
        "grpc_discard_get_gbps": discard_get,
        "grpc_put_vs_discard": _ratio(grpc_put, discard_put),
        "grpc_get_vs_discard": _ratio(grpc_get, discard_get),
        "flight_put_gbps": flight_put,
        "flight_get_gbps": flight_get,
        "put_vs_flight": _vs(grpc_put, flight_put),
        "get_vs_flight": _vs(grpc_get, flight_get),
        "put_vs_naive": _vs(grpc_put, naive_put),
        "get_vs_naive": _vs(grpc_get, naive_get),
        "size_bytes": size,
        "iters": iters,
        "pinned": client_cpus is not None,
        "pyarrow": None if arrow is None else str(arrow[0].__version__),
    }


def _vs(value: float, baseline: float | None) -> float | None:
    return None if baseline is None else _ratio(value, baseline)


def _target(ratio: float | int | str | None, target: float, baseline: str) -> str:
    if not isinstance(ratio, float | int):
        return f"n/a (no {baseline} number)"
    verdict = "met" if ratio >= target else "MISSED"
    return f"{ratio:.2f} x {baseline} (target {target:g}x: {verdict})"


def format_table(r: Result) -> str:
    """The results as a readable table (GB/s are 1e9 bytes per second)."""
    flight_note = "baseline" if r["pyarrow"] is not None else "pyarrow not installed"

    def gbps(key: str) -> str:
        value = r[key]
        return f"{value:.3f} GB/s" if isinstance(value, float | int) else "n/a"

    rows = [
        (
            "tensorwire put",
            gbps("grpc_put_gbps"),
            f"{_target(r['put_vs_flight'], TARGET_VS_FLIGHT, 'Flight')}, "
            f"{_target(r['put_vs_naive'], TARGET_VS_NAIVE, 'naive')}, "
            f"{_target(r['grpc_put_vs_discard'], TARGET_VS_DISCARD, 'grpcio discard')}",
        ),
        (
            "tensorwire get(out=)",
            gbps("grpc_get_gbps"),
            f"{_target(r['get_vs_flight'], TARGET_VS_FLIGHT, 'Flight')}, "
            f"{_target(r['get_vs_naive'], TARGET_VS_NAIVE, 'naive')}, "
            f"{_target(r['grpc_get_vs_discard'], TARGET_VS_DISCARD, 'grpcio discard')}",
        ),
        ("grpcio discard put", gbps("grpc_discard_put_gbps"), "ceiling: raw messages, dropped"),
        ("grpcio discard get", gbps("grpc_discard_get_gbps"), "ceiling: a preallocated message, sent again"),
        ("Arrow Flight do_put", gbps("flight_put_gbps"), flight_note),
        ("Arrow Flight do_get", gbps("flight_get_gbps"), flight_note),
        ("naive unary put", gbps("naive_put_gbps"), "baseline"),
        ("naive unary get", gbps("naive_get_gbps"), "baseline"),
    ]
    return table(throughput_head("gRPC", r), rows, value_width=12)


def main(argv: list[str] | None = None) -> Result:
    args = _parse_args(argv)
    result = run(args.size, args.iters, args.pin)
    return show(result, args.json, format_table)


if __name__ == "__main__":
    main(sys.argv[1:])
