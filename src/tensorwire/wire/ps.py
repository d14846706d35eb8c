"""Metadata blocks of the parameter-server opcodes (docs/protocol.md, "Parameter server").

Every parameter-server request starts with the same 28-byte head, ``u32 worker | u32 world |
u64 clock | u64 seq | u32 wait_ms``, then the job it is for, ``"JB" | u8 length | ASCII id``
(``encode_job``; an empty id: no job, as ALLREDUCE, an observer's PS_STATS, a replica's PING),
then an opcode's own fields:

=========  ===============================================  =========================================
opcode     request after the head                           response
=========  ===============================================  =========================================
PS_INIT    config (string, JSON) | records | [credential];  u8 created | u64 step
           data: values (``seq`` = incarnation)
PS_JOIN    [config | records [credential]] (``seq`` = inc.)  u64 clock | u8 initialized | u64 seq |
                                                            u64 barrier
PS_LEAVE   [u8 final] (``seq`` = incarnation)               (nothing)
PS_PUSH    records | [codec] | [u64 incarnation]; data      u64 version | u32 staleness
PS_PULL    names | [codec] (``seq`` = incarnation)          records | u64 version; data: values
PS_STATS   (nothing)                                        u32 length | UTF-8 JSON
ALLREDUCE  records; data: gradients (``clock`` = step)      records | u32 contributors; data: means
HEARTBEAT  (nothing; ``seq`` = incarnation)                 u32 live (0: dropped, rejoin)
ROLLBACK   (nothing; ``clock`` = the version to go back to)  u64 version
BARRIER    (nothing; ``clock`` = generation, ``seq`` = inc.)  u64 generation released
END        u8 force | [credential]                          (nothing)
=========  ===============================================  =========================================

A credential (``encode_credential``: ``"JT" | u8 length | bytes``) is the job's token, which a job's
workers share and the request that opens a job makes its owner's (ps/job.py ``Job.owner``), or
for PS_END the servers' operator token; none: an open job.

A job id is what a name is, made safe for a directory name and a metric label: 1 to
``MAX_JOB_BYTES`` ASCII letters, digits, ``.``, ``_`` and ``-``, starting with a letter or a digit
(``check_job_id``; both sides check it). A request without the job block (a worker older than
jobs) is a PROTOCOL_ERROR that says so.

PS_PUSH, PS_PULL (request and response) and ALLREDUCE may end with a codec name (``u16 length |
ASCII``, e.g. ``topk:0.01+fp16``): the data section then holds each tensor's payload in that
codec (tensorwire.compression; docs/protocol.md §13.6), and the records still describe the
tensors as decoded. Without it the data is the tensors' raw bytes, as before.

A rank belongs to the session that joined with it: the worker process's *incarnation*, a random
non-zero 63-bit number it sends as PS_JOIN's ``seq``. Every request that acts as that rank carries
it (PS_PULL, PS_LEAVE, PS_HEARTBEAT in ``seq``; PS_PUSH, whose ``seq`` is the push's number, after
its codec: ``encode_push_tail``, an empty codec name then meaning raw data), and the server refuses
one whose incarnation is not the live worker's before it changes anything (docs/protocol.md §13.2).
It is a secret of the worker's: the server never shows it. PS_JOIN may carry the job as the worker
sees it (PS_INIT's config and records), so a worker of another job is refused before it joins.

``worker`` is the worker's rank (``OBSERVER`` for a reader that takes no part in training);
``world`` the number of workers the job was started with; ``clock`` the worker's step count
(pushes done so far); ``seq`` the push's sequence number (1, 2, ... per worker; a push the server
applied already is answered again, not applied again), or the incarnation (above); ``wait_ms``
how long the server may wait on other workers before it answers TIMEOUT (0: the server's default).
Answers that carry tensors put their records first, as GET_MANY does.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

from tensorwire.errors import LimitExceeded, ProtocolError, TensorwireError
from tensorwire.wire.meta import (
    MAX_DOCUMENT_BYTES,
    MetaReader,
    decode_document,
    decode_long_text,
    encode_document,
    encode_long_text,
)

OBSERVER = 0xFFFFFFFF  # the worker id of a reader that is not a worker (pulls without waiting)
MAX_CONFIG_BYTES = 0xFFFF
MAX_STATS_BYTES = MAX_DOCUMENT_BYTES
MAX_CODEC_BYTES = 64
MAX_JOB_BYTES = 64
JOB_TAG = b"JB"  # opens the job block: a frame of a worker older than jobs is told from a new one
CREDENTIAL_TAG = b"JT"  # opens a credential block (a job token, an operator token)
MAX_CREDENTIAL_BYTES = 255

_HEAD = struct.Struct("<IIQQI")
_JOB = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_JOB_BYTES - 1}}}")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_JOIN_REPLY = struct.Struct("<QBQQ")
_RELAY_REPLY = struct.Struct("<QQ")
_U8_U64 = struct.Struct("<BQ")
_U64_U32 = struct.Struct("<QI")


class PsHead(NamedTuple):
    """The fields every parameter-server request starts with: the 28-byte head and the job."""

    worker: int
    world: int = 0
    clock: int = 0
    seq: int = 0
    wait_ms: int = 0
    job: str = ""  # the job the request is for ("": none)

    def encode(self) -> bytes:
        return _HEAD.pack(self.worker, self.world, self.clock, self.seq, self.wait_ms) + encode_job(self.job)

    @staticmethod
    def decode(reader: MetaReader) -> PsHead:
        worker, world, clock, seq, wait_ms = reader.take(_HEAD)
        return PsHead(worker, world, clock, seq, wait_ms, decode_job(reader))


def check_job_id(job: str, *, empty: bool = False) -> str:
    """``job`` if it is a valid job id (see the module doc; ``empty``: "" too), else ValueError."""
    if job == "" and empty:
        return job
    if not isinstance(job, str) or not _JOB.fullmatch(job):
        shown = job[:80] if isinstance(job, str) else type(job).__name__
        raise ValueError(
            f"job id {shown!r} is not 1 to {MAX_JOB_BYTES} ASCII letters, digits, '.', '_' or '-' "
            "starting with a letter or a digit"
        )
    return job


def encode_job(job: str) -> bytes:
    raw = check_job_id(job, empty=True).encode("ascii")
    return JOB_TAG + _U8.pack(len(raw)) + raw


def decode_job(reader: MetaReader) -> str:
    """The job block after the head; ProtocolError for a frame without one (an older worker) or
    an id that is not valid (checked before anything looks it up)."""
    if reader.remaining < len(JOB_TAG) + 1 or reader.raw(len(JOB_TAG)) != JOB_TAG:
        raise ProtocolError(
            "this parameter-server request names no job after its head: a worker or client older "
            "than this server, from before job ids? Use the same tensorwire on workers and servers"
        )
    (n,) = reader.take(_U8)
    if n > MAX_JOB_BYTES:
        raise LimitExceeded(f"a job id of {n} bytes exceeds {MAX_JOB_BYTES}")
    raw = reader.raw(n)
    try:
        return check_job_id(raw.decode("ascii"), empty=True)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"unusable job id {raw[:80]!r}: {exc}") from None


def encode_credential(token: bytes) -> bytes:
    """The credential a PS_JOIN (after its job), PS_INIT or PS_END may end with: a job token or
    the operator's, ``"JT" | u8 length | bytes``; nothing for none."""
    if not token:
        return b""
    if len(token) > MAX_CREDENTIAL_BYTES:
        raise LimitExceeded(f"a job or operator token of {len(token)} bytes exceeds {MAX_CREDENTIAL_BYTES}")
    return CREDENTIAL_TAG + _U8.pack(len(token)) + token


