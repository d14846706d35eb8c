"""Fuzzing the frame decoders and a live server with random, mutated and truncated frames.

Two bounded layers, so that ``make test`` stays fast (the open-ended, coverage-guided run is
``fuzz/fuzz_frames.py``, see fuzz/README.md):

- Decoder properties (hypothesis): random bytes and mutations of valid frames, fed to
  ``decode_header``, ``check_meta_crc`` and every metadata decoder. The wire modules promise that
  hostile bytes raise a ``TensorwireError``, never ``struct.error``, ``IndexError`` or the like.
- A live server, one per test on the running loop, fed seeded mutated frames over raw streams, one
  connection each. Afterwards it must still serve a normal client, hold no leaked reservation, no
  tensor with an invalid name, not have grown in memory, and not have logged an unexpected
  exception.

Mutations are written once against a small ``Choices`` interface, so hypothesis (which shrinks a
failure to a minimal input) and a seeded ``random.Random`` (cheap, for the live server, where one
server must take many cases) drive the same code. A failing live case is reported with its input
in hex; rerun a live run with ``TENSORWIRE_FUZZ_SEED=<seed>``, and make it longer with
``TENSORWIRE_FUZZ_CASES=<n>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import psutil
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tensorwire import errors, transport
from tensorwire._aio import run
from tensorwire.client import AsyncClient, ClientOptions
from tensorwire.errors import ErrorCode, TensorwireError
from tensorwire.server import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.memory import entry_cost
from tensorwire.testing.conformance import put_frame, read_reply
from tensorwire.transport.frame_io import FrameReader, skip_data
from tensorwire.types import Address, Limits, MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum, header_crc
from tensorwire.wire.frame import (
    HEADER_BYTES,
    MAGIC,
    Flags,
    Header,
    Opcode,
    check_meta_crc,
    decode_header,
    encode_frame_head,
)
from tensorwire.wire.names import validate_name

T = TypeVar("T")

SEED = int(os.environ.get("TENSORWIRE_FUZZ_SEED", "20250611"))
CASES = int(os.environ.get("TENSORWIRE_FUZZ_CASES", "150"))  # per transport
CONCURRENCY = 16  # truncated cases each wait out the stall timeout: overlap them
ANSWER_TIMEOUT = 2.0  # well over the stall timeout (+ the watchdog's period): silence past it is a hang
STALL_TIMEOUT = 0.5
CAPACITY = 64 * MiB
RSS_GROWTH_LIMIT = 200 * MiB

# The widest limits a Limits accepts: the decoders' own bounds checks, not the configured limits,
# must then stop a lying length or count.
PERMISSIVE = Limits.widest()
LIMITS = pytest.mark.parametrize("limits", [Limits(), PERMISSIVE], ids=["default-limits", "permissive"])

KNOWN_CODES = frozenset(int(code) for code in ErrorCode)
Decoder = Callable[[wm.MetaReader], object]
# Every decoder a receiver runs on a metadata block (the client's included: a server can lie too).
DECODERS: dict[str, Decoder] = {
    "records": wm.decode_records,
    "names": wm.decode_names,
    "list_request": wm.decode_list_request,
    "error": wm.decode_error,
    "hello_request": wm.decode_hello_request,
    "hello_response": wm.decode_hello_response,
    "u64": wm.MetaReader.u64,  # PUT / PUT_MANY answers
    "u32": wm.MetaReader.u32,  # DELETE answers
}

# -- what the fuzz cases are made of ---------------------------------------------------------------
VALID_NAMES = ("fz/a", "fz/b/c", "x", "é/ü", "a b", "fz/" + "n" * 300)
INVALID_NAMES = ("", "/abs", "a//b", "a/../b", "..", "back\\slash", "nul\x00", "tab\tx", "end/", "zw\u200bsp")
NAME_CHARS = ("a", "b", "/", ".", " ", "\\", "\x00", "\x7f", "é", "\u200b", "\u2028", "\ufeff", "😀")
DTYPES = (torch.uint8, torch.bool, torch.float32, torch.int64, torch.bfloat16, torch.complex64)
KINDS = (ChecksumKind.XXH3_64, ChecksumKind.CRC32C)
CHUNKS = (4096, 5000, 65536)  # 4096 is the smallest a default server takes

U8_VALUES = (0, 1, 2, 3, 4, 7, 8, 9, 10, 32, 33, 0x7F, 0x80, 0xFE, 0xFF)
U16_VALUES = (0, 1, 2, 1024, 1025, 0x7FFF, 0xFFFF)
U32_VALUES = (0, 1, 2, 8, 40, 4095, 4096, 4097, 1 << 16, 100_000, 100_001, 1 << 20, 8 * MiB,
              8 * MiB + 1, 64 * MiB, 64 * MiB + 1, 2**31, 2**32 - 1)  # fmt: skip
U64_VALUES = (0, 1, 8, 4096, 1 << 20, 64 * MiB, 64 * MiB + 1, 1 << 32, 64 << 30, (64 << 30) + 1,
              2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip  # the last two are negative as i64 dims
VALUES = {1: U8_VALUES, 2: U16_VALUES, 4: U32_VALUES, 8: U64_VALUES}
# (offset, width) of the header fields a mutation sets: version, opcode, flags, checksum kind,
# request id, meta_len, chunk_size, data_len.
FIELDS = ((4, 1), (5, 1), (6, 1), (7, 1), (8, 8), (16, 4), (20, 4), (24, 8))


class Choices(Protocol):
    """Where a fuzz case's decisions come from: hypothesis draws or a seeded ``random.Random``."""

    def integer(self, lo: int, hi: int) -> int: ...
    def pick(self, options: Sequence[T]) -> T: ...
    def blob(self, n: int) -> bytes: ...


