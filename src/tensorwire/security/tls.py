"""TLS for both transports: the PEM files one side was configured with (``TlsFiles``), the
``ssl.SSLContext`` objects of the socket transport (TLS 1.2 or newer; mutual TLS when a server is
given a client CA) and the same files as gRPC credentials.

Beyond loopback, TLS gives confidentiality and integrity: nobody on the path reads or alters
tensors; client certificates (mutual TLS) are one of the two ways to authenticate (tokens.py is
the other).

``grpcio`` is imported only by the functions that need it: it takes about 0.1 s to import, which a
socket-only server or a short CLI command should not pay.
"""

from __future__ import annotations

import errno
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

__all__ = [
    "TLS_CA_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TlsFiles",
    "client_ssl_context",
    "client_tls",
    "grpc_channel_credentials",
    "grpc_server_credentials",
    "server_ssl_context",
]

# A client's TLS files when its code names none: the CA of a private cluster (a Kubernetes Secret
# mounted as a file, a Slurm job's certificates), and a client certificate where servers ask for one.
TLS_CA_ENV = "TENSORWIRE_TLS_CA"
TLS_CERT_ENV = "TENSORWIRE_TLS_CERT"
TLS_KEY_ENV = "TENSORWIRE_TLS_KEY"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files one side was configured with; every field is optional.

    ``cert``/``key`` are this side's certificate chain and private key. ``ca`` is the bundle that
    signs the *peer*: on a client, the server's CA (``None``: the system store); on a server, the CA
    of client certificates, and giving it turns on mutual TLS.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        # ``TlsFiles(ca="certs/ca.pem")`` is how people write it: every user of the fields may then
        # rely on a Path (a relay reader reads its certificate with ``read_bytes``).
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))


# --- ssl contexts (socket transport) --------------------------------------------------------------


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """A TLS >= 1.2 server context with ``files.cert``/``files.key``; mTLS when ``files.ca`` is set."""
    cert, key = _require_pair(files, "server")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # A TLS 1.2 client could otherwise ask for a new handshake mid-connection, costing the server a
    # handshake's CPU each time outside any deadline (OpenSSL 3 refuses it already; say so here).
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    _load_chain(ctx, cert, key)
    if files.ca is not None:
        # A client CA means "only clients holding a certificate it signed may connect".
        _load_ca(ctx, files.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """A TLS >= 1.2 client context that verifies the server's certificate and host name.

    The server is checked against ``files.ca``, or the system trust store when it is ``None``.
    ``files.cert``/``files.key`` (both or neither) are presented for mutual TLS.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if files.ca is not None:
        _load_ca(ctx, files.ca)  # only this CA: a private CA must not widen to every public one
    else:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    # PROTOCOL_TLS_CLIENT already defaults to these; set them so the guarantee does not hang on defaults.
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    pair = _optional_pair(files, "client")
    if pair is not None:
        _load_chain(ctx, *pair)
    return ctx


def _require_pair(files: TlsFiles, side: str) -> tuple[Path, Path]:
    missing = [name for name, path in (("cert", files.cert), ("key", files.key)) if path is None]
    if missing:
        raise ValueError(f"a TLS {side} needs a certificate and a private key; missing: {', '.join(missing)}")
    assert files.cert is not None and files.key is not None  # narrowed by the check above
    return files.cert, files.key


def _optional_pair(files: TlsFiles, side: str) -> tuple[Path, Path] | None:
    if files.cert is None and files.key is None:
        return None
    return _require_pair(files, side)


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path) -> None:
    _require_file(cert, "certificate")
    _require_file(key, "private key")
    try:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    except ssl.SSLError as exc:  # unparseable PEM, encrypted key, or a key that is not the cert's
        raise ValueError(f"cannot load TLS certificate {cert} with key {key}: {exc}") from exc


def _load_ca(ctx: ssl.SSLContext, ca: Path) -> None:
    _require_file(ca, "CA bundle")
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(f"cannot load TLS CA bundle {ca}: {exc}") from exc


def _require_file(path: Path, what: str) -> None:
    # ssl's own FileNotFoundError does not say which file; this one does.
    if not Path(path).is_file():
        raise FileNotFoundError(errno.ENOENT, f"TLS {what} file not found", str(path))


# --- gRPC credentials -----------------------------------------------------------------------------


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """``grpc.ssl_server_credentials`` from the PEM files; client certificates required if ``ca``."""
    import grpc  # here, not at the top: see the module docstring

    cert, key = _require_pair(files, "server")
    root = _read_pem(files.ca, "CA bundle")
    return grpc.ssl_server_credentials(
        [(_read_pem(key, "private key"), _read_pem(cert, "certificate"))],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def grpc_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """``grpc.ssl_channel_credentials`` from the PEM files (``ca`` None: gRPC's default roots)."""
    import grpc

    pair = _optional_pair(files, "client")
    cert, key = pair if pair is not None else (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(files.ca, "CA bundle"),
        private_key=_read_pem(key, "private key"),
        certificate_chain=_read_pem(cert, "certificate"),
    )


def _read_pem(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    _require_file(path, what)
    return Path(path).read_bytes()


def client_tls(tls: TlsFiles | None) -> TlsFiles | None:
    """``tls`` if given, else the files named by ``$TENSORWIRE_TLS_CA`` / ``_CERT`` / ``_KEY`` (each
    optional; none set: ``None``, the system's CA store)."""
    if tls is not None:
        return tls
    paths = [os.environ.get(name) or None for name in (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)]
    if not any(paths):
        return None
    cert, key, ca = (Path(p) if p else None for p in paths)
    return TlsFiles(cert=cert, key=key, ca=ca)
