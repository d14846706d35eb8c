"""Lossless per-chunk compression of a frame's data section (docs/protocol.md §5.5).

Bytes in, bytes out, no sockets. A sender that negotiated a codec in HELLO cuts the data section
into the usual chunks and sends each one either compressed (lz4 block or zstd frame) or raw, with a
5-byte chunk head ``u8 codec | u32 wire length`` before it; the trailer is still the checksum of
the *uncompressed* chunk, so integrity is checked end to end after decompression.

Which chunks are compressed is the sender's choice (``FrameEncoder``):

- Incompressible data (random floats) is detected early: a 64 KiB sample of a chunk is compressed
  first, and a chunk whose sample does not shrink by at least 10% goes raw; after that the next
  ``SKIP_AFTER_MISS`` chunks go raw without a probe, so random data costs one small probe per
  ~64 MiB.
- ``auto`` also weighs the codec's measured speed against the link's observed throughput
  (``LinkMeter``): it compresses only while ``compress time + compressed bytes / link`` beats
  ``raw bytes / link`` by ``AUTO_MARGIN``; a loopback link faster than the codec stays raw.
  Once it finds the codec not worth it (too slow, or the data incompressible), its frames go in
  the plain framing (flag COMPRESSED clear, as for small frames) for ``AUTO_RECHECK`` chunks, so
  ``auto`` costs nothing over ``none`` there; then it looks again.
"""

from __future__ import annotations

import enum
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import lz4.block
import zstandard

from tensorwire.errors import CorruptFrame

CHUNK_HEAD = struct.Struct("<BI")  # codec, bytes of the chunk on the wire
SAMPLE_BYTES = 64 << 10
SAMPLE_GAIN = 0.9  # a sample must shrink to 90% or less for its chunk to be compressed
SKIP_AFTER_MISS = 16  # chunks sent raw without a probe after a chunk found incompressible
MIN_FRAME_BYTES = 64 << 10  # smaller data sections are never compressed: not worth a chunk head
AUTO_MARGIN = 0.9  # auto compresses while it is at least 10% faster than raw over the link
DEFAULT_LINK_BPS = 1.25e9  # 10 GbE, until the connection has measured its own link
ZSTD_LEVEL = 1
AUTO_RECHECK = 256  # chunks (~1 GiB at 4 MiB) auto sends raw after finding the codec too slow


class Codec(enum.IntEnum):
    RAW = 0
    LZ4 = 1
    ZSTD = 2


# The modes a client may ask for (ClientOptions.compression). "auto" compresses with lz4, when it pays.
MODES = ("none", "lz4", "zstd", "auto")
AUTO = 255  # the HELLO value of "auto"
MODE_CODES = {"none": Codec.RAW, "lz4": Codec.LZ4, "zstd": Codec.ZSTD, "auto": AUTO}
SUPPORTED_MASK = (1 << Codec.LZ4) | (1 << Codec.ZSTD)  # the codecs this build decodes

# One zstd compressor and decompressor per thread: their C contexts must never be used by two
# threads at once (python-zstandard: "not thread safe"), and chunks are compressed on event-loop
# threads and on worker threads at the same time (a server's delta answers, many clients in one
# process). A shared pair crashed the process (SIGSEGV in compress) under concurrent delta reads.
_ZSTD = threading.local()


def _zstd_compressor() -> zstandard.ZstdCompressor:
    compressor: zstandard.ZstdCompressor | None = getattr(_ZSTD, "c", None)
    if compressor is None:
        compressor = _ZSTD.c = zstandard.ZstdCompressor(
            level=ZSTD_LEVEL, write_content_size=True, write_checksum=False
        )
    return compressor


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor | None = getattr(_ZSTD, "d", None)
    if decompressor is None:
        decompressor = _ZSTD.d = zstandard.ZstdDecompressor()
    return decompressor


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"compression must be one of {', '.join(MODES)}, not {mode!r}")
    return mode


def compress(codec: int, data: bytes | memoryview) -> bytes:
    if codec == Codec.LZ4:
        return bytes(lz4.block.compress(data, store_size=False))
    if codec == Codec.ZSTD:
        return bytes(_zstd_compressor().compress(data))
    raise ValueError(f"no compressor for codec {codec}")


def decompress(codec: int, payload: bytes | memoryview, size: int) -> bytes:
    """The ``size`` bytes ``payload`` decodes to; CorruptFrame if it does not decode to exactly that.

    Nothing larger than ``size`` is ever allocated, whatever the payload claims: a zstd frame
    carries its own content size, which the library would allocate as given (a 6 KiB frame can
    claim gigabytes), so that claim is checked against ``size`` first.
    """
    try:
        if codec == Codec.LZ4:
            out = lz4.block.decompress(payload, uncompressed_size=size)
        elif codec == Codec.ZSTD:
            out = _zstd_decompress(payload, size)
        else:
            raise CorruptFrame(f"unknown chunk codec {codec}")
    except (lz4.block.LZ4BlockError, zstandard.ZstdError) as exc:
        raise CorruptFrame(f"a compressed chunk does not decode: {exc}") from exc
    if len(out) != size:
        raise CorruptFrame(f"a compressed chunk decoded to {len(out)} bytes, not {size}")
    return bytes(out)


