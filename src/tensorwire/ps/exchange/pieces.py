"""How one step's tensors are cut into pieces and the pieces into requests, the same on every
worker of a gradient exchange.

``split`` cuts the tensors into pieces: a tensor that fits in one piece is sent under its own name;
a larger one is cut into element ranges named ``name#start:stop``. Each piece is averaged on one
server: by bytes, the least loaded server first, the same on every worker since it depends only
on the tensors' names, dtypes and shapes. ``requests_of`` puts a server's pieces in requests of at
most ``piece_bytes``, less near both ends of the step (``piece_limit``), so the first means come
back soon after the step starts and the last ones soon after the last bytes went up. Nothing here
opens a connection; ``client.py`` sends the requests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from tensorwire.types import KiB

__all__ = [
    "MIN_PIECE_BYTES",
    "PIECE_BYTES",
    "Layout",
    "Piece",
    "Plan",
    "piece_limit",
    "plan",
    "requests_of",
    "split",
]

PIECE_BYTES = 256 * KiB  # the largest piece and request (bench exchange: beat 128 KiB, 512 KiB, 1 MiB)
MIN_PIECE_BYTES = 64 * KiB  # the first and last pieces of a step (``piece_limit``)

Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]  # (name, dtype, shape) of each tensor


class Piece(NamedTuple):
    """Elements ``start:stop`` of tensor number ``tensor`` (flattened), averaged on ``server``
    under ``name``: the tensor's own for a whole tensor, ``name#start:stop`` for a range.
    ``offset``: where its bytes start among all the tensors' (in order)."""

    name: str
    tensor: int
    start: int
    stop: int
    server: int
    whole: bool
    offset: int
    nbytes: int


def piece_limit(offset: int, total: int, piece_bytes: int = PIECE_BYTES) -> int:
    """The most bytes a piece (or a request) that starts ``offset`` bytes into ``total`` may hold:
    ``piece_bytes``, less near both ends (growing from ``MIN_PIECE_BYTES`` at the start, shrinking
    toward the end), so that the first means come back soon after the step starts and the last
    ones soon after the last bytes went up."""
    return min(piece_bytes, max(MIN_PIECE_BYTES, min(offset, (total - offset) // 2)))


def split(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], servers: int,
          piece_bytes: int = PIECE_BYTES) -> list[Piece]:  # fmt: skip
    """The pieces of ``tensors`` (name, dtype, shape), in order, and the server each is averaged
    on: each tensor whole if it fits in the ``piece_limit`` where it starts (an empty tensor is one
    empty piece), else in ranges that do (at least one element each); each piece goes to the server
    with the fewest bytes so far (the lowest number on a tie), so no server ends with more than one
    piece's bytes over another. It depends only on its arguments: every worker gets the same."""
    if servers < 1 or piece_bytes < 1:
        raise ValueError(f"split needs servers >= 1 and piece_bytes >= 1, not {servers}, {piece_bytes}")
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in tensors)
    load = [0] * servers
    pieces: list[Piece] = []
    offset = 0
    for index, (name, dtype, shape) in enumerate(tensors):
        numel, size = math.prod(shape), dtype.itemsize
        bounds = _bounds(numel, size, offset, total, piece_bytes)
        whole = len(bounds) == 2
        for start, stop in itertools.pairwise(bounds):
            server = min(range(servers), key=load.__getitem__)
            nbytes = (stop - start) * size
            load[server] += nbytes
            label = name if whole else f"{name}#{start}:{stop}"
            pieces.append(Piece(label, index, start, stop, server, whole, offset + start * size, nbytes))
        offset += numel * size
    _check_unique(pieces)
    return pieces


def _bounds(numel: int, size: int, offset: int, total: int, piece_bytes: int) -> list[int]:
    """Where the pieces of a tensor of ``numel`` elements of ``size`` bytes, ``offset`` bytes into
    ``total``, start and stop: ``[0, numel]`` when it fits (``[0, 0]`` when empty)."""
    bounds = [0]
    while bounds[-1] < numel:
        limit = piece_limit(offset + bounds[-1] * size, total, piece_bytes) // size
        bounds.append(min(numel, bounds[-1] + max(1, limit)))
    return bounds if numel else [0, 0]


def _check_unique(pieces: Sequence[Piece]) -> None:
    # A tensor named like another's range ("w#0:5" next to a cut "w") would mix two pieces in one
    # round on the server: refuse it here, where the caller sees why.
    seen: set[str] = set()
    for piece in pieces:
        if piece.name in seen:
            raise ValueError(f"two pieces would be averaged under {piece.name!r}: rename that tensor")
        seen.add(piece.name)


def requests_of(pieces: Sequence[Piece], piece_bytes: int = PIECE_BYTES) -> list[tuple[int, list[int]]]:
    """(server, piece numbers) of each request: a server's pieces in order, as many in one request
    as fit in the ``piece_limit`` where its first one starts (at least one)."""
    total = sum(p.nbytes for p in pieces)
    requests: list[tuple[int, list[int]]] = []
    filling: dict[int, tuple[list[int], int, int]] = {}  # server -> its open request, limit, bytes
    for number, piece in enumerate(pieces):
        batch, limit, held = filling.get(piece.server, ([], 0, 0))
        if not batch or held + piece.nbytes > limit:
            batch, limit, held = [], piece_limit(piece.offset, total, piece_bytes), 0
            requests.append((piece.server, batch))
        batch.append(number)
        filling[piece.server] = (batch, limit, held + piece.nbytes)
    return requests


class Plan(NamedTuple):
    """The pieces of one layout of tensors and the requests that carry them (kept across steps)."""

    layout: Layout
    pieces: list[Piece]
    requests: list[tuple[int, list[int]]]  # (server, piece numbers) of each request


def plan(layout: Layout, servers: int, piece_bytes: int = PIECE_BYTES) -> Plan:
    """The pieces of ``layout`` over ``servers`` and the requests that carry them."""
    pieces = split(layout, servers, piece_bytes)
    return Plan(layout, pieces, requests_of(pieces, piece_bytes))
