"""The batch codecs of the hot path: tensor records and names, a whole batch per call.

Every batch request and answer (put_many, get_many, publish, listings) carries one record per
tensor, so these loops run once per tensor on both sides. They are written for the interpreter
(locals, one ``struct`` call per record, no method call per field) and, unchanged, compiled by
Cython into ``codec_c`` with the C types that ``codec_c.pxd`` declares (``setup.py``); ``codec``
picks which one runs. This file is the source of both, and the one mypy checks.

Formats (``meta.py``): a string is ``u16 length | UTF-8 bytes``; a record is
``name | u8 dtype | u8 ndim | i64 x ndim shape | u64 nbytes | u64 version``. The decoders take
the block, where to start and how many items, check every length and count against the limits
given and against the bytes present, and return the items and where they ended: a truncated or
lying block raises ``ProtocolError``, ``LimitExceeded``, ``InvalidName`` (bad UTF-8) or
``InvalidTensor`` (unknown dtype, a size its shape does not give), never an ``IndexError``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from tensorwire.errors import InvalidName, InvalidTensor, LimitExceeded, ProtocolError
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import CODE_TO_DTYPE, DTYPE_TO_CODE, dtype_code

MAX_NDIM = 255  # a u8 on the wire
_TAILS = [struct.Struct(f"<{n}qQQ") for n in range(MAX_NDIM + 1)]  # shape, nbytes, version
_BODIES = [struct.Struct(f"<BB{n}qQQ") for n in range(MAX_NDIM + 1)]  # dtype and ndim first
_U16 = struct.Struct("<H")
# By the record's u8 dtype code: a list lookup, not a dict call (0: a code this build does not know).
_ITEMSIZES = [CODE_TO_DTYPE[code].itemsize if code in CODE_TO_DTYPE else 0 for code in range(256)]
_new_tuple = tuple.__new__  # TensorMeta without its generated __new__'s Python frame


def decode_records(
    buf: bytes, pos: int, count: int, max_name: int, max_ndim: int
) -> tuple[list[TensorMeta], int]:
    """``count`` records from ``buf[pos:]``, and the offset after the last."""
    metas: list[TensorMeta] = []
    end = len(buf)
    for _ in range(count):
        name, pos = _string_at(buf, pos, end, max_name)
        if pos + 2 > end:
            raise ProtocolError(f"metadata block truncated inside the record of {name!r}")
        code = buf[pos]
        ndim = buf[pos + 1]
        if ndim > max_ndim:
            raise LimitExceeded(f"{name!r}: {ndim} dims exceeds {max_ndim}")
        tail = _TAILS[ndim]
        start = pos + 2
        pos = start + tail.size
        if pos > end:
            raise ProtocolError(f"metadata block truncated inside the record of {name!r}")
        values = tail.unpack_from(buf, start)
        shape = values[:ndim]
        nbytes = values[ndim]
        itemsize = _ITEMSIZES[code]
        if not itemsize:
            raise InvalidTensor(f"unknown dtype code {code}")  # as dtype_from_code
        meta = _new_tuple(TensorMeta, (name, CODE_TO_DTYPE[code], shape, nbytes, values[ndim + 1]))
        first = values[0] if ndim else 1
        if ndim > 1 or first < 0 or first * itemsize != nbytes:  # a scalar or a vector that adds up passes
            meta.check_size()  # the general case, and every refusal, with its reason
        metas.append(meta)
    return metas, pos


def decode_names(buf: bytes, pos: int, count: int, max_name: int) -> tuple[list[str], int]:
    """``count`` strings from ``buf[pos:]``, and the offset after the last."""
    names: list[str] = []
    end = len(buf)
    for _ in range(count):
        name, pos = _string_at(buf, pos, end, max_name)
        names.append(name)
    return names, pos


def _string_at(buf: bytes, pos: int, end: int, max_bytes: int) -> tuple[str, int]:
    if pos + 2 > end:
        raise ProtocolError(f"metadata block truncated at byte {pos} of {end}")
    n = buf[pos] | buf[pos + 1] << 8
    if n > max_bytes:
        raise LimitExceeded(f"string of {n} bytes exceeds {max_bytes}")
    start = pos + 2
    pos = start + n
    if pos > end:
        raise ProtocolError("metadata block truncated inside a string")
    try:
        return buf[start:pos].decode("utf-8"), pos
    except UnicodeDecodeError as exc:
        raise InvalidName(f"name is not valid UTF-8: {buf[start:pos][:64]!r}") from exc


def pack_records(metas: Sequence[TensorMeta]) -> bytes:
    """The records of ``metas``, one after another (a block adds its count in front)."""
    parts: list[bytes] = []
    for name, dtype, shape, nbytes, version in metas:
        ndim = len(shape)
        if ndim > MAX_NDIM:
            raise InvalidTensor(f"{name!r}: {ndim} dims cannot be encoded (max {MAX_NDIM})")
        code = DTYPE_TO_CODE.get(dtype) or dtype_code(dtype)
        parts.append(pack_string(name))
        parts.append(_BODIES[ndim].pack(code, ndim, *shape, nbytes, version))
    return b"".join(parts)


def pack_names(names: Sequence[str]) -> bytes:
    """The strings of ``names``, one after another."""
    return b"".join([pack_string(name) for name in names])


def pack_string(value: str) -> bytes:
    """One string as the wire carries it: ``u16 length | UTF-8 bytes``."""
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise InvalidName(f"string of {len(raw)} bytes cannot be encoded (max 65535)")
    return _U16.pack(len(raw)) + raw
