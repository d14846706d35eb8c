"""The wire format alone: headers, metadata blocks, dtype codes, checksums. No sockets."""

from __future__ import annotations

import contextlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire import errors
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum, new_hasher
from tensorwire.wire.dtypes import (
    CODE_TO_DTYPE,
    SUPPORTED_DTYPES,
    dtype_code,
    dtype_from_code,
    dtype_from_name,
)
from tensorwire.wire.frame import (
    HEADER_BYTES,
    Header,
    Opcode,
    check_meta_crc,
    chunk_count,
    decode_header,
    encode_frame_head,
    wire_data_len,
)

LIMITS = Limits()


def test_header_round_trip_and_size() -> None:
    meta = b"some metadata"
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 2**63 + 5, len(meta), 1 << 20, 3 << 31)
    raw = encode_frame_head(header, meta)
    assert HEADER_BYTES == 40 and len(raw) == 40 + len(meta)
    back = decode_header(raw[:40], LIMITS)
    assert (back.opcode, back.request_id, back.data_len, back.chunk_size) == (
        Opcode.PUT,
        2**63 + 5,
        3 << 31,
        1 << 20,
    )
    check_meta_crc(raw[:40], back, meta)
    with pytest.raises(errors.CorruptFrame):
        check_meta_crc(raw[:40], back, meta[:-1] + b"X")


@pytest.mark.parametrize(
    ("offset", "value", "error"),
    [
        (0, b"HTTP", errors.ProtocolError),
        (4, bytes([2]), errors.UnsupportedVersion),
        (7, bytes([9]), errors.ProtocolError),  # unknown checksum kind with data present
        (16, (1 << 31).to_bytes(4, "little"), errors.LimitExceeded),
        (20, (1).to_bytes(4, "little"), errors.LimitExceeded),  # chunk smaller than the minimum
        (24, (1 << 62).to_bytes(8, "little"), errors.LimitExceeded),
    ],
)
def test_bad_headers_are_refused(offset: int, value: bytes, error: type[Exception]) -> None:
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 1, 0, 1 << 20, 100)
    raw = bytearray(encode_frame_head(header, b""))
    raw[offset : offset + len(value)] = value
    with pytest.raises(error):
        decode_header(bytes(raw), LIMITS)


def test_chunk_arithmetic() -> None:
    assert chunk_count(0, 4) == 0 and wire_data_len(0, 4) == 0
    assert chunk_count(9, 4) == 3 and wire_data_len(9, 4) == 9 + 24
    assert chunk_count(3 << 31, 1 << 26) == 96  # > 2 GiB data sections are plain integers


def test_dtype_codes_are_stable() -> None:
    # The table is protocol: these codes must never change.
    fixed = {
        1: torch.bool,
        2: torch.uint8,
        6: torch.int64,
        8: torch.bfloat16,
        9: torch.float32,
        13: torch.complex128,
    }
    for code, dtype in fixed.items():
        assert CODE_TO_DTYPE[code] is dtype and dtype_code(dtype) == code
    assert torch.float8_e4m3fn in SUPPORTED_DTYPES and torch.float8_e5m2 in SUPPORTED_DTYPES
    assert dtype_from_name("bfloat16") is torch.bfloat16
    with pytest.raises(errors.InvalidTensor):
        dtype_code(torch.qint8)
    with pytest.raises(errors.InvalidTensor):
        dtype_from_code(200)
    with pytest.raises(errors.InvalidTensor):
        dtype_from_name("float128")


def test_records_round_trip() -> None:
    metas = [
        TensorMeta("a/b", torch.float32, (2, 3), 24, 7),
        TensorMeta("scalar", torch.bfloat16, (), 2, 1),
        TensorMeta("empty", torch.int64, (0, 5), 0),
        TensorMeta("große/τ", torch.complex64, (3 << 30,), 3 << 33),
    ]
    reader = wm.MetaReader(wm.encode_records(metas), LIMITS)
    assert wm.decode_records(reader) == metas
    reader.done()


