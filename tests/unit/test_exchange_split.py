"""How the exchange client cuts tensors into pieces and requests (``split``, ``requests_of``,
``piece_limit``): pure functions every worker must compute alike."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.ps.exchange.pieces import MIN_PIECE_BYTES, PIECE_BYTES, Piece, piece_limit, requests_of, split

Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def layouts() -> st.SearchStrategy[Layout]:
    shape = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
    tensor = st.tuples(st.sampled_from(DTYPES), shape)
    return st.lists(tensor, max_size=8).map(lambda ts: [(f"t{i}", d, s) for i, (d, s) in enumerate(ts)])


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_cover(layout: Layout, pieces: list[Piece]) -> None:
    """Each tensor's elements are its pieces' ranges, in order, each element exactly once."""
    offset = 0
    for index, (name, dtype, shape) in enumerate(layout):
        mine = [p for p in pieces if p.tensor == index]
        n = numel(shape)
        assert mine, f"{name} has no piece"
        assert mine[0].start == 0 and mine[-1].stop == n
        for a, b in itertools.pairwise(mine):
            assert a.stop == b.start and a.start < a.stop  # contiguous, none empty unless alone
        for p in mine:
            assert p.nbytes == (p.stop - p.start) * dtype.itemsize
            assert p.offset == offset + p.start * dtype.itemsize
            assert p.name == (name if p.whole else f"{name}#{p.start}:{p.stop}")
        assert (len(mine) == 1) == mine[0].whole
        offset += n * dtype.itemsize
    assert [p.tensor for p in pieces] == sorted(p.tensor for p in pieces)  # in the tensors' order


@settings(max_examples=120, deadline=None)
@given(layouts(), st.integers(1, 5), st.integers(1, 300))
def test_split_covers_every_element_once_and_balances_the_servers(
    layout: Layout, servers: int, piece_bytes: int
) -> None:
    pieces = split(layout, servers, piece_bytes)
    assert pieces == split(layout, servers, piece_bytes)  # deterministic: every worker agrees
    check_cover(layout, pieces)
    itemsize = max((d.itemsize for _, d, _ in layout), default=1)
    for p in pieces:
        assert 0 <= p.server < servers
        assert p.nbytes <= max(piece_bytes, itemsize)  # a range holds at least one element
    load = [sum(p.nbytes for p in pieces if p.server == s) for s in range(servers)]
    biggest = max((p.nbytes for p in pieces), default=0)
    assert max(load) - min(load) <= biggest  # the least loaded server takes each piece
    assert len({p.name for p in pieces}) == len(pieces)


@settings(max_examples=120, deadline=None)
@given(layouts(), st.integers(1, 5), st.integers(1, 300))
def test_requests_carry_each_piece_once_in_order_to_its_server(
    layout: Layout, servers: int, piece_bytes: int
) -> None:
    pieces = split(layout, servers, piece_bytes)
    requests = requests_of(pieces, piece_bytes)
    numbers = sorted(n for _, batch in requests for n in batch)
    assert numbers == list(range(len(pieces)))
    for server in range(servers):
        mine = [n for s, batch in requests if s == server for n in batch]
        assert mine == sorted(mine)  # a server's pieces in plan order
    for server, batch in requests:
        assert batch and all(pieces[n].server == server for n in batch)
        held = sum(pieces[n].nbytes for n in batch)
        assert len(batch) == 1 or held <= piece_bytes


def test_whole_tensors_under_the_limit_keep_their_names_and_large_ones_are_cut() -> None:
    layout: Layout = [
        ("small", torch.float32, (4, 4)),
        ("big", torch.float32, (1000,)),
        ("b", torch.float64, (3,)),
    ]
    pieces = split(layout, 2, piece_bytes=1024)
    assert pieces[0] == Piece("small", 0, 0, 16, 0, True, 0, 64)
    big = [p for p in pieces if p.tensor == 1]
    assert len(big) == 4 and [p.name for p in big] == [
        "big#0:256",
        "big#256:512",
        "big#512:768",
        "big#768:1000",
    ]
    assert [p.server for p in big] == [1, 0, 1, 0]  # each to the least loaded server
    assert pieces[-1].name == "b" and pieces[-1].whole and pieces[-1].nbytes == 24
    # The default limit shrinks toward both ends of the step: first and last pieces are small.
    one_mib = [("w", torch.float32, (1 << 20,))]  # 4 MiB
    sizes = [p.nbytes for p in split(one_mib, 1)]
    assert sizes[0] == MIN_PIECE_BYTES and sizes[-1] <= MIN_PIECE_BYTES and max(sizes) == PIECE_BYTES
    assert sum(sizes) == 4 << 20


def test_empty_tensors_are_one_empty_piece_each() -> None:
    layout: Layout = [("e", torch.float32, (0,)), ("f", torch.float16, (3, 0)), ("w", torch.float32, (2,))]
    pieces = split(layout, 3)
    assert [(p.name, p.start, p.stop, p.nbytes, p.whole) for p in pieces] == [
        ("e", 0, 0, 0, True), ("f", 0, 0, 0, True), ("w", 0, 2, 8, True)
    ]  # fmt: skip
    assert split([], 2) == [] and requests_of([]) == []


def test_piece_limit_grows_from_the_start_and_shrinks_toward_the_end() -> None:
    total = 100 << 20
    assert piece_limit(0, total) == MIN_PIECE_BYTES
    assert piece_limit(200 << 10, total) == 200 << 10
    assert piece_limit(50 << 20, total) == PIECE_BYTES
    assert piece_limit(total - (256 << 10), total) == 128 << 10
    assert piece_limit(total - 1, total) == MIN_PIECE_BYTES
    assert piece_limit(50 << 20, total, piece_bytes=100) == 100  # never over piece_bytes


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="servers >= 1"):
        split([("w", torch.float32, (3,))], 0)
    with pytest.raises(ValueError, match="piece_bytes >= 1"):
        split([("w", torch.float32, (3,))], 1, piece_bytes=0)
    clash: Layout = [("w", torch.float32, (100,)), ("w#0:25", torch.float32, (25,))]
    with pytest.raises(ValueError, match=r"'w#0:25'"):  # a name that is also another tensor's range
        split(clash, 1, piece_bytes=100)
