"""``ClientOptions``: how a client waits, retries and connects; and the one translation of them
into what a transport needs (``transport_options``) and how a call is retried (``retry_policy``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from tensorwire._aio import Deadline
from tensorwire.client.retry import RetryPolicy, backoff
from tensorwire.security import Security, TlsFiles, client_token
from tensorwire.transport import TransportOptions
from tensorwire.transport.spin import MAX_SPIN
from tensorwire.wire import lossless
from tensorwire.wire.checksum import ChecksumKind

CHECKSUMS = {"xxh3": ChecksumKind.XXH3_64, "crc32c": ChecksumKind.CRC32C}


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client waits and retries. Every wait is finite."""

    timeout: float = 60.0  # one request: its send and its answer
    connect_timeout: float = 10.0
    retries: int = 3
    backoff: float = 0.05  # first retry delay; doubles each time, with jitter
    max_backoff: float = 2.0
    checksum: str = "xxh3"
    chunk_size: int | None = None
    # Deprecated (a DeprecationWarning): ``tls=TlsFiles(ca=..., cert=..., key=...)``, below.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None  # the server's shared token; None: $TENSORWIRE_TOKEN if set
    # A put of one tensor at least this large resumes after a broken connection from the last
    # verified chunk, not from byte 0 (tcp://, tls://, memory://); 0: never.
    resumable_bytes: int = 64 << 20
    # Lossless chunk compression on tcp://, tls://, memory:// ("none", "lz4", "zstd", or "auto":
    # lz4 only when the codec beats the link; incompressible data always goes raw). Negotiated per
    # connection in HELLO: a server without it gets raw chunks.
    compression: str = "none"
    # A tensor of at least stripe_bytes travels over several connections at once (tcp://, tls://):
    # `stripes` of them, or with 0 one per usable core (at most 8, each range ≥ 16 MiB); 1 (the
    # default): never. Opt-in, since the server receives on one event loop: measure it first.
    # A striped put retries each range on its own; it is not PUT_RESUMABLE.
    stripe_bytes: int = 64 << 20
    stripes: int = 1
    # Cached copies of what `get` read, up to cache_bytes (0: no cache). A cached get costs one STAT,
    # or nothing within cache_lease seconds of the last confirmation (cache.py); copies are keyed by
    # the store that answered (HELLO store_id), so a gRPC server (which gives none) caches nothing.
    cache_bytes: int = 0
    cache_lease: float = 0.0
    # A whole command's deadline (`dataset fetch --deadline`): every call of a blocking Client gives
    # up at it with TransferTimeout, whatever its own timeouts and retries would still allow.
    deadline: Deadline | None = None
    # Where the server of a tcp:// or tls:// URL runs on this host and serves shm:// (its HELLO
    # says so), use that instead (`client.transport` says which); if that fails, stay, with a
    # warning and `client.local_fallback` saying why. An shm:// URL that cannot work still raises.
    prefer_local: bool = False
    # A wait for an answer spins this many seconds before it sleeps (transport/spin.py): a CPU that
    # went idle wakes ~100 us late on a VM, which cost a small get 40% of its round trip here. A
    # blocking call on a lent connection (a plain get or put, run in the caller's thread) polls its
    # socket; a call on an event loop keeps the loop turning. 0: never spin.
    busy_wait: float = 200e-6
    # TLS for tls://, grpcs:// and rdmas://: ``ca`` signs the server's certificate (None: the system
    # store; clients read no environment for it: ps.Worker, ExchangeClient and Subscriber do read
    # $TENSORWIRE_TLS_CA), ``cert``/``key`` are this client's, for servers that ask (mTLS).
    # The one way to say TLS, as ``ServerOptions(tls=)`` and ``Worker(tls=)`` do.
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        files = legacy_tls(self.tls_ca, self.tls_cert, self.tls_key)
        if files is None:
            return
        warnings.warn(DEPRECATED_TLS, DeprecationWarning, stacklevel=3)
        if self.tls is not None and self.tls != files:
            raise ValueError("give tls= or the deprecated tls_ca=/tls_cert=/tls_key=, not both")
        object.__setattr__(self, "tls", files)

    def security(self) -> Security:
        return Security(self.tls, client_token(self.token))

    def delay(self, attempt: int) -> float:
        return backoff(self.backoff, self.max_backoff)(attempt)

    @property
    def worst_case(self) -> float:
        """An upper bound on one call, retries and backoff included."""
        attempts = self.retries + 1
        return attempts * (self.timeout + self.connect_timeout) + attempts * self.max_backoff + 5.0


DEPRECATED_TLS = (
    "tls_ca=, tls_cert= and tls_key= are deprecated: give tls=tensorwire.TlsFiles(ca=..., cert=..., key=...)"
)


def legacy_tls(ca: str | Path | None, cert: str | Path | None, key: str | Path | None) -> TlsFiles | None:
    """The ``TlsFiles`` the deprecated ``tls_ca``/``tls_cert``/``tls_key`` keywords name (None: none)."""
    if not (ca or cert or key):
        return None
    return TlsFiles(*(Path(f) if f else None for f in (cert, key, ca)))


def transport_options(options: ClientOptions) -> TransportOptions:
    """What a transport opened for a client with ``options`` needs (the one place that says it)."""
    return TransportOptions(
        options.connect_timeout,
        options.timeout,
        CHECKSUMS[options.checksum],
        options.chunk_size,
        options.security(),
        options.compression,
        prefer_local=options.prefer_local,
        busy_wait=options.busy_wait,
    )


def retry_policy(options: ClientOptions) -> RetryPolicy:
    """How a client with ``options`` retries a call (``client/retry.py``)."""
    return RetryPolicy(options.retries, backoff(options.backoff, options.max_backoff))


def check(options: ClientOptions) -> ClientOptions:
    """``options`` if a client can use them; ValueError naming the first field it cannot."""
    if options.checksum not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {sorted(CHECKSUMS)}, not {options.checksum!r}")
    lossless.check_mode(options.compression)
    if not 0 <= options.busy_wait <= MAX_SPIN:
        raise ValueError(f"busy_wait must be 0 to {MAX_SPIN} seconds, not {options.busy_wait!r}")
    return options
