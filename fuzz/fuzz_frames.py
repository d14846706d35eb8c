"""Coverage-guided fuzzing of the frame decoders and a live server session (atheris / libFuzzer).

Each input is used twice:

1. As a frame for the decoders: its first 40 bytes as a header (decoded with the widest limits a
   ``Limits`` allows), the rest as a metadata block for every metadata decoder.
2. As the bytes a client sends to a real in-process server (``memory://``, one ``ServerThread`` for
   the whole run) over a raw stream. The harness completes a last frame that stops short with
   zeros, then sends a PING as a barrier: once the PING is answered or the server hangs up, the
   server has finished with the input, so what it logged belongs to this input. That keeps a run
   deterministic and fast; cut-off frames and the stall timeout are covered by
   tests/fuzz/test_fuzz_frames.py instead.

Only a ``TensorwireError`` (and the per-input timeout) is acceptable. Anything else crashes the
fuzzer, which is how atheris reports a finding (and saves the input as ``crash-<sha1>``): an
unexpected exception from a decoder, a malformed or SERVER_ERROR answer, or an exception the server
logged. The custom mutator recomputes the header CRC (and, half the time, the chunk checksums) after
libFuzzer's mutation; without it almost every mutation would stop at the CRC check and nothing
behind it would be explored.

    python fuzz/fuzz_frames.py -atheris_runs=20000 -max_total_time=60   # a temporary seed corpus
    python fuzz/fuzz_frames.py fuzz/corpus -max_total_time=600           # keep what it finds
    python fuzz/fuzz_frames.py crash-<sha1>                              # rerun one input
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import struct
import sys
import tempfile
from pathlib import Path

import atheris

# Imported before instrumentation so that only tensorwire's own bytecode is instrumented: torch and
# numpy would be slow to instrument and their coverage is noise to the fuzzer.
import numpy  # noqa: F401
import torch

from tensorwire.server.options import ServerOptions

with atheris.instrument_imports(include=["tensorwire"]):
    from tensorwire import ServerThread, errors, transport
    from tensorwire._aio import new_event_loop, within
    from tensorwire.errors import ErrorCode, TensorwireError
    from tensorwire.store import TensorStore
    from tensorwire.testing.conformance import put_frame
    from tensorwire.transport.base import ByteStream
    from tensorwire.transport.frame_io import FrameReader, read_head, skip_data
    from tensorwire.types import KiB, Limits, MiB, TensorMeta
    from tensorwire.wire import meta as wm
    from tensorwire.wire.checksum import ChecksumKind, checksum, header_crc
    from tensorwire.wire.frame import (
        CHECKSUM_KINDS,
        HEADER_BYTES,
        TRAILER_BYTES,
        Flags,
        Header,
        Opcode,
        check_meta_crc,
        decode_header,
        encode_frame_head,
        wire_data_len,
    )

# The widest limits a Limits accepts: the decoders' own bounds checks must stop a lying length.
PERMISSIVE = Limits.widest()
# The server's limits keep every input cheap: a completed frame is at most ~100 KiB, an answer at
# most max_batch x the largest tensor. Small chunks let a short input hold several of them.
SERVER_LIMITS = Limits(
    max_meta_bytes=16 * KiB, max_batch=64, max_request_bytes=64 * KiB, min_chunk_bytes=16, max_chunk_bytes=MiB
)
STORE = TensorStore(capacity=4 * MiB)
TIMEOUT = 2.0  # per input; the barrier answers in milliseconds, so this only bounds a real hang
BARRIER_ID = 0xFEED_FACE_CAFE_BEEF
KNOWN_CODES = frozenset(int(code) for code in ErrorCode)
DECODERS = (
    wm.decode_records,
    wm.decode_names,
    wm.decode_list_request,
    wm.decode_error,
    wm.decode_hello_request,
    wm.decode_hello_response,
    wm.MetaReader.u64,
    wm.MetaReader.u32,
)


class _ServerLog(logging.Handler):
    """Keeps what the server logs at ERROR: it does so only for exceptions it did not expect."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))  # under the handler's lock (Handler.handle)

    def take(self) -> list[str]:
        """What was logged since the last call (the server logs from its own thread)."""
        with self.lock:  # type: ignore[union-attr]  # created by Handler.__init__
            records, self.records = self.records, []
        return records


SERVER_LOG = _ServerLog()
_server_logger = logging.getLogger("tensorwire.server")
_server_logger.addHandler(SERVER_LOG)
_server_logger.setLevel(logging.ERROR)
_server_logger.propagate = False  # stall and session warnings would flood libFuzzer's output