def test_records_that_lie_or_overflow() -> None:
    good = wm.encode_records([TensorMeta("x", torch.float32, (4,), 16)])
    with pytest.raises(errors.ProtocolError):
        wm.decode_records(wm.MetaReader(good[:-1], LIMITS))  # truncated
    lie = good[:-16] + struct.pack("<QQ", 15, 0)
    with pytest.raises(errors.InvalidTensor):
        wm.decode_records(wm.MetaReader(lie, LIMITS))
    many = struct.pack("<I", LIMITS.max_batch + 1)
    with pytest.raises(errors.LimitExceeded):
        wm.decode_records(wm.MetaReader(many, LIMITS))
    deep = wm.encode_records([TensorMeta("d", torch.uint8, (1,) * 33, 1)])
    with pytest.raises(errors.LimitExceeded):
        wm.decode_records(wm.MetaReader(deep, LIMITS))
    long_name = wm.encode_records([TensorMeta("n" * 2000, torch.uint8, (1,), 1)])
    with pytest.raises(errors.LimitExceeded):
        wm.decode_records(wm.MetaReader(long_name, LIMITS))
    bad_utf8 = struct.pack("<IH", 1, 2) + b"\xff\xfe" + good[4 + 3 :]
    with pytest.raises(errors.InvalidName):
        wm.decode_records(wm.MetaReader(bad_utf8, LIMITS))
    trailing = wm.MetaReader(good + b"x", LIMITS)
    wm.decode_records(trailing)
    with pytest.raises(errors.ProtocolError):
        trailing.done()


def test_error_and_hello_blocks() -> None:
    code, message = wm.decode_error(wm.MetaReader(wm.encode_error(6, "no tensor named 'x'"), LIMITS))
    assert (code, message) == (6, "no tensor named 'x'")
    _, long = wm.decode_error(wm.MetaReader(wm.encode_error(1, "é" * 10_000), LIMITS))
    assert len(long.encode()) <= wm.MAX_MESSAGE_BYTES
    info = wm.ServerInfo(1, Limits(max_ndim=8), 1 << 40, 123)
    assert wm.decode_hello_response(wm.MetaReader(wm.encode_hello_response(info), LIMITS)) == info


@pytest.mark.parametrize("kind", list(ChecksumKind))
def test_incremental_checksum_equals_whole(kind: ChecksumKind) -> None:
    data = bytes(range(256)) * 100
    hasher = new_hasher(kind)
    for i in range(0, len(data), 999):
        hasher.update(memoryview(data)[i : i + 999])
    assert hasher.digest() == checksum(kind, data)
    assert checksum(kind, data) != checksum(kind, data[:-1] + b"\x00")


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_random_metadata_never_crashes_the_decoder(blob: bytes) -> None:
    """Whatever a peer sends, decoding raises a tensorwire error or succeeds: nothing else."""
    for decode in (wm.decode_records, wm.decode_names, wm.decode_list_request, wm.decode_hello_request):
        with contextlib.suppress(errors.TensorwireError):
            decode(wm.MetaReader(blob, LIMITS))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=40, max_size=40))
def test_random_headers_never_crash(raw: bytes) -> None:
    with contextlib.suppress(errors.TensorwireError):
        decode_header(raw, LIMITS)


def test_limits_must_fit_their_hello_fields() -> None:
    with pytest.raises(ValueError, match="max_ndim"):
        Limits(max_ndim=300)
    with pytest.raises(ValueError, match="max_name_bytes"):
        Limits(max_name_bytes=4096)
    with pytest.raises(ValueError, match="min_chunk_bytes"):
        Limits(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 16)


def test_a_reader_over_a_bytearray_or_a_view_reads_as_over_bytes() -> None:
    """The compiled codec reads ``bytes`` only: a reader given another buffer reads a copy."""
    metas = [TensorMeta("a/b", torch.float32, (2, 3), 24, 5), TensorMeta("c", torch.int8, (), 1, 0)]
    block = wm.encode_records(metas) + wm.encode_names(["x", "y/z"])
    for buf in (bytearray(block), memoryview(block)):
        reader = wm.MetaReader(buf, Limits())  # type: ignore[arg-type]
        assert wm.decode_records(reader) == metas and wm.decode_names(reader) == ["x", "y/z"]
        reader.done()
