"""TLS contexts, gRPC credentials, shared tokens, development certificates and exposure checks.

Threat model, in three lines:

* Beyond loopback, TLS gives confidentiality and integrity: nobody on the path reads or alters tensors.
* Authentication is a shared token (compared in constant time) or mutual TLS (client certificates).
* ``write_dev_certs`` makes a throwaway CA for development and tests only, never for production.

The pieces, one module each (every public name is also importable from ``tensorwire.security``):

* ``tls``: ``TlsFiles``, the PEM paths a server or client was configured with;
  ``server_ssl_context`` / ``client_ssl_context``, ``ssl.SSLContext`` objects for the socket
  transport (TLS 1.2 or newer; mTLS when the server is given a client CA);
  ``grpc_server_credentials`` / ``grpc_channel_credentials``, the same files as gRPC credentials;
  ``client_tls``, a client's files from ``$TENSORWIRE_TLS_CA`` / ``_CERT`` / ``_KEY``.
* ``tokens``: ``load_token`` / ``client_token`` / ``tokens_match``, a shared secret read from a
  file or from ``$TENSORWIRE_TOKEN``, and its constant-time check.
* ``certs``: ``write_dev_certs``, a self-signed CA plus server and client certificates (EC P-256),
  used by ``tensorwire certs`` and tests only.
* ``exposure``: ``is_loopback`` / ``exposure_warning``, tell when a server is reachable from other
  machines with neither TLS nor a token.
* here: ``Security``, what one side brings (TLS files and a token), and ``client_security``.

``grpcio`` and ``cryptography`` are imported only by the functions that need them: together they
take about 0.2 s to import, which a socket-only server or a short CLI command should not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorwire.security.certs import DEV_CERT_HOSTS, check_cert_host, write_dev_certs, write_reader_certs
from tensorwire.security.exposure import exposure_warning, is_loopback
from tensorwire.security.tls import (
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TlsFiles,
    client_ssl_context,
    client_tls,
    grpc_channel_credentials,
    grpc_server_credentials,
    server_ssl_context,
)
from tensorwire.security.tokens import (
    MAX_TOKEN_BYTES,
    TOKEN_ENV,
    client_token,
    load_token,
    tokens_match,
    write_token_file,
)

__all__ = [
    "TOKEN_ENV",
    "MAX_TOKEN_BYTES",
    "Security",
    "TlsFiles",
    "server_ssl_context",
    "client_ssl_context",
    "grpc_server_credentials",
    "grpc_channel_credentials",
    "load_token",
    "write_token_file",
    "client_token",
    "client_tls",
    "client_security",
    "TLS_CA_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "tokens_match",
    "write_dev_certs",
    "write_reader_certs",
    "DEV_CERT_HOSTS",
    "check_cert_host",
    "is_loopback",
    "exposure_warning",
]


@dataclass(frozen=True)
class Security:
    """What one side of a connection brings: TLS files (used by ``tls://`` and ``grpcs://``) and
    a shared token (sent by a client in its HELLO or gRPC metadata; required by a server that has
    one). The default is neither."""

    tls: TlsFiles | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and not self.token:
            raise ValueError("an empty token would let nobody in (or, read carelessly, everyone): use None")


def client_security(tls: TlsFiles | None, token: str | None) -> Security:
    """What a client brings when its caller names nothing: TLS files and token from the environment."""
    return Security(client_tls(tls), client_token(token))
