"""A frame's data section cut into chunks, bytes in and bytes out: no stream, no await.

Both sides walk the same cut (``pieces``): the data section is the concatenation of the tensors'
bytes, cut into chunks of ``chunk_size`` bytes; a chunk may span several tensors (many small ones)
and a tensor many chunks (a large one). Runs of small tensors are joined to send (``coalesced``)
and staged to receive (``runs``): a copy costs less than a call per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import xxhash

from tensorwire.wire.checksum import ChecksumKind, checksum, new_hasher

COALESCE = 16 << 10  # pieces smaller than this are copied together: a copy is cheaper than a syscall


def pieces(segments: Iterable[memoryview], chunk_size: int) -> Iterator[list[memoryview]]:
    """The data section cut into chunks: for each chunk, the segment slices it is made of."""
    chunk: list[memoryview] = []
    room = chunk_size
    for seg in segments:
        pos, size = 0, seg.nbytes
        while pos < size:
            take = min(room, size - pos)
            chunk.append(seg[pos : pos + take] if take != size else seg)
            pos += take
            room -= take
            if room == 0:
                yield chunk
                chunk, room = [], chunk_size
    if chunk:
        yield chunk


def digest(kind: int, pieces: list[memoryview]) -> int:
    if len(pieces) == 1:
        return checksum(kind, pieces[0])
    if kind == ChecksumKind.XXH3_64:
        h = xxhash.xxh3_64()
        for piece in pieces:
            h.update(piece)
        return int(h.intdigest())
    hasher = new_hasher(kind)
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def runs(
    segments: Sequence[memoryview],
) -> tuple[list[memoryview], list[tuple[memoryview, list[memoryview]]]]:
    """For receiving: group runs of small destination segments into one staging buffer each;
    large segments stand alone.

    Many small tensors cost a Python call per piece (read, hash); one memcpy out of a contiguous
    run, once the run is verified, is far cheaper. Large tensors are never staged: their bytes land
    zero-copy. Returns the segments to read into and, per staging buffer, the segments it stands
    for. (Sending coalesces lazily instead, in ``coalesced``.)
    """
    out: list[memoryview] = []
    staged: list[tuple[memoryview, list[memoryview]]] = []
    run: list[memoryview] = []
    for seg in [*segments, None]:
        if seg is not None and seg.nbytes < COALESCE:
            run.append(seg)
            continue
        if len(run) > 1:
            # numpy.empty: no zero fill (a bytearray of a 100 MB run of small tensors costs ~50 ms
            # of the loop's time before the first byte arrives); every byte is received into it.
            buf = np.empty(sum(r.nbytes for r in run), dtype=np.uint8).data.cast("B")
            staged.append((buf, run))
            out.append(buf)
        else:
            out.extend(run)
        run = []
        if seg is not None:
            out.append(seg)
    return out, staged


def coalesced(segments: Iterable[bytes | bytearray | memoryview], cap: int) -> Iterator[memoryview]:
    """The segments to send, runs of small ones joined (a copy is cheaper than a call per tensor)
    into pieces of at most ``cap`` bytes, built as the sender reaches them: the memory a frame
    needs stays one chunk, however many small tensors it carries. A small segment that is not a
    view (a stored tensor's ``bytearray``) is joined as it is: a view of each of 10,000 would be
    20,000 tracked objects alive at once, and the collections they bring walk the whole store."""
    run: list[bytes | bytearray | memoryview] = []
    size = 0
    for seg in segments:
        n = seg.nbytes if isinstance(seg, memoryview) else len(seg)
        if n >= COALESCE:
            if run:
                yield memoryview(b"".join(run))
                run, size = [], 0
            yield seg if isinstance(seg, memoryview) else memoryview(seg)
            continue
        run.append(seg)
        size += n
        if size >= cap:
            yield memoryview(b"".join(run))
            run, size = [], 0
    if len(run) == 1:
        yield run[0] if isinstance(run[0], memoryview) else memoryview(run[0])  # no copy of one
    elif run:
        yield memoryview(b"".join(run))