class RandomChoices:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def integer(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)

    def pick(self, options: Sequence[T]) -> T:
        return options[self._rng.randrange(len(options))]

    def blob(self, n: int) -> bytes:
        return self._rng.randbytes(n)


class DrawnChoices:
    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def integer(self, lo: int, hi: int) -> int:
        return self._data.draw(st.integers(lo, hi))

    def pick(self, options: Sequence[T]) -> T:
        return self._data.draw(st.sampled_from(options))

    def blob(self, n: int) -> bytes:
        # Tensor bytes matter little to the decoders; drawing 20 KB would overrun hypothesis's
        # buffer, so a short drawn pattern is repeated instead.
        pattern = self._data.draw(st.binary(min_size=1, max_size=8))
        return (pattern * (n // len(pattern) + 1))[:n]


def name(c: Choices) -> str:
    kind = c.integer(0, 3)
    if kind == 0:
        return c.pick(VALID_NAMES)
    if kind == 1:
        return c.pick(INVALID_NAMES)
    return "".join(c.pick(NAME_CHARS) for _ in range(c.integer(0, 12)))


def tensor(c: Choices) -> tuple[TensorMeta, bytes]:
    dtype = c.pick(DTYPES)
    ndim = c.integer(0, 3)
    shape = (c.integer(0, 3000),) if ndim == 1 else tuple(c.integer(0, 9) for _ in range(ndim))
    nbytes = math.prod(shape) * dtype.itemsize
    return TensorMeta(name(c), dtype, shape, nbytes), c.blob(nbytes)


def data_section(data: bytes, chunk: int, kind: int) -> bytes:
    out = bytearray()
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        out += piece + struct.pack("<Q", checksum(kind, piece))
    return bytes(out)


def frame(
    op: int, meta: bytes, data: bytes = b"", *, rid: int, kind: int = ChecksumKind.XXH3_64, chunk: int = 4096
) -> bytes:
    header = Header(1, op, 0, kind, rid, len(meta), chunk, len(data))
    return encode_frame_head(header, meta) + data_section(data, chunk, kind)


def build_frame(c: Choices, rid: int | None = None) -> tuple[bytes, Decoder]:
    """A valid request frame of a random opcode, and the decoder its metadata block is for."""
    rid = c.integer(0, 2**64 - 1) if rid is None else rid
    what = c.pick(("put", "put_many", "names", "hello", "list", "ping"))
    if what == "put":
        meta, data = tensor(c)
        records = wm.encode_records([meta])
        raw = frame(Opcode.PUT, records, data, rid=rid, kind=c.pick(KINDS), chunk=c.pick(CHUNKS))
        return raw, DECODERS["records"]
    if what == "put_many":
        items = [tensor(c) for _ in range(c.integer(1, 4))]
        flags = c.pick((0, 0, Flags.MORE))  # a MORE part leaves a batch open on the server
        metas, data = [m for m, _ in items], b"".join(d for _, d in items)
        return bytes(put_frame(metas, data, rid, c.pick(CHUNKS), flags)), DECODERS["records"]
    if what == "names":
        op = c.pick((Opcode.GET, Opcode.GET_MANY, Opcode.STAT, Opcode.DELETE))
        names = [name(c) for _ in range(c.integer(0, 4))]
        return frame(op, wm.encode_names(names), rid=rid, chunk=c.pick(CHUNKS)), DECODERS["names"]
    if what == "hello":
        request = wm.encode_hello_request(c.pick(U8_VALUES), c.pick(U8_VALUES))
        return frame(Opcode.HELLO, request, rid=rid), DECODERS["hello_request"]
    if what == "list":
        request = wm.encode_list_request(name(c), c.pick(U32_VALUES))
        return frame(Opcode.LIST, request, rid=rid), DECODERS["list_request"]
    return frame(Opcode.PING, b"", rid=rid), lambda _: None


def fix_crc(buf: bytearray) -> None:
    """Recompute the header CRC over the header and the metadata block that follows, as a sender
    would: a mutated length or metadata byte then gets past the CRC to the checks behind it (random
    bytes almost never do, which would leave every deeper check unexercised)."""
    if len(buf) >= HEADER_BYTES:
        (meta_len,) = struct.unpack_from("<I", buf, 16)
        crc = header_crc(bytes(buf[:32]), bytes(buf[HEADER_BYTES : HEADER_BYTES + meta_len]))
        struct.pack_into("<I", buf, 32, crc)


def _pos(buf: bytearray, c: Choices) -> int:
    # Mostly the header and metadata: the data section is only summed, the decoders never parse it.
    hi = len(buf) - 1 if c.integer(0, 2) == 0 else min(len(buf) - 1, 160)
    return c.integer(0, hi)


def _flip(buf: bytearray, c: Choices) -> None:
    if buf:
        buf[_pos(buf, c)] ^= 1 << c.integer(0, 7)


def _set_byte(buf: bytearray, c: Choices) -> None:
    if buf:
        buf[_pos(buf, c)] = c.pick(U8_VALUES)


def _insert(buf: bytearray, c: Choices) -> None:
    at = c.integer(0, len(buf))
    buf[at:at] = c.blob(c.integer(1, 16))


def _delete(buf: bytearray, c: Choices) -> None:
    if buf:
        at = _pos(buf, c)
        del buf[at : at + c.integer(1, 16)]


def _truncate(buf: bytearray, c: Choices) -> None:
    del buf[c.integer(0, len(buf)) :]


def _set_field(buf: bytearray, c: Choices) -> None:
    offset, width = c.pick(FIELDS)
    if len(buf) >= offset + width:
        buf[offset : offset + width] = c.pick(VALUES[width]).to_bytes(width, "little")
        fix_crc(buf)


def _edit_meta(buf: bytearray, c: Choices) -> None:
    """Change the metadata block and keep meta_len and the CRC right: the edit reaches the
    metadata decoders and the server's request handling instead of dying at the CRC check."""
    if len(buf) < HEADER_BYTES:
        return
    (meta_len,) = struct.unpack_from("<I", buf, 16)
    end = min(HEADER_BYTES + meta_len, len(buf))
    meta = bytearray(buf[HEADER_BYTES:end])
    how = c.integer(0, 3)
    if how == 0 or not meta:
        _insert(meta, c)
    elif how == 1:
        _delete(meta, c)
    elif how == 2:
        _flip(meta, c)
    else:  # a count, string length, dtype, ndim, dim or nbytes at any offset: the lying-length cases
        width = c.pick((1, 2, 4, 8))
        at = c.integer(0, max(len(meta) - width, 0))
        meta[at : at + width] = c.pick(VALUES[width]).to_bytes(width, "little")
    buf[HEADER_BYTES:end] = meta
    struct.pack_into("<I", buf, 16, len(meta))
    fix_crc(buf)


MUTATIONS: tuple[Callable[[bytearray, Choices], None], ...] = (
    _flip, _set_byte, _insert, _delete, _truncate, _set_field, _set_field, _edit_meta, _edit_meta,
    _edit_meta, lambda buf, _: fix_crc(buf),
)  # fmt: skip


def mutate(raw: bytes, c: Choices) -> bytes:
    buf = bytearray(raw)
    for _ in range(c.integer(1, 4)):
        c.pick(MUTATIONS)(buf, c)
    return bytes(buf)


def fuzz_case(c: Choices) -> bytes:
    """The bytes one live connection sends: a valid, mutated, truncated or pipelined request, or
    a batch in two frames."""
    raw, _ = build_frame(c)
    style = c.pick(
        ("valid", "mutated", "mutated", "mutated", "mutated", "truncated", "pipelined", "batch", "oversized")
    )
    if style == "valid":
        return raw
    if style == "mutated":
        # Never nothing at all: a connection that sent nothing is idle, and idle is never cut off.
        return mutate(raw, c) or raw[:1]
    if style == "truncated":  # promises more than it sends: the stall timeout must cut it off
        return raw[: c.integer(1, len(raw) - 1)]
    if style == "pipelined":  # a good frame, then a bad one on the same connection
        return raw + mutate(build_frame(c)[0], c)
    if style == "oversized":
        # A put of up to the whole capacity (or just past it) that sends a few chunks and stops:
        # the server reserves first (or refuses, and skips the data), then the stall timeout must
        # cut the session off and free the reservation, whatever other sessions reserved meanwhile.
        n = c.pick((CAPACITY // 8, CAPACITY // 2, CAPACITY, CAPACITY + 1))
        records = wm.encode_records([TensorMeta(c.pick(VALID_NAMES), torch.uint8, (n,), n)])
        header = Header(
            1, Opcode.PUT, 0, ChecksumKind.XXH3_64, c.integer(0, 2**64 - 1), len(records), 4096, n
        )
        return encode_frame_head(header, records) + data_section(c.blob(3 * 4096), 4096, ChecksumKind.XXH3_64)
    rid = c.integer(1, 2**64 - 1)
    (m1, d1), (m2, d2) = tensor(c), tensor(c)
    first, last = bytes(put_frame([m1], d1, rid, flags=Flags.MORE)), bytes(put_frame([m2], d2, rid))
    return first + mutate(last, c) if c.integer(0, 1) else mutate(first, c) + last


# -- decoders ----------------------------------------------------------------------------------------
def decode_all(buf: bytes, limits: Limits) -> None:
    """Run ``buf`` through every receive-side decoder as a receiver would: the first 40 bytes as a
    header, what follows as each kind of metadata block. Only a TensorwireError may escape."""
    try:
        head = buf[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")  # a receiver always reads exactly 40
        blocks = [buf[HEADER_BYTES:]]
        with contextlib.suppress(TensorwireError):
            header = decode_header(head, limits)
            assert header.wire_data_len >= header.data_len  # divides by chunk_size: must be nonzero
            meta = buf[HEADER_BYTES : HEADER_BYTES + header.meta_len]
            blocks.append(meta)
            check_meta_crc(head, header, meta)
        for block in blocks:
            for decode in DECODERS.values():
                reader = wm.MetaReader(block, limits)
                with contextlib.suppress(TensorwireError):
                    decode(reader)
                    reader.done()
    except BaseException as exc:  # not a TensorwireError: a finding; say which bytes
        exc.add_note(f"input ({len(buf)} bytes): {buf.hex()}")
        raise


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_frames_the_mutations_start_from_are_valid(data: st.DataObject) -> None:
    raw, decoder = build_frame(DrawnChoices(data))
    header = decode_header(raw[:HEADER_BYTES], Limits())
    meta = raw[HEADER_BYTES : HEADER_BYTES + header.meta_len]
    check_meta_crc(raw[:HEADER_BYTES], header, meta)
    reader = wm.MetaReader(meta, Limits())
    decoder(reader)
    reader.done()
    assert len(raw) == HEADER_BYTES + header.meta_len + header.wire_data_len


@LIMITS
@settings(max_examples=300, deadline=None)
@given(blob=st.one_of(st.binary(max_size=400), st.binary(max_size=400).map(lambda b: MAGIC + b"\x01" + b)))
def test_random_bytes_raise_only_tensorwire_errors(limits: Limits, blob: bytes) -> None:
    decode_all(blob, limits)


@LIMITS
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_frames_raise_only_tensorwire_errors(limits: Limits, data: st.DataObject) -> None:
    choices = DrawnChoices(data)
    raw, _ = build_frame(choices)
    decode_all(mutate(raw, choices), limits)


_VALID_HELLO_RESPONSE = wm.encode_hello_response(wm.ServerInfo(1, Limits(), CAPACITY, 0))
# The same answer with max_name_bytes = 0 (bytes 5-6), which Limits() refuses: that ValueError
# once escaped the client's connect() instead of a ProtocolError (found by this test).
_ZERO_NAME_LIMIT = _VALID_HELLO_RESPONSE[:5] + b"\0\0" + _VALID_HELLO_RESPONSE[7:]


@settings(max_examples=100, deadline=None)
@example(blob=_ZERO_NAME_LIMIT)
@given(blob=st.binary(min_size=48, max_size=48))
def test_hello_response_decoder_raises_only_tensorwire_errors(blob: bytes) -> None:
    # Random 48-byte answers: nearly every one announces limits a Limits() refuses.
    decode_all(bytes(HEADER_BYTES) + blob, Limits())


# -- a live server -----------------------------------------------------------------------------------
_memory_names = itertools.count()


async def first_answer(reader: FrameReader, admitted: bool = False) -> str:
    """How the server reacted to what was sent: its first answer (past the PING that admitted the
    session, with ``admitted``), or that it hung up."""
    try:
        if admitted:
            await read_reply(reader)  # the PING's
        if not await reader.at_frame_start():
            return "closed"
        header, meta = await read_reply(reader)
        await skip_data(reader, header)  # a GET answer carries tensors
    except errors.ConnectionLost:
        return "closed"  # cut off mid-frame by the stall timeout, or reset after a refused header
    if not header.is_response:
        return f"answer without the RESPONSE flag: {header}"
    if not header.is_error:
        return "ok"
    code, message = wm.decode_error(meta)
    meta.done()
    if code not in KNOWN_CODES:
        return f"unknown error code {code}: {message}"
    return f"error {ErrorCode(code).name}: {message}"


async def exchange(address: Address, payload: bytes, admitted: bool = False) -> str:
    """Send one fuzz case on a fresh connection and wait for the server's reaction. ``admitted``:
    after a PING in the same write, so the case is a session's second frame (on tcp:// the first
    that the loop's readiness callback sees, ``Session._ready``)."""
    stream = await transport.connect_stream(address, 5.0)
    try:
        with contextlib.suppress(errors.ConnectionLost):  # it may hang up before taking it all
            await stream.send([frame(Opcode.PING, b"", rid=0) + payload if admitted else payload])
        return await asyncio.wait_for(first_answer(FrameReader(stream), admitted), ANSWER_TIMEOUT)
    finally:
        await stream.close()


def acceptable(outcome: str) -> bool:
    # SERVER_ERROR is the server's own word for an unexpected exception inside it.
    return outcome in ("ok", "closed") or (
        outcome.startswith("error ") and not outcome.startswith("error SERVER_ERROR")
    )


async def run_cases(
    address: Address, cases: Sequence[bytes], admitted: bool = False
) -> tuple[Counter[str], list[str]]:
    limit = asyncio.Semaphore(CONCURRENCY)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []

    async def one(index: int, payload: bytes) -> None:
        async with limit:
            try:
                outcome = await exchange(address, payload, admitted)
            except TimeoutError:
                outcome = f"no answer and no hang-up within {ANSWER_TIMEOUT}s (a hang)"
            except Exception as exc:  # whatever it is, it is a finding: report it with its input
                outcome = f"{type(exc).__name__}: {exc}"
        outcomes[outcome.split(":")[0]] += 1
        if not acceptable(outcome):
            problems.append(f"case {index}: {outcome}\n  input ({len(payload)} bytes): {payload.hex()}")

    await asyncio.gather(*(one(i, p) for i, p in enumerate(cases)))
    return outcomes, problems


async def wait_until(condition: Callable[[], bool], what: Callable[[], str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s: {what()}")
        await asyncio.sleep(0.01)


def is_valid_name(name: str) -> bool:
    try:
        validate_name(name)
    except errors.InvalidName:
        return False
    return True


def stored_bytes(store: TensorStore) -> int:
    """What the stored tensors count against the capacity: their bytes and their names' cost."""
    return sum(m.nbytes + entry_cost(m.name) for m in store.list())


async def fuzz_live_server(
    scheme: str, seed: int, count: int, token: str | None = None, admitted: bool = False
) -> Counter[str]:
    """Run ``count`` seeded fuzz cases against one fresh server, then check its health. ``admitted``:
    each case is its connection's second frame, after a PING."""
    store = TensorStore(capacity=CAPACITY)
    server = Server(
        ServerOptions(token=token, connections=ConnectionOptions(stall_timeout=STALL_TIMEOUT)), store=store
    )
    url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"memory://fuzz-{next(_memory_names)}"
    [address] = await server.start(url)
    rng_choices = RandomChoices(random.Random(seed))
    cases = [fuzz_case(rng_choices) for _ in range(count)]
    process = psutil.Process()
    rss_before = process.memory_info().rss
    try:
        outcomes, problems = await run_cases(address, cases, admitted)
        assert not problems, (
            f"{len(problems)} of {count} cases misbehaved (seed {seed}, {scheme}); first ones:\n"
            + "\n".join(problems[:5])
        )
        options = ClientOptions(timeout=10.0, connect_timeout=5.0, retries=0, token=token)
        client = AsyncClient(str(address), options)
        try:  # a normal client is still served, reads and writes
            x = torch.arange(1000, dtype=torch.float32)
            await client.put("fuzz/after", x)
            assert torch.equal(await client.get("fuzz/after"), x)
        finally:
            await client.close()
        # A session cut off mid-request frees its reservation when the server notices, not at once.
        await wait_until(
            lambda: store.used == stored_bytes(store),
            lambda: f"store.used {store.used} != {stored_bytes(store)} bytes stored: a leaked reservation",
        )
        invalid = [meta.name for meta in store.list() if not is_valid_name(meta.name)]
        assert not invalid, f"stored under names the server must refuse: {invalid!r}"
        growth = process.memory_info().rss - rss_before
        assert growth < RSS_GROWTH_LIMIT, f"RSS grew by {growth / MiB:.0f} MiB over {count} cases"
    finally:
        await server.close()
    return outcomes


@pytest.mark.parametrize("scheme", ["tcp", "memory"])
def test_live_server_survives_mutated_frames(scheme: str) -> None:
    outcomes = run(fuzz_live_server(scheme, SEED, CASES))
    # The fuzzer must reach past the header checks, not only bounce off the CRC: successes, the
    # metadata decoders' refusals and stall cut-offs all have to show up.
    if CASES >= 100:
        for wanted in ("ok", "closed", "error CORRUPT_FRAME", "error PROTOCOL_ERROR", "error INVALID_NAME"):
            assert outcomes[wanted], f"no case ended with {wanted!r}: {dict(outcomes)}"


def test_a_server_with_a_token_lets_no_mutated_frame_in() -> None:
    """Before authentication only a HELLO with the token gets anywhere: every case is refused."""
    outcomes = run(fuzz_live_server("memory", SEED + 2, CASES // 2, token="fuzz-token"))
    assert set(outcomes) <= {"closed", "error UNAUTHENTICATED", "error PROTOCOL_ERROR", "error CORRUPT_FRAME",
                             "error LIMIT_EXCEEDED", "error UNSUPPORTED_VERSION"}, dict(outcomes)  # fmt: skip
    assert outcomes["error UNAUTHENTICATED"], dict(outcomes)


def test_an_admitted_sessions_readiness_callback_meets_mutated_frames_as_its_task_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past its first frame a tcp:// session's frames reach the loop's readiness callback first
    (small GETs and PUTs are served there): mutated ones get the answers the task gives, the
    server stays healthy, and it logs no unexpected exception."""
    caplog.set_level(logging.ERROR, logger="tensorwire.server")
    try:
        outcomes = run(fuzz_live_server("tcp", SEED + 3, CASES, admitted=True))
    finally:
        logged = [r for r in caplog.records if r.name == "tensorwire.server" and r.levelno >= logging.ERROR]
        assert not logged, "\n\n".join(logging.Formatter("%(message)s").format(r) for r in logged)
    if CASES >= 100:
        for wanted in ("ok", "closed", "error CORRUPT_FRAME", "error PROTOCOL_ERROR"):
            assert outcomes[wanted], f"no case ended with {wanted!r}: {dict(outcomes)}"


def test_mutated_frames_never_make_the_server_log_an_unexpected_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="tensorwire.server")
    try:
        run(fuzz_live_server("memory", SEED + 1, CASES))
    finally:  # also when the run failed: the server's traceback says why
        # The server logs at ERROR only through log.exception, for exceptions it did not expect.
        logged = [r for r in caplog.records if r.name == "tensorwire.server" and r.levelno >= logging.ERROR]
        formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
        assert not logged, "\n\n".join(formatter.format(r) for r in logged)
