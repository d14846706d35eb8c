"""The whole tensorwire exception tree.

Code above a transport never sees ``OSError``, ``asyncio.TimeoutError`` or a library's own
exception: every foreign exception is translated at the boundary (``raise ... from exc``) into one
of these. Each class says whether retrying the same call can help.

::

    TensorwireError
    ├── TransportError                 the network failed; retry can help
    │   ├── ConnectError               could not reach the server
    │   ├── ConnectionLost             the connection broke mid-request
    │   ├── TransferTimeout            (also TimeoutError) a wait ran out
    │   │   └── WaitTimeout            the server waited for other workers and gave up; no retry
    │   ├── NotPrimary                 a parameter-server replica that does not serve now: try another
    │   ├── CoordinatorUnavailable     the coordinator (etcd) did not answer in time, or refused
    │   ├── SharedMemoryUnavailable    shm:// asked for, but client and server share no memory; no retry
    │   └── RdmaUnavailable            rdma:// asked for, but no engine or no RDMA device; no retry
    ├── ProtocolError                  a peer broke the wire protocol
    │   ├── CorruptFrame               a checksum failed / bytes damaged; retry can help
    │   │   └── DigestMismatch         what a read at a generation got differs from its digest
    │   ├── UnsupportedVersion         no common protocol version
    │   └── LimitExceeded              a size or count over the peer's limit
    ├── StoreError                     the server refused the operation
    │   ├── KeyNotFound                (also KeyError) no tensor of that name
    │   ├── CapacityExceeded           the store's byte capacity is full
    │   ├── InvalidName                (also ValueError) a name the store does not accept
    │   ├── PersistenceError           the data directory could not be written or read
    │   ├── VersionChanged             the tensor changed between the parts of one read; retry can help
    │   ├── GenerationRetired          a read at a generation the server no longer keeps; no retry
    │   ├── PublishAborted             a multi-part publish lost a part (a rank died): nothing visible
    │   ├── VerificationFailed         what a server holds differs from its source; resending can help
    │   ├── DatasetConflict            a data set command would overwrite or delete other data; no retry
    │   └── CheckpointConflict         a DCP checkpoint id already taken, or taken by another save; no retry
    ├── InvalidTensor                  (also ValueError) dtype/shape/size unusable or inconsistent
    │   └── LayoutMismatch             layouts disagree or do not tile (sharded state; weights vs model)
    ├── UnsupportedTransport           (also ValueError) this address's transport cannot do what was asked
    ├── AuthenticationError            the server refused the token or client certificate
    │   └── CertificateRefused         (also ConnectError) a TLS handshake failed on certificates; no retry
    ├── NotAuthorized                  (also PermissionError) not this client's to change: another job's
    │                                  (its job token) or an operator's (the operator token); no retry
    ├── WeightUpdateFailed             an engine kept its weights: a generation could not be brought in
    ├── WorkerDropped                  the server does not count this worker in the job: rejoin
    ├── LeaseLost                      a replica's term as a slot's primary is over: step down; no retry
    ├── ServerError                    an unexpected failure inside the server
    │   └── ReplicationRefused         a backup refused the primary's peer credentials: change not made
    │                                  (server side only; a client receives it as ServerError)
    └── ClusterError                   a server or worker a cluster engine (Ray) ran for us failed
        └── ClusterTimeout             (also TimeoutError) it did not start or finish in time

Every error a server reports travels as a numeric code (``ErrorCode``) and is raised on the
client as the same class.
"""

from __future__ import annotations

import enum


class TensorwireError(Exception):
    """Base of every error tensorwire raises."""

    retryable: bool = False


class TransportError(TensorwireError):
    """The network between client and server failed. Retrying (on a new connection) can help."""

    retryable = True


class ConnectError(TransportError):
    """The server could not be reached. Retrying can help once it is up."""


class ConnectionLost(TransportError):
    """The connection broke while a request was in flight; the request may or may not have run."""