SERVER = ServerThread(["memory://fuzz"], ServerOptions(limits=SERVER_LIMITS), store=STORE)
ADDRESS = SERVER.addresses[0]
LOOP = new_event_loop()  # the client side's own loop, in the fuzzing thread


# -- the decoders --------------------------------------------------------------------------------
def decode_all(data: bytes) -> None:
    head = data[:HEADER_BYTES].ljust(HEADER_BYTES, b"\0")  # a receiver always reads exactly 40
    try:
        header = decode_header(head, PERMISSIVE)
        if header.wire_data_len < header.data_len:  # divides by chunk_size: never by zero here
            raise AssertionError(f"wire_data_len of an accepted header: {header}")
        check_meta_crc(head, header, data[HEADER_BYTES : HEADER_BYTES + header.meta_len])
    except TensorwireError:
        pass
    for decode in DECODERS:
        reader = wm.MetaReader(data[HEADER_BYTES:], PERMISSIVE)
        try:
            decode(reader)
            reader.done()
        except TensorwireError:
            pass


# -- the server session --------------------------------------------------------------------------
def complete(data: bytes) -> bytes:
    """``data`` with its last frame padded with zeros to the length its header announces, walking
    the frames the way the server cuts them. A header the server refuses ends the walk: the server
    hangs up there."""
    pos = 0
    while pos < len(data):
        head = data[pos : pos + HEADER_BYTES].ljust(HEADER_BYTES, b"\0")
        try:
            header = decode_header(head, SERVER_LIMITS)
        except TensorwireError:
            return data.ljust(pos + HEADER_BYTES, b"\0")
        pos += HEADER_BYTES + header.meta_len + wire_data_len(header.data_len, header.chunk_size)
    return data.ljust(pos, b"\0")


def barrier() -> bytes:
    return encode_frame_head(Header(1, Opcode.PING, 0, ChecksumKind.XXH3_64, BARRIER_ID, 0, 0, 0), b"")


async def send_all(stream: ByteStream, payload: bytes) -> None:
    # The server may refuse a header and hang up before taking everything: expected.
    with contextlib.suppress(errors.ConnectionLost):
        await stream.send([payload])


async def read_answers(reader: FrameReader) -> None:
    """Check every answer until the barrier's, or until the server hangs up."""
    while True:
        try:
            if not await reader.at_frame_start():
                return
            head = await read_head(reader)
        except errors.ConnectionLost:
            return
        # From here on the server's own frame must be intact: anything wrong is a finding.
        header = decode_header(head, PERMISSIVE)
        meta = await reader.read(header.meta_len)
        check_meta_crc(head, header, meta)
        await skip_data(reader, header)
        if not header.is_response:
            raise AssertionError(f"an answer without the RESPONSE flag: {header}")
        if header.is_error:
            block = wm.MetaReader(meta, PERMISSIVE)
            code, message = wm.decode_error(block)
            block.done()
            if code not in KNOWN_CODES or code == ErrorCode.SERVER_ERROR:
                logged = "\n".join(SERVER_LOG.take())  # the server logs why before it answers
                raise AssertionError(f"error code {code} answered: {message}\n{logged}")
        elif header.request_id == BARRIER_ID and header.opcode == Opcode.PING:
            return


async def session(data: bytes) -> None:
    stream = await transport.connect_stream(ADDRESS, 1.0)
    try:
        reader = FrameReader(stream)
        # Send and read at once: an answer the harness did not read could otherwise stall the server.
        await asyncio.gather(send_all(stream, complete(data) + barrier()), read_answers(reader))
    finally:
        await stream.close()


timeouts = 0


def TestOneInput(data: bytes) -> None:  # the name atheris documents
    global timeouts
    decode_all(data)
    if len(STORE) > 32:  # keep puts succeeding: a full store would only answer CAPACITY_EXCEEDED
        STORE.delete([meta.name for meta in STORE.list()])
    try:
        LOOP.run_until_complete(within(session(data), TIMEOUT))
    except TimeoutError:
        timeouts += 1  # acceptable, but worth a look: say so without stopping the run
        print(f"timeout #{timeouts} after {TIMEOUT}s on input {data.hex()}", file=sys.stderr)
    except TensorwireError:
        pass  # e.g. the connection itself failed
    logged = SERVER_LOG.take()
    if logged:
        raise AssertionError("the server logged an unexpected exception:\n" + "\n".join(logged))