def decode_credential(reader: MetaReader) -> bytes:
    """The credential block where the request may end (``b""``: none); ProtocolError for anything
    else there."""
    if not reader.remaining:
        return b""
    if reader.remaining < len(CREDENTIAL_TAG) + 1 or reader.raw(len(CREDENTIAL_TAG)) != CREDENTIAL_TAG:
        raise ProtocolError("bytes where a credential block (a job or operator token) may end the request")
    (n,) = reader.take(_U8)
    if not n:
        raise ProtocolError("an empty credential block (send none instead)")
    return reader.raw(n)


def encode_config(config: str) -> bytes:
    return encode_long_text(config, MAX_CONFIG_BYTES, "a parameter-server config")


def decode_config(reader: MetaReader) -> str:
    return decode_long_text(reader, MAX_CONFIG_BYTES, "a parameter-server config")


def encode_init_reply(created: bool, step: int) -> bytes:
    return _U8_U64.pack(int(created), step)


def decode_init_reply(reader: MetaReader) -> tuple[bool, int]:
    created, step = reader.take(_U8_U64)
    return bool(created), step


def encode_join_reply(clock: int, initialized: bool, seq: int, barrier: int) -> bytes:
    return _JOIN_REPLY.pack(clock, int(initialized), seq, barrier)