class TransferTimeout(TransportError, TimeoutError):
    """A finite wait ran out; the message names what was waited for."""


class WaitTimeout(TransferTimeout):
    """A parameter server waited for other workers (a step, a gate, an allreduce round) until its
    timeout; the message names whom. The server is alive: resending the same request waits again."""

    retryable = False


class NotPrimary(TransportError):
    """This replica of a parameter server does not serve workers now (it is a backup whose primary
    is alive, or a primary a backup took over from): the client moves to another replica."""


class CoordinatorUnavailable(TransportError):
    """The coordinator that decides a parameter-server slot's primary (etcd, ``etcd://``) could not
    be reached, did not answer within its timeout, or answered with something unusable; the message
    names the endpoint and the call. Nothing is known about the outcome of a call that changes
    state (a campaign may have taken the key: its lease is revoked, best-effort). Retrying can help
    once the coordinator is back; a primary whose renewals keep failing must step down when its
    term runs out, whatever this error says."""


class SharedMemoryUnavailable(TransportError):
    """``shm://`` was asked for but cannot be had: the server is on another host (or in another
    shared-memory namespace), it does not serve shared memory, or the segment directory is missing.
    tensorwire never falls back to a socket on its own; retrying the same address will not help."""

    retryable = False


class RdmaUnavailable(TransportError):
    """``rdma://`` was asked for but cannot be had: the transfer engine is not installed
    (``pip install tensorwire[rdma]``), its system library ``libibverbs1`` is missing, or this host
    has no RDMA device and the engine's TCP mode was not asked for (``TENSORWIRE_RDMA_PROTOCOL=tcp``).
    tensorwire never lets the engine fall back to TCP on its own; retrying will not help."""

    retryable = False


class ProtocolError(TensorwireError):
    """A peer sent bytes that break the wire protocol. Retrying the same bytes will not help."""


class CorruptFrame(ProtocolError):
    """A checksum did not match or a frame was malformed in transit. A retry re-sends the data."""

    retryable = True


class DigestMismatch(CorruptFrame):
    """A read at a generation (``get_many(..., verify=True)``) got bytes whose chunk checksums, or
    whose root digest, differ from what the server recorded when the generation was published. The
    message names the tensor and chunk. Raised by clients, never sent by servers; reading again
    can help."""


class UnsupportedVersion(ProtocolError):
    """Client and server share no protocol version."""


class LimitExceeded(ProtocolError):
    """A size or count is over a limit the receiver enforces (frame, metadata, name, dims...)."""


class StoreError(TensorwireError):
    """The store refused the operation; the store itself is unchanged."""


class KeyNotFound(StoreError, KeyError):
    """No tensor is stored under that name."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "key not found"


class CapacityExceeded(StoreError):
    """The store's byte capacity cannot hold the tensor(s); nothing was stored."""


class InvalidName(StoreError, ValueError):
    """The tensor name is empty, too long, has control characters or escapes its namespace."""


class PersistenceError(StoreError):
    """The data directory could not be written or read back."""


class VersionChanged(StoreError):
    """A striped get's ranges were asked of one version and the tensor has moved on. Retrying
    reads the new version whole."""

    retryable = True


class GenerationRetired(StoreError):
    """A read (or lease) at a generation the server no longer keeps: it keeps the last
    ``--keep-generations`` of a prefix and any generation under a lease. The message names the
    prefix, the generation asked for and the oldest one kept. Retrying the same generation will not
    help; read a newer one (``at="latest"``), and lease a generation to keep it longer."""


class VerificationFailed(StoreError):
    """An end-to-end check failed: the bytes a server holds (hashed there, after the transfer) differ
    from the source they were sent from. Raised by clients, never sent by servers; sending again
    can help (``tensorwire dataset scatter`` re-sends what differs when re-run)."""

    retryable = True


