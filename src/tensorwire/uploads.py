"""Resumable puts: the server side of PUT_RESUMABLE (docs/protocol.md §11.6).

A large put that loses its connection half-way should not start again from byte 0. A client puts a
large tensor under an upload id it chose; the server keeps the upload's reservation, and how many
bytes of it arrived *verified* (whole chunks whose checksum matched, from the start), after the
connection breaks. On a new connection the client asks where to resume and sends the rest; the
tensor becomes visible only when every byte is in, as for any put. An upload nobody resumes within
the server's stall timeout is dropped and its reservation freed; at most ``limit`` are open.

Striped puts (PUT_RANGE / PUT_COMMIT, §11.7) use the same uploads: several connections each write
one byte range of the reservation, the server notes each range once its chunks are verified, and
PUT_COMMIT publishes the tensor only when the verified ranges tile it exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.store import Reservation, TensorStore
from tensorwire.types import TensorMeta


@dataclass(eq=False)
class Upload:
    upload_id: int
    meta: TensorMeta
    reservation: Reservation
    verified: int = 0  # bytes from the start that arrived in chunks whose checksum matched
    writers: int = 0  # connections sending into it now
    ranges: dict[int, int] = field(default_factory=dict)  # striped: offset -> length, verified
    touched: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        return self.writers > 0

    @property
    def buffer(self) -> memoryview:
        return self.reservation.buffers[0]


class Uploads:
    """The open resumable uploads of one server, by upload id."""

    def __init__(self, store: TensorStore, limit: int, idle_timeout: float) -> None:
        self.store = store
        self.limit = limit
        self.idle_timeout = idle_timeout
        self._open: dict[int, Upload] = {}

    def __len__(self) -> int:
        return len(self._open)

    def resume_point(self, upload_id: int, meta: TensorMeta) -> int:
        """Where to send from: the verified bytes of that upload, or 0 if the server has none."""
        upload = self._open.get(upload_id)
        return upload.verified if upload is not None and _same(upload.meta, meta) else 0

    def claim(self, upload_id: int, meta: TensorMeta, offset: int) -> Upload:
        """The upload that bytes from ``offset`` go into (a new one at offset 0), marked busy."""
        upload = self._open.get(upload_id)
        if upload is not None and not _same(upload.meta, meta):
            raise ProtocolError(f"upload {upload_id} is of another tensor than {meta.name!r}")
        if upload is None:
            if offset:
                raise ProtocolError(
                    f"no upload {upload_id} here to resume at byte {offset} (start again at 0)"
                )
            if len(self._open) >= self.limit:
                raise LimitExceeded(f"{self.limit} resumable uploads are open already")
            upload = self._open[upload_id] = Upload(upload_id, meta, self.store.reserve([meta]))
        elif upload.busy:
            raise ProtocolError(f"upload {upload_id} is being sent on another connection")
        elif offset != upload.verified:
            raise ProtocolError(f"upload {upload_id} resumes at byte {upload.verified}, not {offset}")
        upload.writers = 1
        return upload

    def claim_range(self, upload_id: int, meta: TensorMeta, offset: int, length: int) -> Upload:
        """The striped upload that bytes ``offset .. offset + length`` go into (made on first use);
        several connections may write into one upload at once, each its own range."""
        if length <= 0 or offset + length > meta.nbytes:
            raise ProtocolError(f"bytes {offset}..{offset + length} are not inside {meta.name!r}")
        upload = self._open.get(upload_id)
        if upload is None:
            if len(self._open) >= self.limit:
                raise LimitExceeded(f"{self.limit} uploads are open already")
            upload = self._open[upload_id] = Upload(upload_id, meta, self.store.reserve([meta]))
        elif not _same(upload.meta, meta):
            raise ProtocolError(f"upload {upload_id} is of another tensor than {meta.name!r}")
        upload.ranges.pop(offset, None)  # a range sent again is verified again
        upload.writers += 1
        return upload

    def complete(self, upload_id: int, meta: TensorMeta) -> Upload:
        """The striped upload, taken out, if its verified ranges tile the whole tensor exactly;
        ProtocolError (and the upload stays, for the missing ranges) otherwise."""
        upload = self._open.get(upload_id)
        if upload is None or not _same(upload.meta, meta):
            raise ProtocolError(f"no striped upload {upload_id} of {meta.name!r} here to commit")
        pos = 0
        for offset, length in sorted(upload.ranges.items()):
            if offset != pos:
                break
            pos += length
        if upload.busy or pos != meta.nbytes:
            raise ProtocolError(f"upload {upload_id} of {meta.name!r} holds {pos} of {meta.nbytes} bytes")
        self._open.pop(upload_id)
        return upload

    def release(self, upload: Upload) -> None:
        """The connection sending into ``upload`` is done with it (it may resume later)."""
        upload.writers = max(0, upload.writers - 1)
        upload.touched = time.monotonic()

    def finish(self, upload: Upload) -> None:
        """Every byte is in and verified: the caller commits the reservation."""
        self._open.pop(upload.upload_id, None)

    def drop(self, upload: Upload) -> None:
        if self._open.pop(upload.upload_id, None) is not None:
            self.store.abort(upload.reservation)

    def expire(self, now: float) -> None:
        """Drop uploads idle for longer than the idle timeout (their client gave up)."""
        for upload in list(self._open.values()):
            if not upload.busy and now - upload.touched > self.idle_timeout:
                self.drop(upload)

    def close(self) -> None:
        for upload in list(self._open.values()):
            self.drop(upload)


def _same(a: TensorMeta, b: TensorMeta) -> bool:
    return a[:4] == b[:4]  # name, dtype, shape, nbytes
