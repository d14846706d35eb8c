"""An engine's side of a weight update, without vLLM: bring one generation of a prefix into staging
tensors, checked whole, before anything touches the model.

``WeightReader.bring`` does, in order:

1. reads the generation's manifest from the store (names, shapes, dtypes, per-chunk checksums) and
   checks it against the model's reference (layout.py): a generation that does not fit the model is
   refused here, before a byte of it is read or a staging tensor allocated;
2. brings it into the staging tensors with a ``Subscriber``: through the relay when several engines
   read the same generation (the origin sends the model about once), as a delta from the origin
   when the staging tensors hold the previous generation, every chunk checked against the
   manifest's checksum on arrival;
3. if the Subscriber brought a newer generation than the one checked (a trainer published again
   meanwhile), checks that one's manifest too, so staging never holds a layout that was not
   checked; with ``verify``, re-checksums all of staging against the manifest and its root digest.

Only then does the caller apply the staging tensors to its model (``load_weights``, in engine.py):
a failure in any step above leaves the model as it was. Staging costs the model's size once, the
room the deltas and the relay need: it holds the last generation brought, which the next update's
delta is taken against and which this reader forwards to the engines after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from tensorwire.broadcast import Subscriber
from tensorwire.client.core import Client, connect
from tensorwire.client.generations import verify_read
from tensorwire.errors import LayoutMismatch, TensorwireError, WaitTimeout
from tensorwire.logs import event
from tensorwire.security import TlsFiles
from tensorwire.types import GenerationManifest, TensorMeta
from tensorwire.vllm.layout import MAX_VERSION_BYTES, VERSION_KEY, Reference, decode_version, key_of

log = logging.getLogger(__name__)

At = int | Literal["latest"]


@dataclass(frozen=True)
class ReaderOptions:
    """Where an engine reads its weights and how. ``url``: the store (origin) the trainer publishes
    to; ``prefix``: the one prefix this engine reads (its generations' names are ``prefix/key``).
    ``token``/``tls``: credentials, as any client's (None: ``$TENSORWIRE_TOKEN`` and the system CA).
    ``relay``: serve the chunks read to the engines that read after this one; ``deltas``: read only
    what changed when staging holds the previous generation and at most ``delta_limit`` of its
    bytes changed (the manifests' chunk checksums say which); ``verify``: also re-checksum all of
    staging before applying. ``timeout``: one update's read, at most (seconds)."""

    url: str
    prefix: str
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None
    relay: bool = True
    deltas: bool = True
    verify: bool = False
    timeout: float = 120.0
    connect_timeout: float = 10.0
    # A delta is read from the origin by each engine, the relay's chunks about once in all: past
    # this share of changed bytes (a full fine-tuning step changes them all), the relay is cheaper.
    delta_limit: float = 0.25
    # Read each generation into staging as soon as it is published (``Prefetcher``), so that the
    # update that applies it only applies it: the engine's serving waits for the apply alone.
    prefetch: bool = True

    def connect(self) -> Client:
        """A client of the store with these credentials and timeouts."""
        return connect(self.url, token=self.token, tls=self.tls, timeout=self.timeout,
                       connect_timeout=self.connect_timeout)  # fmt: skip


@dataclass(frozen=True)
class Brought:
    """One generation, whole and checked, in staging: its ``number``, its ``version`` (the string
    the trainer published with it, or the number), and the weights by key (staging's own tensors:
    valid until the next ``bring``)."""

    number: int
    version: str
    weights: Mapping[str, torch.Tensor]
    received: int  # bytes this update moved over the network (0: staging held it already)


class WeightReader:
    """Brings generations of ``options.prefix`` into staging (see the module docstring)."""

    def __init__(self, options: ReaderOptions, reference: Reference) -> None:
        if not 0 < options.timeout < float("inf"):
            raise ValueError(f"an update needs a finite timeout, not {options.timeout}")
        self.options = options
        self.reference = reference
        self.staging: dict[str, torch.Tensor] = {}
        self._subscriber: Subscriber | None = None
        self._client: Client | None = None
        self._held: GenerationManifest | None = None  # the manifest of what staging holds
        # One bring at a time: the update's, or the prefetcher's on its thread (Prefetcher).
        self._lock = threading.RLock()

    def newest(self) -> int:
        """The newest generation of the prefix (0: none yet)."""
        try:
            return self._manifest("latest").generation.number
        except KeyError:
            return 0

    def bring(self, at: At) -> Brought:
        """Generation ``at`` (or the newest) in staging, checked; see the module docstring.
        LayoutMismatch if it does not fit the model; the store's errors (GenerationRetired,
        AuthenticationError, TransferTimeout, ...) as they come; in every case the model is untouched.
        A generation brought already (by the prefetcher) costs two small requests, no data."""
        with self._lock:
            return self._bring(at)

    def _bring(self, at: At) -> Brought:
        started = time.monotonic()
        manifest = self._manifest(at)
        metas = self.reference.check(manifest, self.options.prefix)
        subscriber = self._subscriber_for(metas)
        subscriber.deltas = self.options.deltas and changed(self._held, manifest) <= self.options.delta_limit
        self._held = None  # staging is being overwritten: no delta base until this update is done
        number = subscriber.update(self.options.timeout)
        if number != manifest.generation.number:
            if at != "latest" and number > at:
                raise LayoutMismatch(
                    f"asked for generation {at} of {self.options.prefix!r}, but generation {number} was "
                    "published meanwhile: the update read that one and did not apply it"
                )
            manifest = self._manifest(number)
            self.reference.check(manifest, self.options.prefix)
        if self.options.verify:
            # staging always has room for a version record; a generation published without one
            # has none to check (its weights were checked against the reference above)
            versioned = self._versioned(manifest)
            full = {
                f"{self.options.prefix}/{k}": t
                for k, t in self.staging.items()
                if k != VERSION_KEY or versioned
            }
            verify_read(manifest, full, manifest.generation.digest)
        self._held = manifest
        record = subscriber.updates[-1]  # this update's: how it came and the data bytes it moved
        moved = record.bytes if record.way != "current" else 0
        event(log, logging.INFO, "generation brought into staging", prefix=self.options.prefix,
              generation=number, way=record.way, received=moved,
              seconds=round(time.monotonic() - started, 3))  # fmt: skip
        return Brought(number, self._version(manifest), self._weights(), moved)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._held = None
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- parts ---------------------------------------------------------------------------------------
    def _manifest(self, at: At) -> GenerationManifest:
        if self._client is None:
            self._client = self.options.connect()
        return self._client.manifest(self.options.prefix, at=at)

    def _subscriber_for(self, metas: list[TensorMeta]) -> Subscriber:
        """The Subscriber whose staging fits ``metas`` (checked against the reference, so bounded
        by the model's size); a new one, with new staging, when the dtypes changed."""
        wanted = {key_of(self.options.prefix, m.name): m for m in metas}
        same = (
            self._subscriber is not None
            and set(wanted) == set(self.staging) - {VERSION_KEY}
            and all(
                self.staging[k].dtype == m.dtype and tuple(self.staging[k].shape) == m.shape
                for k, m in wanted.items()
            )
        )
        if self._subscriber is not None and same:
            return self._subscriber
        self._close()
        self.staging = {k: torch.empty(m.shape, dtype=m.dtype) for k, m in wanted.items()}
        self.staging[VERSION_KEY] = torch.zeros(MAX_VERSION_BYTES, dtype=torch.uint8)
        o = self.options
        self._subscriber = Subscriber(
            o.url, o.prefix, self.staging, token=o.token, tls=o.tls, relay=o.relay, deltas=o.deltas,
            timeout=o.timeout, connect_timeout=o.connect_timeout,
        )  # fmt: skip
        return self._subscriber

    def _version(self, manifest: GenerationManifest) -> str:
        """The version string published with the generation (its number if none was)."""
        number = manifest.generation.number
        return decode_version(self.staging[VERSION_KEY], number) if self._versioned(manifest) else str(number)

    def _versioned(self, manifest: GenerationManifest) -> bool:
        """Whether the generation was published with a version record."""
        name = f"{self.options.prefix}/{VERSION_KEY}"
        return any(entry.meta.name == name for entry in manifest.tensors)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: t for k, t in self.staging.items() if k != VERSION_KEY}


def changed(held: GenerationManifest | None, new: GenerationManifest) -> float:
    """The share of ``new``'s bytes in chunks whose checksum differs from ``held``'s (1.0 when
    nothing is held, or the chunking differs): what a delta read of ``new`` would move."""
    total = new.generation.nbytes
    if (
        held is None
        or held.chunk_size != new.chunk_size
        or held.checksum_kind != new.checksum_kind
        or not total
    ):
        return 1.0
    before = {entry.meta.name: entry for entry in held.tensors}
    moved = 0
    for entry in new.tensors:
        old = before.get(entry.meta.name)
        if old is None or old.meta.dtype != entry.meta.dtype or old.meta.shape != entry.meta.shape:
            moved += entry.meta.nbytes
            continue
        for index, (a, b) in enumerate(zip(old.checksums, entry.checksums, strict=True)):
            if a != b:
                moved += min(new.chunk_size, entry.meta.nbytes - index * new.chunk_size)
    return moved / total


class Prefetcher:
    """Brings each generation of ``reader``'s prefix into its staging as soon as it is published
    (the store notifies a wait; no polling), on a thread of its own, so that the update which
    applies it finds it there. A generation it cannot bring (it does not fit, a chunk is corrupt,
    the store is unreachable) is logged and counted (``failures``) and left to the update, which
    raises why. ``close`` stops it within ``poll`` seconds."""

    def __init__(self, reader: WeightReader, poll: float = 2.0) -> None:
        self.reader = reader
        self.poll = poll
        self.brought = 0  # generations brought ahead of their update
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorwire-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        o = self.reader.options
        after = 0
        client: Client | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = o.connect()
                after = client.wait(o.prefix, after, timeout=self.poll).number
            except WaitTimeout:
                continue  # nothing new within poll: look at the stop flag, and wait again
            except (TensorwireError, OSError) as exc:
                self._failed("cannot wait for generations", exc)
                if client is not None:
                    client.close()
                    client = None
                self._stop.wait(self.poll)
                continue
            if self._stop.is_set():
                break
            try:
                self.reader.bring("latest")
                self.brought += 1
            except Exception as exc:
                self._failed("could not bring a generation ahead of its update", exc)
        if client is not None:
            client.close()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        event(log, logging.WARNING, what, prefix=self.reader.options.prefix, failures=self.failures,
              error=repr(exc))  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.poll + self.reader.options.timeout)