class DatasetConflict(StoreError):
    """``tensorwire dataset scatter`` or ``fetch`` would overwrite or delete data that is not its
    own: a data set of the same name scattered from another tree (or with other options), or files
    under ``--out`` with other bytes. Raised by clients, never sent by servers, before anything is
    changed; the message names what is there. Retrying will not help: pass ``--replace``
    (``replace=True``) to overwrite it, or choose another name (``--name``, ``--out``)."""


class CheckpointConflict(StoreError):
    """A ``torch.distributed.checkpoint`` save through ``tensorwire.dcp`` was refused because its
    checkpoint id is taken: a checkpoint is saved under an id once (the id already holds one, or
    another save committed under it first; the reader reads only that first one), and nothing of
    the two is mixed. Or a checkpoint changed between a load's metadata and its reads. Raised on
    the client (never sent by a server); retrying under the same id cannot help."""


class PublishAborted(StoreError):
    """A multi-part publish (GEN_PUBLISH_PART) was given up: a part failed, its connection closed,
    or its names collided with another part's. Nothing of it is visible and every byte it held is
    freed; the message says how many of how many parts had arrived. Putting it again can help."""

    retryable = True


class InvalidTensor(TensorwireError, ValueError):
    """A tensor cannot be sent or received as described: unknown dtype, inconsistent shape/size,
    or an ``out`` tensor that does not match the stored one."""


class LayoutMismatch(InvalidTensor):
    """A sharded state's layouts cannot be used together (``tensorwire.sharded``): ranks disagree
    on a parameter's dtype, global shape or placements, shards overlap, leave gaps or lie outside
    the global shape, or what is read into differs from what was stored. Or a generation of
    weights does not fit the model an engine serves (``tensorwire.vllm``: a name, shape or dtype
    the model's checkpoint lacks, or more bytes than the model has; ``tensorwire.hf.load_into``: a
    name the model does not save, a tensor it saves that the generation lacks, a shape or dtype
    that differs). The message names the (first) parameter and both layouts; raised before any
    byte moves. Retrying cannot help."""


class WeightUpdateFailed(TensorwireError):
    """An inference engine could not bring a generation of weights in (``tensorwire.vllm``): the
    message names the generation and the version the engine keeps serving, which it still holds
    whole (nothing of the failed generation was applied); the cause is ``__cause__``."""

    def __init__(self, message: str, *, generation: int | str, serving: str) -> None:
        super().__init__(message)
        self.generation = generation
        self.serving = serving


class UnsupportedTransport(TensorwireError, ValueError):
    """The transport an address names cannot do what was asked of it (frames of the tensorwire
    protocol on ``grpc://``, ranged transfers on ``shm://``): the message names the scheme and what
    was needed. A configuration error: retrying the same address will not help."""


class AuthenticationError(TensorwireError):
    """The server refused this client: no token, a wrong token, or no acceptable certificate.
    Retrying with the same credentials will not help; the connection was closed."""


class CertificateRefused(AuthenticationError, ConnectError):
    """A TLS handshake failed on credentials: the server's certificate does not verify against the
    CA this side trusts (or names another host), or the server refused this side's certificate
    (or its lack of one). A ``ConnectError`` too (the connection never opened), but retrying with
    the same files will not help."""

    retryable = False


class NotAuthorized(TensorwireError, PermissionError):
    """The server knows this client but will not let it do this: a parameter-server job belongs to
    the workers that hold its job token (``$TENSORWIRE_JOB_TOKEN``), and ending one also to the
    servers' operator (``ps serve --operator-token-file``). The message names the credential that was
    missing or did not match; the connection stays open. Retrying with the same credential will
    not help."""


class WorkerDropped(TensorwireError):
    """The parameter server does not count this worker in its job: it missed its heartbeats, left,
    or the server restarted from a checkpoint. ``ps.Worker`` rejoins and carries on."""


class LeaseLost(TensorwireError):
    """A replica's term as its slot's primary is over: the coordinator no longer holds its lease
    (it expired, was revoked) or the slot's leader key is no longer the one this term created. The
    replica must stop serving as primary at once; campaigning again starts a new term (with a
    larger epoch). Retrying the renewal cannot help."""


