"""Resumable and striped puts: the server side of PUT_RESUMABLE, PUT_RANGE and PUT_COMMIT
(docs/protocol.md §11.6, §11.7).

A large put that loses its connection half-way should not start again from byte 0. A client puts a
large tensor under an upload id it chose; the server keeps the upload's reservation, and how many
bytes of it arrived *verified* (whole chunks whose checksum matched, from the start), after the
connection breaks. On a new connection the client asks where to resume and sends the rest; the
tensor becomes visible only when every byte is in, as for any put.

Striped puts (PUT_RANGE / PUT_COMMIT) use the same table: several connections each write one byte
range of the reservation, and PUT_COMMIT publishes the tensor only when the verified ranges tile it
exactly and nobody is writing. Verification is of the bytes that are there: a range has one writer
at a time (a write overlapping one in progress is refused), and a write into a range drops every
verified note it overlaps until that write itself verifies. A range that failed its checksum is
therefore never published, whoever wrote it and in whatever order.

Slots. An open upload holds a reservation and a table slot; the table is not a pool one client can
drain for everyone:

- A resumable put smaller than ``min_bytes`` takes no slot at all: it is served as a plain put (a
  client whose connection breaks asks where to resume, hears 0, and sends it again, which for a
  small tensor costs less than the state would). Clients send PUT_RESUMABLE only from their
  ``resumable_bytes`` (64 MiB by default), above the server's default ``min_bytes`` (16 MiB).
- Each client (the peer's host) holds at most ``per_client`` uploads; a new one beyond that
  replaces that client's own least recently touched idle upload.
- When the whole table (``limit``) is full, a new upload replaces the least recently touched idle
  upload of anyone. Only when every upload is being written to right now is a new one refused.
- Uploads are keyed by (client, upload id): a client never touches another's upload.
- An upload nobody touches within the idle timeout (the server's stall timeout) is dropped.

Every upload dropped before it was committed (replaced or expired) is logged and counted; its
client finds out at its next request (a resume from 0, or a refused commit naming the upload).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.logs import event
from tensorwire.store import Reservation, TensorStore
from tensorwire.types import MiB, TensorMeta

log = logging.getLogger("tensorwire.store.uploads")

DEFAULT_MAX_UPLOADS = 1024
DEFAULT_UPLOADS_PER_CLIENT = 64
DEFAULT_RESUMABLE_MIN_BYTES = 16 * MiB
RESUMABLE = "resumable"
STRIPED = "striped"
# A striped range shorter than this (but the last) is refused: each range is a note the server
# keeps, and 1-byte ranges would let a client grow that table to ~100 bytes per byte it reserved.
MIN_RANGE_BYTES = 4096


class UploadBusy(ProtocolError):
    """Another connection is writing into this upload (or into these bytes of it) right now. The
    server waits a little for it before answering with this (``Upload.on_release``): a client that
    retries after its connection broke often arrives before the server has seen the break."""

    def __init__(self, message: str, upload: Upload) -> None:
        super().__init__(message)
        self.upload = upload


@dataclass(eq=False)
class Upload:
    upload_id: int
    meta: TensorMeta
    reservation: Reservation
    client: str = ""
    kind: str = RESUMABLE  # or STRIPED: an upload is written one way only
    verified: int = 0  # resumable: bytes from the start that arrived in chunks whose checksum matched
    writers: int = 0  # connections sending into it now
    ranges: dict[int, int] = field(default_factory=dict)  # striped: offset -> length, verified
    writing: dict[int, int] = field(default_factory=dict)  # striped: offset -> length, being written
    touched: float = field(default_factory=time.monotonic)
    on_release: list[Callable[[], None]] = field(default_factory=list)  # told when a writer lets go

    @property
    def busy(self) -> bool:
        return self.writers > 0

    @property
    def buffer(self) -> memoryview:
        return self.reservation.buffers[0]

    @property
    def key(self) -> tuple[str, int]:
        return (self.client, self.upload_id)


@dataclass(slots=True)
class UploadCounts:
    """What happened to uploads (metrics; ``status``)."""

    replaced: int = 0  # idle uploads dropped to make room for a new one
    expired: int = 0  # idle uploads dropped after the idle timeout
    refused: int = 0  # new uploads refused: every slot was being written
    unslotted: int = 0  # resumable puts under min_bytes, served as plain puts


class Uploads:
    """The open resumable and striped uploads of one server, by (client, upload id)."""

    def __init__(
        self,
        store: TensorStore,
        limit: int,
        idle_timeout: float,
        *,
        per_client: int = DEFAULT_UPLOADS_PER_CLIENT,
        min_bytes: int = DEFAULT_RESUMABLE_MIN_BYTES,
    ) -> None:
        if limit < 1 or per_client < 1:
            raise ValueError(f"upload limits must be at least 1 (limit={limit}, per_client={per_client})")
        self.store = store
        self.limit = limit
        self.per_client = per_client
        self.min_bytes = min_bytes
        self.idle_timeout = idle_timeout
        self.counts = UploadCounts()
        self._open: dict[tuple[str, int], Upload] = {}

    def __len__(self) -> int:
        return len(self._open)

    def slotted(self, meta: TensorMeta) -> bool:
        """Whether a resumable put of ``meta`` keeps upload state (else: a plain put)."""
        return meta.nbytes >= self.min_bytes

    def resume_point(self, upload_id: int, meta: TensorMeta, client: str = "") -> int:
        """Where to send from: the verified bytes of that upload, or 0 if the server has none."""
        upload = self._open.get((client, upload_id))
        if upload is None or upload.kind != RESUMABLE or not _same(upload.meta, meta):
            return 0
        upload.touched = time.monotonic()
        return upload.verified

    def claim(self, upload_id: int, meta: TensorMeta, offset: int, client: str = "") -> Upload:
        """The resumable upload that bytes from ``offset`` go into (a new one at offset 0), marked busy."""
        upload = self._open.get((client, upload_id))
        if upload is not None and (upload.kind != RESUMABLE or not _same(upload.meta, meta)):
            raise ProtocolError(f"upload {upload_id} is of another tensor than {meta.name!r} or kind")
        if upload is None:
            if offset:
                raise ProtocolError(
                    f"no upload {upload_id} here to resume at byte {offset} (start again at 0)"
                )
            upload = self._open_new(upload_id, meta, client, RESUMABLE)
        elif upload.busy:
            raise UploadBusy(f"upload {upload_id} is being sent on another connection", upload)
        elif offset != upload.verified:
            raise ProtocolError(f"upload {upload_id} resumes at byte {upload.verified}, not {offset}")
        upload.writers = 1
        return upload

    def claim_range(
        self, upload_id: int, meta: TensorMeta, offset: int, length: int, client: str = ""
    ) -> Upload:
        """The striped upload that bytes ``offset .. offset + length`` go into (made on first use).

        Several connections may write into one upload at once, each its own range: a range that
        overlaps one being written now is refused, and the verified notes it overlaps are dropped
        (its bytes are about to change) until ``range_done`` notes it again."""
        end = offset + length
        if length <= 0 or end > meta.nbytes:
            raise ProtocolError(f"bytes {offset}..{end} are not inside {meta.name!r}")
        if length < MIN_RANGE_BYTES and end != meta.nbytes:
            short = f"a {length}-byte range is too short"
            raise ProtocolError(f"{short} (all but the last need {MIN_RANGE_BYTES})")
        upload = self._open.get((client, upload_id))
        if upload is None:
            upload = self._open_new(upload_id, meta, client, STRIPED)
        elif upload.kind != STRIPED or not _same(upload.meta, meta):
            raise ProtocolError(f"upload {upload_id} is of another tensor than {meta.name!r} or kind")
        for start, size in upload.writing.items():
            if start < end and offset < start + size:
                raise UploadBusy(
                    f"bytes {offset}..{end} of upload {upload_id} overlap bytes {start}..{start + size},"
                    " which another connection is writing now",
                    upload,
                )
        for start, size in list(upload.ranges.items()):
            if start < end and offset < start + size:
                del upload.ranges[start]  # about to be overwritten: verified no longer
        upload.writing[offset] = length
        upload.writers += 1
        return upload

    def range_done(self, upload: Upload, offset: int, ok: bool) -> None:
        """The write of the range at ``offset`` ended: verified (``ok``) or not (then its bytes
        stay unverified, and a commit is refused until the range is written again)."""
        length = upload.writing.pop(offset)
        if ok:
            upload.ranges[offset] = length
        self.release(upload)

    def complete(self, upload_id: int, meta: TensorMeta, client: str = "") -> Upload:
        """The striped upload, taken out, if nobody writes into it and its verified ranges tile the
        whole tensor exactly; ProtocolError (and the upload stays, for the missing ranges) otherwise."""
        upload = self._open.get((client, upload_id))
        if upload is None or upload.kind != STRIPED or not _same(upload.meta, meta):
            raise ProtocolError(f"no striped upload {upload_id} of {meta.name!r} here to commit")
        pos = 0
        for offset, length in sorted(upload.ranges.items()):
            if offset != pos:
                break
            pos += length
        if upload.busy:
            raise ProtocolError(f"upload {upload_id} of {meta.name!r} is still being written")
        if pos != meta.nbytes:
            raise ProtocolError(
                f"upload {upload_id} of {meta.name!r} holds {pos} of {meta.nbytes} bytes verified"
            )
        self._open.pop(upload.key)
        return upload

    def release(self, upload: Upload) -> None:
        """The connection sending into ``upload`` is done with it (it may resume later)."""
        upload.writers = max(0, upload.writers - 1)
        upload.touched = time.monotonic()
        waiting, upload.on_release = upload.on_release, []
        for wake in waiting:
            wake()

    def finish(self, upload: Upload) -> None:
        """Every byte is in and verified: the caller commits the reservation."""
        self._open.pop(upload.key, None)

    def drop(self, upload: Upload) -> None:
        if self._open.pop(upload.key, None) is not None:
            self.store.abort(upload.reservation)

    def expire(self, now: float) -> None:
        """Drop uploads idle for longer than the idle timeout (their client gave up)."""
        for upload in list(self._open.values()):
            if not upload.busy and now - upload.touched > self.idle_timeout:
                self.counts.expired += 1
                self._forget(upload, "expired")

    def close(self) -> None:
        for upload in list(self._open.values()):
            self.drop(upload)

    # -- slots ---------------------------------------------------------------------------------
    def _open_new(self, upload_id: int, meta: TensorMeta, client: str, kind: str) -> Upload:
        """A new upload: a slot (made by replacing an idle upload when the client's quota or the
        table is full), then its reservation (CapacityExceeded leaves no trace)."""
        mine = [u for u in self._open.values() if u.client == client]
        if len(mine) >= self.per_client:
            self._make_room(mine, f"client {client or '?'} has {len(mine)} uploads open",
                            "--uploads-per-client", self.per_client)  # fmt: skip
        if len(self._open) >= self.limit:
            self._make_room(list(self._open.values()), f"{len(self._open)} uploads are open",
                            "--max-uploads", self.limit)  # fmt: skip
        upload = Upload(upload_id, meta, self.store.reserve([meta]), client, kind)
        self._open[upload.key] = upload
        return upload

    def _make_room(self, among: list[Upload], why: str, flag: str, limit: int) -> None:
        idle = [u for u in among if not u.busy]
        if not idle:
            self.counts.refused += 1
            raise LimitExceeded(f"{why}, all being written now: at most {limit} ({flag})")
        self.counts.replaced += 1
        self._forget(min(idle, key=lambda u: u.touched), f"replaced: {why} ({flag} {limit})")

    def _forget(self, upload: Upload, why: str) -> None:
        event(log, logging.WARNING, "upload dropped", upload=upload.upload_id, tensor=upload.meta.name,
              client=upload.client, kind=upload.kind, reason=why)  # fmt: skip
        self.drop(upload)


def client_of(peer: str) -> str:
    """The client an upload belongs to: the peer's host (``tcp://10.0.0.5:41234`` -> ``10.0.0.5``;
    a gRPC peer, ``ipv4:10.0.0.5:41234`` or ``ipv6:[::1]:5``, the same way), so that a client's
    uploads survive its reconnects and its stripes share them, and a host's quotas count its frame
    connections and its gRPC calls together."""
    rest = peer.split("://", 1)[-1]
    kind, sep, address = rest.partition(":")
    if sep and kind in ("ipv4", "ipv6"):
        rest = address
    if rest.startswith("["):  # [v6]:port
        return rest[1 : rest.find("]")] if "]" in rest else rest
    host, sep, port = rest.rpartition(":")
    return host if sep and port.isdigit() else rest


def _same(a: TensorMeta, b: TensorMeta) -> bool:
    return a[:4] == b[:4]  # name, dtype, shape, nbytes
