"""What a 1 KiB request costs in CPU, in ``bench transfer``, next to its floor in the same run.

``small_get_cpu_us`` is client + server CPU per 1 KiB ``get`` of the blocking client (not
spinning). Its floor, ``small_echo_cpu_us``, is the same round trip with no protocol at all: a
blocking socket sends 1 KiB to the run's asyncio echo server (the same kind of event loop as the
tensorwire server) and reads it back, counted the same way in both processes. Most of that floor
is the kernel's, not Python's: a wait that sleeps costs its wake-up, and on a VM whose idle vCPU
halts a wake-up costs the waker and the woken some 20 us each, so the echo's CPU moves with how
busy the host is (about 16 us a round trip on a loaded host, about 58 us on an idle one, measured
here). ``small_cpu_vs_echo`` (our CPU / the echo's) is the figure to compare between runs: what
tensorwire adds on top of what any program sleeping on a socket pays.
"""

from __future__ import annotations

import socket
import time

import torch

import tensorwire
from tensorwire.bench.children import cpu_seconds
from tensorwire.types import KiB

SMALL_BYTES = KiB  # the "small" tensor ("bench/small", put by bench/transfer.py) and the echo message
GETS = 10_000  # 1 KiB round trips whose CPU time is counted


def warmup_count(rounds: int) -> int:
    """Untimed round trips before ``rounds`` timed ones (the bench's small figures all warm so)."""
    return max(10, rounds // 10)


def small_get_cpu_us(client: tensorwire.Client, server_pid: int, gets: int = GETS) -> dict[str, float]:
    """CPU per 1 KiB get of the blocking ``client``, in µs: the client's process (every thread:
    its loop's too) and the server's (``server_pid``), from their CPU times over ``gets`` gets
    after a warm-up. A wait costs no CPU (the kernel's work to wake a sleeper does, and is
    counted), so the figure does not grow with how long the host takes to wake either side."""
    out = torch.zeros(SMALL_BYTES // 4)
    for _ in range(warmup_count(gets)):
        client.get("bench/small", out=out)
    client_start, server_start = time.process_time(), cpu_seconds(server_pid)
    for _ in range(gets):
        client.get("bench/small", out=out)
    client_us = (time.process_time() - client_start) / gets * 1e6
    server_us = (cpu_seconds(server_pid) - server_start) / gets * 1e6
    return {
        "small_get_cpu_us": client_us + server_us,
        "small_get_client_cpu_us": client_us,
        "small_get_server_cpu_us": server_us,
    }


def echo_cpu_us(port: int, echo_pid: int, rounds: int = GETS) -> float:
    """Client + server CPU per 1 KiB round trip of a blocking socket through the echo server
    listening on ``port`` (process ``echo_pid``), in µs: the floor of ``small_get_cpu_us``."""
    message = bytes(SMALL_BYTES)
    back = memoryview(bytearray(SMALL_BYTES))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as tensorwire's own sockets

        def round_trip() -> None:
            sock.sendall(message)
            if sock.recv_into(back, SMALL_BYTES, socket.MSG_WAITALL) != SMALL_BYTES:
                raise ConnectionError("the echo server closed the connection mid-answer")

        for _ in range(warmup_count(rounds)):
            round_trip()
        client_start, server_start = time.process_time(), cpu_seconds(echo_pid)
        for _ in range(rounds):
            round_trip()
        client = time.process_time() - client_start
        server = cpu_seconds(echo_pid) - server_start
    return (client + server) / rounds * 1e6


def measure(client: tensorwire.Client, server_pid: int, echo_port: int, echo_pid: int) -> dict[str, float]:
    """The keys of ``bench transfer``: tensorwire's CPU per 1 KiB get, its floor, and their ratio
    (the echo measured right after the gets, so that both see the same host)."""
    small = small_get_cpu_us(client, server_pid)
    echo = echo_cpu_us(echo_port, echo_pid)
    return {**small, "small_echo_cpu_us": echo, "small_cpu_vs_echo": small["small_get_cpu_us"] / echo}