class ServerError(TensorwireError):
    """Something unexpected failed inside the server; the server keeps serving."""


class ReplicationRefused(ServerError):
    """A parameter server's backup refused the primary's peer credentials (peer token, TLS
    certificate): a configuration error, so the change was not made rather than acknowledged with
    fewer copies than configured. The message names the backup and why; retrying will not help
    until the replicas of the slot share one ``--peer-token-file`` (and TLS files that verify)."""


class ClusterError(TensorwireError):
    """A server or a worker that ``tensorwire.ray`` ran on a cluster failed, or could not be placed:
    the message names which one (slot and replica, or worker rank) and why; the engine's own
    exception is its ``__cause__``. Never sent by a server."""


class ClusterTimeout(ClusterError, TimeoutError):
    """What ``tensorwire.ray`` waited for (resources, a server's start, the workers) did not come
    within its timeout; the message names it. Retrying can help once the cluster has room."""

    retryable = True


class ErrorCode(enum.IntEnum):
    """Error codes carried in ERROR frames (docs/protocol.md, "Error codes")."""

    SERVER_ERROR = 1
    PROTOCOL_ERROR = 2
    CORRUPT_FRAME = 3
    UNSUPPORTED_VERSION = 4
    LIMIT_EXCEEDED = 5
    KEY_NOT_FOUND = 6
    CAPACITY_EXCEEDED = 7
    INVALID_NAME = 8
    INVALID_TENSOR = 9
    PERSISTENCE_ERROR = 10
    UNAUTHENTICATED = 11
    TIMEOUT = 12
    NOT_MEMBER = 13
    NOT_PRIMARY = 14
    VERSION_CHANGED = 20  # far from 15: other fast-path transports number theirs from 15
    GENERATION_RETIRED = 21
    PUBLISH_ABORTED = 22
    NOT_AUTHORIZED = 23


_CODE_TO_ERROR: dict[ErrorCode, type[TensorwireError]] = {
    ErrorCode.SERVER_ERROR: ServerError,
    ErrorCode.PROTOCOL_ERROR: ProtocolError,
    ErrorCode.CORRUPT_FRAME: CorruptFrame,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
    ErrorCode.LIMIT_EXCEEDED: LimitExceeded,
    ErrorCode.KEY_NOT_FOUND: KeyNotFound,
    ErrorCode.CAPACITY_EXCEEDED: CapacityExceeded,
    ErrorCode.INVALID_NAME: InvalidName,
    ErrorCode.INVALID_TENSOR: InvalidTensor,
    ErrorCode.PERSISTENCE_ERROR: PersistenceError,
    ErrorCode.UNAUTHENTICATED: AuthenticationError,
    ErrorCode.TIMEOUT: WaitTimeout,
    ErrorCode.NOT_MEMBER: WorkerDropped,
    ErrorCode.NOT_PRIMARY: NotPrimary,
    ErrorCode.VERSION_CHANGED: VersionChanged,
    ErrorCode.GENERATION_RETIRED: GenerationRetired,
    ErrorCode.PUBLISH_ABORTED: PublishAborted,
    ErrorCode.NOT_AUTHORIZED: NotAuthorized,
}


def error_for_code(code: int, message: str) -> TensorwireError:
    """The exception a client raises for an ERROR frame with ``code``."""
    try:
        cls = _CODE_TO_ERROR[ErrorCode(code)]
    except ValueError:
        return ServerError(f"unknown error code {code}: {message}")
    return cls(message)


def code_for_error(exc: BaseException) -> ErrorCode:
    """The code a server sends for ``exc``; the most specific class wins."""
    for klass in type(exc).__mro__:
        for code, cls in _CODE_TO_ERROR.items():
            if cls is klass:
                return code
    return ErrorCode.SERVER_ERROR