def _zstd_decompress(payload: bytes | memoryview, size: int) -> bytes:
    declared = zstandard.frame_content_size(payload)
    if declared == size:  # one frame and nothing after it: bytes past the frame would go unchecked
        return bytes(_zstd_decompressor().decompress(payload, max_output_size=size, allow_extra_data=False))
    if declared != -1:
        raise CorruptFrame(f"a compressed chunk claims {declared} bytes, not {size}")
    # The frame does not say: decode into a buffer one byte larger than ``size`` (reader.read(n)
    # would decode the whole frame first), so that a longer output shows without being held.
    out = bytearray(size + 1)
    view = memoryview(out)
    got = 0
    with _zstd_decompressor().stream_reader(payload) as reader:
        while got <= size:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
    return bytes(view[:got])


@dataclass(slots=True)
class LinkMeter:
    """The throughput a connection's sends have been seeing (bytes per second, smoothed)."""

    bps: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < (1 << 20) or seconds <= 0:
            return  # small sends measure latency, not the link
        sample = nbytes / seconds
        self.bps = sample if not self.bps else 0.7 * self.bps + 0.3 * sample

    @property
    def estimate(self) -> float:
        return self.bps or DEFAULT_LINK_BPS


@dataclass(slots=True)
class Stats:
    """What a connection's encoder did (for benchmarks and ``client.compression_stats``)."""

    chunks: int = 0
    compressed: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0


@dataclass(slots=True)
class Encoder:
    """A connection's sending policy: which codec, and how it has been doing."""

    mode: str
    link: LinkMeter = field(default_factory=LinkMeter)
    stats: Stats = field(default_factory=Stats)
    auto_skip: int = 0  # chunks auto sends raw before it weighs the codec against the link again

    @property
    def codec(self) -> int:
        return Codec.LZ4 if self.mode == "auto" else int(MODE_CODES[self.mode])

    def frame(self) -> FrameEncoder:
        return FrameEncoder(self)

    def plain(self, chunks: int) -> bool:
        """Whether a frame of ``chunks`` chunks goes out in the plain framing (no chunk heads, no
        probes): ``auto`` while it has lately found compression not worth it, so that it costs
        nothing over ``none`` on incompressible data or a link faster than the codec."""
        if self.mode != "auto" or not self.auto_skip:
            return False
        self.auto_skip = max(0, self.auto_skip - chunks)
        return True


def _prefix(pieces: Sequence[memoryview], n: int) -> bytes | memoryview:
    """The first ``n`` bytes of a chunk given as pieces (a copy only when they span pieces)."""
    if pieces[0].nbytes >= n:
        return pieces[0][:n]
    parts, got = [], 0
    for piece in pieces:
        parts.append(piece[: n - got])
        got += parts[-1].nbytes
        if got >= n:
            break
    return b"".join(parts)


class FrameEncoder:
    """The per-chunk choices for one frame's data section."""

    __slots__ = ("_auto_off", "_codec", "_enc", "_skip")

    def __init__(self, encoder: Encoder) -> None:
        self._enc = encoder
        self._codec = encoder.codec
        self._skip = 0  # chunks left to send raw without a probe
        self._auto_off = False  # auto found the codec slower than the link, for this frame

    def encode(self, pieces: Sequence[memoryview]) -> tuple[int, list[bytes | memoryview]]:
        """``(codec, what to send)`` for one chunk, given as its pieces: the pieces themselves (no
        copy) when it goes raw, else its compressed bytes (compressed if that is smaller and, for
        auto, faster). A chunk of several pieces is joined only to be compressed."""
        size = sum(p.nbytes for p in pieces)
        stats = self._enc.stats
        stats.chunks += 1
        stats.raw_bytes += size
        payload = self._try(pieces, size)
        if payload is None:
            stats.wire_bytes += size
            return Codec.RAW, list(pieces)
        stats.compressed += 1
        stats.wire_bytes += len(payload)
        return self._codec, [payload]

    def _try(self, pieces: Sequence[memoryview], size: int) -> bytes | None:
        if self._auto_off:
            return None
        if self._enc.auto_skip:
            self._enc.auto_skip -= 1
            return None
        if self._skip:
            self._skip -= 1
            return None
        probe = size > 2 * SAMPLE_BYTES  # a sample first: incompressible data costs one small probe
        if probe and len(compress(Codec.LZ4, _prefix(pieces, SAMPLE_BYTES))) > SAMPLE_GAIN * SAMPLE_BYTES:
            self._miss()
            return None
        chunk = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        start = time.perf_counter()
        payload = compress(self._codec, chunk)
        spent = time.perf_counter() - start
        if len(payload) >= size:
            self._miss()
            return None
        if self._enc.mode == "auto":
            link = self._enc.link.estimate
            if spent + len(payload) / link > AUTO_MARGIN * size / link:
                self._auto_off = True  # the link is faster than the codec: the rest goes raw,
                self._enc.auto_skip = AUTO_RECHECK  # and so do the next frames', for a while
        return payload

    def _miss(self) -> None:
        """An incompressible chunk: the next ones go raw unprobed; under ``auto`` the next frames
        too, in the plain framing, until ``AUTO_RECHECK`` chunks have gone by."""
        self._skip = SKIP_AFTER_MISS
        if self._enc.mode == "auto":
            self._enc.auto_skip = AUTO_RECHECK
