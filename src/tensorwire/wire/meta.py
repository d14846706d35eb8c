"""Metadata blocks: the per-opcode fields between the header and the data section.

All integers are little-endian. A string is ``u16 length | UTF-8 bytes``; a tensor record is
``name | u8 dtype | u8 ndim | i64 x ndim shape | u64 nbytes | u64 version``. Decoding checks every
count and length against the receiver's ``Limits`` and against the bytes actually present, so a
truncated or lying block raises a ``TensorwireError`` (``ProtocolError``, ``LimitExceeded``,
``InvalidName`` for bad UTF-8, ``InvalidTensor`` for an unknown dtype or inconsistent size), never
an ``IndexError`` or ``struct.error``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tensorwire import topology
from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import codec

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ERROR = struct.Struct("<H")
_HELLO_REQ = struct.Struct("<BB")
_HELLO_RESP = struct.Struct("<BIHBIQIIIQQ")
MAX_MESSAGE_BYTES = 4096
MAX_TOKEN_BYTES = 4096  # a HELLO's token (security.load_token refuses longer ones)


class MetaReader:
    """Bounds-checked cursor over a metadata block."""

    __slots__ = ("_buf", "_limits", "_pos")

    def __init__(self, buf: bytes, limits: Limits) -> None:
        self._buf = buf if type(buf) is bytes else bytes(buf)  # the compiled codec reads bytes only
        self._pos = 0
        self._limits = limits

    def take(self, st: struct.Struct) -> tuple[int, ...]:
        end = self._pos + st.size
        if end > len(self._buf):
            raise ProtocolError(f"metadata block truncated at byte {self._pos} of {len(self._buf)}")
        values = st.unpack_from(self._buf, self._pos)
        self._pos = end
        return values

    def u8(self) -> int:
        return self.take(_U8)[0]

    def u32(self) -> int:
        return self.take(_U32)[0]

    def u64(self) -> int:
        return self.take(_U64)[0]

    def count(self) -> int:
        n = self.u32()
        if n > self._limits.max_batch:
            raise LimitExceeded(f"batch of {n} items exceeds {self._limits.max_batch}")
        return n

    def peek_count(self) -> int:
        """The count the next ``count()`` will read, checked the same way, without moving on: a
        receiver can weigh what the items will cost before it decodes them."""
        pos = self._pos
        try:
            return self.count()
        finally:
            self._pos = pos

    def text(self, max_bytes: int) -> str:
        (text,), self._pos = codec.decode_names(self._buf, self._pos, 1, max_bytes)
        return text

    def name(self) -> str:
        return self.text(self._limits.max_name_bytes)

    def record(self) -> TensorMeta:
        """One tensor record (``codec_py``: the format, and every check a record gets)."""
        return self.records_of(1)[0]

    def records(self) -> list[TensorMeta]:
        """A records block: its count, then that many records (one call into ``codec``)."""
        return self.records_of(self.count())

    def records_of(self, count: int) -> list[TensorMeta]:
        lim = self._limits
        metas, self._pos = codec.decode_records(self._buf, self._pos, count, lim.max_name_bytes, lim.max_ndim)
        return metas

    def names(self) -> list[str]:
        """A names block: its count, then that many names."""
        count = self.count()  # first: it moves the cursor
        names, self._pos = codec.decode_names(self._buf, self._pos, count, self._limits.max_name_bytes)
        return names

    def raw(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError(f"metadata block truncated: {n} bytes wanted at byte {self._pos}")
        raw = self._buf[self._pos : end]
        self._pos = end
        return bytes(raw)

    @property
    def remaining(self) -> int:
        return len(self._buf) - self._pos

    def done(self) -> None:
        if self._pos != len(self._buf):
            raise ProtocolError(f"{len(self._buf) - self._pos} unexpected bytes after the metadata block")


def _text(value: str) -> bytes:
    return codec.pack_string(value)


def encode_record(meta: TensorMeta) -> bytes:
    return codec.pack_records((meta,))


def encode_records(metas: Sequence[TensorMeta]) -> bytes:
    return _U32.pack(len(metas)) + codec.pack_records(metas)


def join_records(records: Sequence[bytes]) -> bytes:
    """A records block (as ``encode_records``) from records encoded already (``encode_record``)."""
    return _U32.pack(len(records)) + b"".join(records)


def decode_records(reader: MetaReader) -> list[TensorMeta]:
    return reader.records()


def encode_names(names: Iterable[str]) -> bytes:
    names = list(names)
    return _U32.pack(len(names)) + codec.pack_names(names)


def decode_names(reader: MetaReader) -> list[str]:
    return reader.names()


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def encode_list_request(prefix: str, limit: int) -> bytes:
    return _text(prefix) + _U32.pack(limit)


def decode_list_request(reader: MetaReader) -> tuple[str, int]:
    return reader.name(), reader.u32()


_RESUMABLE = struct.Struct("<QQ")
RESUME_QUERY = (1 << 64) - 1  # PUT_RESUMABLE's offset that asks where to resume (no data)


def encode_resumable(upload_id: int, offset: int, meta: TensorMeta) -> bytes:
    """PUT_RESUMABLE's block: ``u64 upload id | u64 offset | records`` (one record)."""
    return _RESUMABLE.pack(upload_id, offset) + encode_records([meta])