# -- structure-aware mutation --------------------------------------------------------------------
def fix_crc(buf: bytearray) -> None:
    if len(buf) >= HEADER_BYTES:
        (meta_len,) = struct.unpack_from("<I", buf, 16)
        crc = header_crc(bytes(buf[:32]), bytes(buf[HEADER_BYTES : HEADER_BYTES + meta_len]))
        struct.pack_into("<I", buf, 32, crc)


def fix_trailers(buf: bytearray) -> None:
    """Recompute the first frame's chunk checksums, where its data section is all there: a mutated
    record or tensor byte then reaches the store (commit, overwrite, a GET's answer) instead of
    ending as CORRUPT_FRAME."""
    if len(buf) < HEADER_BYTES:
        return
    kind, meta_len, chunk, data_len = buf[7], *struct.unpack_from("<IIQ", buf, 16)
    start = HEADER_BYTES + meta_len
    if kind not in CHECKSUM_KINDS or not chunk or start + wire_data_len(data_len, chunk) > len(buf):
        return
    for offset in range(0, data_len, chunk):
        pos = start + offset + (offset // chunk) * TRAILER_BYTES
        size = min(chunk, data_len - offset)
        struct.pack_into("<Q", buf, pos + size, checksum(kind, bytes(buf[pos : pos + size])))


def CustomMutator(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's mutation, then most of the time the checksums made right again, as a sender
    would compute them: only then do most mutations get past the CRC to the checks behind it."""
    mutated = bytearray(atheris.Mutate(data, max_size))
    rng = random.Random(seed)
    if rng.random() < 0.5:
        fix_trailers(mutated)
    if rng.random() < 0.75:
        fix_crc(mutated)
    return bytes(mutated[:max_size])


# -- seed corpus ---------------------------------------------------------------------------------
def _frame(op: int, meta: bytes, rid: int, flags: int = 0) -> bytes:
    return encode_frame_head(Header(1, op, flags, ChecksumKind.XXH3_64, rid, len(meta), 64, 0), meta)


def seeds() -> dict[str, bytes]:
    """One valid request of every kind, so the fuzzer starts past the magic and the CRC."""
    a = TensorMeta("seed/a", torch.uint8, (40,), 40)
    b = TensorMeta("seed/b", torch.float32, (2, 3), 24)
    put_a = bytes(put_frame([a], bytes(range(40)), rid=1, chunk=16))
    return {
        "put": put_a,
        "put_many": bytes(put_frame([a, b], bytes(64), rid=2, chunk=16)),
        "batch": bytes(put_frame([a], bytes(40), rid=3, chunk=16, flags=Flags.MORE))
        + bytes(put_frame([b], bytes(24), rid=3, chunk=16)),
        "put_get": put_a + _frame(Opcode.GET_MANY, wm.encode_names(["seed/a", "seed/a"]), 4),
        "get": _frame(Opcode.GET, wm.encode_names(["seed/a"]), 5),
        "stat": _frame(Opcode.STAT, wm.encode_names(["seed/a", "x"]), 6),
        "delete": _frame(Opcode.DELETE, wm.encode_names(["seed/a"]), 7),
        "list": _frame(Opcode.LIST, wm.encode_list_request("seed/", 10), 8),
        "hello": _frame(Opcode.HELLO, wm.encode_hello_request(1, 3), 9),
        "ping": _frame(Opcode.PING, b"", 10),
        "hello_response": bytes(40) + wm.encode_hello_response(wm.ServerInfo(1, Limits(), MiB, 0)),
        "error": bytes(40) + wm.encode_error(ErrorCode.KEY_NOT_FOUND, "no tensor named 'x'"),
    }


def with_seed_corpus(argv: list[str]) -> list[str]:
    """Seed the first corpus directory given, made if missing (a temporary one if none is given):
    libFuzzer starts from the files in it and adds what it finds there. A file argument means
    "rerun these inputs", and then nothing is seeded."""
    paths = [Path(arg) for arg in argv[1:] if not arg.startswith("-")]
    if any(path.is_file() for path in paths):
        return argv
    if paths:
        corpus = paths[0]
        corpus.mkdir(parents=True, exist_ok=True)
    else:
        corpus = Path(tempfile.mkdtemp(prefix="tensorwire-fuzz-corpus-"))
        argv = [*argv, str(corpus)]
    for label, frame in seeds().items():
        seed_file = corpus / f"seed-{label}"
        if not seed_file.exists():
            seed_file.write_bytes(frame)
    return argv


def main() -> None:
    argv = with_seed_corpus(list(sys.argv))
    atheris.Setup(argv, TestOneInput, custom_mutator=CustomMutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
