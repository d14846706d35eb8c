"""Frames of at most one small chunk, whole in one buffer: a small request or answer built as one
buffer (one syscall), its size, and its chunk checked where it lies in a read buffer before a byte
of it is copied out (frame_io.py sends and receives the rest)."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from tensorwire.errors import CorruptFrame
from tensorwire.transport import chunks as cut
from tensorwire.transport.base import Buffer
from tensorwire.wire import lossless
from tensorwire.wire.checksum import checksum
from tensorwire.wire.frame import HEADER_BYTES, TRAILER_BYTES, Header, encode_frame_head

TRAILER = struct.Struct("<Q")  # a chunk's checksum, after its bytes


def goes_whole(header: Header, encoder: lossless.Encoder | None) -> bool:
    """Whether ``send_frame`` sends the frame of ``header`` as one uncompressed buffer
    (``whole_frame``)."""
    return one_buffer(header.data_len, header.chunk_size) and not compressed_frame(header, encoder)


def compressed_frame(header: Header, encoder: lossless.Encoder | None) -> bool:
    """Whether ``send_frame`` compresses the data section of ``header`` (what the connection's
    ``encoder`` says for a section that large)."""
    if encoder is None or header.data_len < lossless.MIN_FRAME_BYTES:
        return False
    return not encoder.plain(-(-header.data_len // header.chunk_size) if header.chunk_size else 0)


def frame_size(header: Header) -> int:
    """The bytes of a frame of at most one chunk (``goes_whole``): header, metadata, data, trailer."""
    return HEADER_BYTES + header.meta_len + (header.data_len + TRAILER_BYTES if header.data_len else 0)


def copy_chunk(header: Header, data: memoryview, buffers: Sequence[memoryview]) -> None:
    """A data section of one chunk (``data``: its bytes then its trailer, whole in a read buffer)
    checked, then copied into ``buffers``; CorruptFrame, and nothing copied, if it fails."""
    body = data[: header.data_len]
    if header.data_len and TRAILER.unpack_from(data, header.data_len)[0] != checksum(header.checksum, body):
        raise CorruptFrame(f"corrupt chunk in request {header.request_id}; nothing was kept")
    at = 0
    for dest in buffers:
        dest[:] = body[at : at + dest.nbytes]
        at += dest.nbytes


def one_buffer(data_len: int, chunk_size: int) -> bool:
    """Whether a frame of ``data_len`` bytes of data goes out as one buffer (``whole_frame``): no
    data, or one small uncompressed chunk (a 1 KiB get answer, say): one checksum, one syscall."""
    return not data_len or (data_len < cut.COALESCE and data_len <= chunk_size)


def whole_frame(header: Header, meta: bytes, segments: Sequence[Buffer]) -> bytes:
    """The frame of ``header`` (small enough: ``one_buffer``), ``meta`` and ``segments`` as one
    buffer."""
    head = encode_frame_head(header, meta)
    if not header.data_len:
        return head
    data = segments[0] if len(segments) == 1 else b"".join(segments)  # one copy of the bytes, not two
    return b"".join((head, data, TRAILER.pack(checksum(header.checksum, data))))