def decode_join_reply(reader: MetaReader) -> tuple[int, bool, int, int]:
    """(clock, initialized, the last push seq applied, the last barrier generation released)."""
    clock, initialized, seq, barrier = reader.take(_JOIN_REPLY)
    return clock, bool(initialized), seq, barrier


def encode_flag(value: bool) -> bytes:
    """PS_LEAVE's ``final`` (the worker is done: its job may end), PS_END's ``force``."""
    return _U8.pack(int(value))


def decode_flag(reader: MetaReader, default: bool = False) -> bool:
    if not reader.remaining:
        return default
    (value,) = reader.take(_U8)
    if value > 1:
        raise ProtocolError(f"a flag is 0 or 1, not {value}")
    return bool(value)


def encode_push_reply(version: int, staleness: int) -> bytes:
    return _U64_U32.pack(version, min(staleness, 0xFFFFFFFF))


def decode_push_reply(reader: MetaReader) -> tuple[int, int]:
    version, staleness = reader.take(_U64_U32)
    return version, staleness


def encode_relay_reply(version: int, generation: int) -> bytes:
    """PS_RELAY's answer: the job's version, and the number of the generation of ``_ps/<job>``
    it is published as (read it through the relay, docs/protocol.md §15)."""
    return _RELAY_REPLY.pack(version, generation)


def decode_relay_reply(reader: MetaReader) -> tuple[int, int]:
    version, generation = reader.take(_RELAY_REPLY)
    return int(version), int(generation)


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(reader: MetaReader) -> int:
    return int(reader.take(_U64)[0])


def encode_u32(value: int) -> bytes:
    return _U32.pack(value)


def decode_u32(reader: MetaReader) -> int:
    return int(reader.take(_U32)[0])


def encode_codec(name: str | None) -> bytes:
    """The optional codec trailer: nothing for raw data, else ``u16 length | ASCII name``."""
    if not name:
        return b""
    raw = name.encode("ascii")
    if len(raw) > MAX_CODEC_BYTES:
        raise LimitExceeded(f"codec name of {len(raw)} bytes exceeds {MAX_CODEC_BYTES}")
    return _U16.pack(len(raw)) + raw


def decode_codec(reader: MetaReader) -> str | None:
    """The codec trailer's name, or None when the block ends here (raw data)."""
    if not reader.remaining:
        return None
    try:
        name = reader.text(MAX_CODEC_BYTES)
    except LimitExceeded:
        raise
    except TensorwireError as exc:  # bad UTF-8 is InvalidName there: here it is a broken frame
        raise ProtocolError(f"unreadable codec name: {exc}") from exc
    if not name or not name.isascii():
        raise ProtocolError(f"codec name {name!r} is empty or not ASCII")
    return name


def encode_push_tail(codec: str | None, incarnation: int) -> bytes:
    """PS_PUSH's trailer: the codec name (empty for raw data), then ``u64 incarnation``. Without an
    incarnation it is the plain codec trailer of older workers (``encode_codec``)."""
    if not incarnation:
        return encode_codec(codec)
    raw = (codec or "").encode("ascii")
    if len(raw) > MAX_CODEC_BYTES:
        raise LimitExceeded(f"codec name of {len(raw)} bytes exceeds {MAX_CODEC_BYTES}")
    return _U16.pack(len(raw)) + raw + _U64.pack(incarnation)


def decode_push_tail(reader: MetaReader) -> tuple[str | None, int]:
    """(codec or None, incarnation or 0) of PS_PUSH's trailer; see ``encode_push_tail``."""
    if not reader.remaining:
        return None, 0
    (n,) = reader.take(_U16)
    if n > MAX_CODEC_BYTES:
        raise LimitExceeded(f"codec name of {n} bytes exceeds {MAX_CODEC_BYTES}")
    raw = reader.raw(n)
    name = raw.decode("ascii") if raw.isascii() else ""
    if len(name) != n or not name.isprintable():
        raise ProtocolError(f"codec name {raw!r} is not printable ASCII")
    incarnation = decode_u64(reader) if reader.remaining else 0
    if not name and not incarnation:
        raise ProtocolError("an empty codec name without an incarnation")
    return name or None, incarnation


# The stats document is the wire's JSON document (wire/meta.py), which STATUS answers too.
encode_stats = encode_document
decode_stats = decode_document
