"""Shared-memory segments as both sides see them (docs/protocol.md §12): the file layout, the
segment names, and the metadata blocks of the SHM_* opcodes. Bytes in, bytes out; no files here.

A segment is one file in the shared-memory directory (``/dev/shm``): a 4 KiB header page, then the
tensor's bytes (page-aligned, so a copy in or out runs at memcpy speed). The header holds a magic,
the segment's *generation* and its data capacity. The server bumps the generation every time it
hands a segment out for new bytes (before anyone writes them), so a reader that sees the same
generation before and after its copy knows it copied one tensor's bytes, not a mix.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from tensorwire.errors import ProtocolError
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm

SHM_DIR_ENV = "TENSORWIRE_SHM_DIR"  # where segments live (default /dev/shm); read when a side starts
DEFAULT_SHM_DIR = Path("/dev/shm")
MAGIC = b"TWSHM\x00\x01\x00"
HEADER_BYTES = 4096  # one page: the data that follows it is page-aligned
_HEAD = struct.Struct("<8sQQ")  # magic, generation, data capacity
_GEN = struct.Struct("<Q")
GEN_OFFSET = 8
PREFIX = "tensorwire-"
# tensorwire-<pid>-<start time of that pid, in clock ticks since boot>-<server instance>-<n | "probe">:
# the owner's pid and start time let the next server remove what a killed one left behind.
NAME = re.compile(r"tensorwire-(\d+)-(\d+)-([0-9a-f]{1,16})-(\d+|probe)")
GET_LEASE = 1  # SHM_GET flag: pin the segments for a view (answered with a lease id)


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR)


def check_name(name: str) -> str:
    """A segment name a peer sent: a plain file name of the tensorwire form, never a path."""
    if NAME.fullmatch(name) is None:
        raise ProtocolError(f"{name!r} is not a tensorwire segment name")
    return name


def pack_head(generation: int, capacity: int) -> bytes:
    return _HEAD.pack(MAGIC, generation, capacity)


def unpack_head(buf: bytes | memoryview) -> tuple[int, int]:
    """(generation, capacity) of a segment's header; ProtocolError if it is not a segment."""
    magic, generation, capacity = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError("the mapped file is not a tensorwire segment (bad magic)")
    return generation, capacity


def generation(buf: bytes | memoryview) -> int:
    return int(_GEN.unpack_from(buf, GEN_OFFSET)[0])


class SegmentRef(NamedTuple):
    """Where one tensor of an SHM_GET or SHM_PUT answer lives: the index of its name or record in
    the request, its record, the segment and the generation its bytes belong to."""

    item: int
    meta: TensorMeta
    segment: str
    generation: int


def encode_refs(refs: Sequence[SegmentRef]) -> bytes:
    parts = [struct.pack("<I", len(refs))]
    for ref in refs:
        parts.append(struct.pack("<I", ref.item))
        parts.append(wm.encode_record(ref.meta))
        parts.append(wm.encode_names([ref.segment])[4:])  # one string
        parts.append(_GEN.pack(ref.generation))
    return b"".join(parts)


def decode_refs(reader: wm.MetaReader, count_of: int) -> list[SegmentRef]:
    """Segment references; each index must point into a request of ``count_of`` items, once."""
    refs = []
    seen: set[int] = set()
    for _ in range(reader.count()):
        index = reader.u32()
        meta = reader.record()
        segment = check_name(reader.text(255))
        gen = reader.u64()
        if index >= count_of or index in seen:
            raise ProtocolError(f"segment reference to item {index} of {count_of}")
        seen.add(index)
        refs.append(SegmentRef(index, meta, segment, gen))
    return refs


def encode_release(leases: Sequence[int], puts: Sequence[int]) -> bytes:
    parts = [struct.pack("<I", len(leases)), *map(_GEN.pack, leases), struct.pack("<I", len(puts))]
    return b"".join([*parts, *map(_GEN.pack, puts)])


def decode_release(reader: wm.MetaReader) -> tuple[list[int], list[int]]:
    leases = [reader.u64() for _ in range(reader.count())]
    puts = [reader.u64() for _ in range(reader.count())]
    reader.done()
    return leases, puts


# -- SHM_GEN_VIEW (docs/protocol.md §16) ----------------------------------------------------------
class ViewAnswer(NamedTuple):
    """An SHM_GEN_VIEW answer: the generation, where its tensors in segments live (``item``: the
    index in ``generation.names``), the indexes of those sent inline (in the answer's record order)
    and the lease that pins the segments (0: none, when every tensor came inline)."""

    generation: Generation
    refs: list[SegmentRef]
    inline: list[int]
    lease: int


def encode_view_request(prefix: str, at: int) -> bytes:
    """``prefix | u64 at`` (0: the newest), as GEN_MANIFEST's."""
    return wg.encode_manifest_request(prefix, at)


def decode_view_request(reader: wm.MetaReader) -> tuple[str, int]:
    return wg.decode_manifest_request(reader)


def encode_view_answer(
    gen: Generation, inline: Sequence[TensorMeta], refs: Sequence[SegmentRef], lease: int
) -> bytes:
    """The inline tensors' records (first: the client's sink reads them), the generation block,
    the refs, the lease."""
    return wm.encode_records(inline) + wg.encode_generation(gen) + encode_refs(refs) + _GEN.pack(lease)


def decode_view_answer(reader: wm.MetaReader, inline: Sequence[TensorMeta], prefix: str) -> ViewAnswer:
    """What follows the inline records (already read: ``inline``) of an answer to a view of
    ``prefix``; ProtocolError unless every name of the generation is answered once, inline or by a
    ref whose record bears that name, and segments come with a lease."""
    gen = wg.decode_generation(reader)
    names = gen.names
    refs = decode_refs(reader, len(names))
    lease = reader.u64()
    reader.done()
    if gen.prefix != prefix:
        raise ProtocolError(
            f"a view of {prefix!r} was answered with generation {gen.number} of {gen.prefix!r}"
        )
    referenced = {ref.item for ref in refs}
    slots = [i for i in range(len(names)) if i not in referenced]
    if len(slots) != len(inline) or any(meta.name != names[i] for i, meta in zip(slots, inline, strict=True)):
        raise ProtocolError(
            f"the inline records of a view of {prefix!r} are not its generation's other tensors"
        )
    if any(ref.meta.name != names[ref.item] for ref in refs):
        raise ProtocolError(f"a segment of a view of {prefix!r} is named for another tensor")
    if refs and not lease:
        raise ProtocolError(f"a view of {prefix!r} has segments but no lease pinning them")
    return ViewAnswer(gen, refs, slots, lease)