def decode_resumable(reader: MetaReader) -> tuple[int, int, list[TensorMeta]]:
    upload_id, offset = reader.take(_RESUMABLE)
    return upload_id, offset, decode_records(reader)


_RANGE = struct.Struct("<QQQ")


def encode_get_range(version: int, offset: int, length: int, name: str) -> bytes:
    """GET_RANGE's block: ``u64 version (0: any) | u64 offset | u64 length | names`` (one name)."""
    return _RANGE.pack(version, offset, length) + encode_names([name])


def decode_get_range(reader: MetaReader) -> tuple[int, int, int, list[str]]:
    version, offset, length = reader.take(_RANGE)
    return version, offset, length, decode_names(reader)


def encode_error(code: int, message: str) -> bytes:
    raw = message.encode("utf-8", "replace")[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")
    return _ERROR.pack(code) + _text(raw)


def decode_error(reader: MetaReader) -> tuple[int, str]:
    (code,) = reader.take(_ERROR)
    return code, reader.text(MAX_MESSAGE_BYTES)


MAX_DOCUMENT_BYTES = 16 << 20  # a JSON document (STATUS, PS_STATS)


def encode_long_text(text: str, limit: int, what: str) -> bytes:
    """``u32 length | UTF-8``: for texts that may outgrow a u16-length string (§4.1)."""
    raw = text.encode("utf-8")
    if len(raw) > limit:
        raise LimitExceeded(f"{what} of {len(raw)} bytes exceeds {limit}")
    return _U32.pack(len(raw)) + raw


def decode_long_text(reader: MetaReader, limit: int, what: str) -> str:
    (n,) = reader.take(_U32)
    if n > limit:
        raise LimitExceeded(f"{what} of {n} bytes exceeds {limit}")
    try:
        return reader.raw(n).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{what} is not valid UTF-8") from exc


def encode_document(text: str) -> bytes:
    """A JSON document as a long text: STATUS's answer (§11.9), the parameter server's stats."""
    return encode_long_text(text, MAX_DOCUMENT_BYTES, "a stats document")


def decode_document(reader: MetaReader) -> str:
    return decode_long_text(reader, MAX_DOCUMENT_BYTES, "a stats document")


class Whereabouts(NamedTuple):
    """Where a server runs, as its HELLO answer says (HELLO_WANTS_LOCATION, §4.5)."""

    host: str  # its host label (topology.here)
    rack: str  # its rack label; "" when unknown
    host_id: int  # its host identity (topology.host_identity): equal ones may share memory
    shm: str  # the URL of its shm:// listener; "" when it serves none


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server tells a client in its HELLO response."""

    version: int
    limits: Limits
    capacity: int
    used: int
    codecs: int = 0  # bit c set: the server decodes chunks of codec c (0: it did not say; §5.5)
    # The identity of the server's store (random, drawn when the server starts; 0: it did not say):
    # one version number means the same bytes only within one store_id (a client cache keys by both).
    store_id: int = 0
    where: Whereabouts | None = None  # where the server runs (None: it did not say)


@dataclass(frozen=True, slots=True)
class Compression:
    """HELLO's optional compression field: the codecs a peer decodes (bit mask), and the codec the
    client wants the server's answers in (``lossless.Codec``, or 255 for auto)."""

    accepts: int
    answers: int


_COMPRESSION = struct.Struct("<BB")


HELLO_WANTS_STORE_ID = 1  # HELLO request ``wants`` bit 0: answer with the store's identity (§4.5)
HELLO_WANTS_LOCATION = 2  # bit 1: answer with where the server runs, and its shm:// listener (§4.5)


def encode_hello_request(
    min_version: int,
    max_version: int,
    token: str | None = None,
    compression: Compression | None = None,
    wants: int = 0,
) -> bytes:
    """The version range a client speaks, then (optional) the shared token it authenticates with,
    then (optional, after a token or an empty string) the compression it asks for, then (optional,
    after a compression field) ``u8 wants``: what else the answer should carry."""
    head = _HELLO_REQ.pack(min_version, max_version)
    if wants & HELLO_WANTS_LOCATION:  # the answer's fields come in bit order: store_id before it
        wants |= HELLO_WANTS_STORE_ID
    if wants and compression is None:
        compression = Compression(0, 0)  # decodes nothing, answers raw: a placeholder before wants
    if compression is not None:
        tail = _U8.pack(wants) if wants else b""
        return head + _text(token or "") + _COMPRESSION.pack(compression.accepts, compression.answers) + tail
    return head + _text(token) if token else head


def decode_hello_wants(reader: MetaReader) -> int:
    """The optional ``u8 wants`` after a HELLO request's compression field (0 if absent)."""
    return reader.u8() if reader.remaining else 0


def decode_hello_request(reader: MetaReader) -> tuple[int, int, str | None, Compression | None]:
    lo, hi = reader.take(_HELLO_REQ)
    token = reader.text(MAX_TOKEN_BYTES) if reader.remaining else None
    compression = Compression(*reader.take(_COMPRESSION)) if reader.remaining else None
    return lo, hi, token or None, compression


def encode_hello_response(info: ServerInfo, with_codecs: bool = False, wants: int = 0) -> bytes:
    """The 48-byte answer; ``with_codecs`` (the request asked about compression) appends
    ``u8 codecs``, the mask of chunk codecs the server decodes, and ``wants`` bit 0 (which only a
    request with a compression field can carry) then ``u64 store_id``, and ``wants`` bit 1 then
    ``string host | string rack | u64 host_id | string shm`` (where the server runs)."""
    lim = info.limits
    tail = _U8.pack(info.codecs) if with_codecs else b""
    if wants & HELLO_WANTS_STORE_ID:
        tail += _U64.pack(info.store_id)
    if wants & HELLO_WANTS_LOCATION:
        where = info.where or Whereabouts("unknown", "", 0, "")
        tail += _text(where.host) + _text(where.rack) + _U64.pack(where.host_id) + _text(where.shm)
    body = _HELLO_RESP.pack(
        info.version,
        lim.max_meta_bytes,
        lim.max_name_bytes,
        lim.max_ndim,
        lim.max_batch,
        lim.max_request_bytes,
        lim.min_chunk_bytes,
        lim.max_chunk_bytes,
        lim.max_inflight,
        info.capacity,
        info.used,
    )
    return body + tail


def decode_hello_response(reader: MetaReader) -> ServerInfo:
    version, meta, name, ndim, batch, req, cmin, cmax, inflight, capacity, used = reader.take(_HELLO_RESP)
    try:
        limits = Limits(meta, name, ndim, batch, req, cmin, cmax, inflight)
    except ValueError as exc:  # a broken or hostile server's numbers
        raise ProtocolError(f"the server announced impossible limits: {exc}") from exc
    codecs = reader.u8() if reader.remaining else 0
    store_id = reader.u64() if reader.remaining else 0  # only when asked for (HELLO_WANTS_STORE_ID)
    info = ServerInfo(version, limits, capacity, used, codecs, store_id)
    if not reader.remaining:  # not asked for (HELLO_WANTS_LOCATION), or a server from before it
        return info
    host, rack = _label(reader, "host", empty=False), _label(reader, "rack", empty=True)
    host_id = reader.u64()
    shm = _label(reader, "shm:// listener", empty=True)
    return dataclasses.replace(info, where=Whereabouts(host, rack, host_id, shm))


def _label(reader: MetaReader, what: str, *, empty: bool) -> str:
    """A HELLO answer's label: a peer's text, so bounded and checked before it is shown or used."""
    value = reader.text(topology.MAX_LABEL_BYTES)
    if empty and not value:
        return value
    try:
        return topology.check_label(value, f"the server's {what}")
    except ValueError as exc:
        raise ProtocolError(str(exc)) from exc
