"""TLS contexts, gRPC credentials, shared tokens and development certificates for tensorwire.

Threat model, in three lines:

* Beyond loopback, TLS gives confidentiality and integrity: nobody on the path reads or alters tensors.
* Authentication is a shared token (compared in constant time) or mutual TLS (client certificates).
* ``write_dev_certs`` makes a throwaway CA for development and tests only, never for production.

The pieces:

* ``TlsFiles``: the PEM paths a server or client was configured with.
* ``server_ssl_context`` / ``client_ssl_context``: ``ssl.SSLContext`` objects for the socket transport
  (TLS 1.2 or newer; mTLS when the server is given a client CA).
* ``grpc_server_credentials`` / ``grpc_channel_credentials``: the same files as gRPC credentials.
* ``load_token`` / ``client_token`` / ``tokens_match``: a shared secret read from a file or from
  ``$TENSORWIRE_TOKEN``, and its constant-time check.
* ``write_dev_certs``: a self-signed CA plus server and client certificates (EC P-256).
* ``is_loopback`` / ``exposure_warning``: tell when a server is reachable from other machines with
  neither TLS nor a token.

``grpcio`` and ``cryptography`` are imported only by the functions that need them: together they
take about 0.2 s to import, which a socket-only server or a short CLI command should not pay.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tensorwire._fs import create_file, write_file
from tensorwire.wire.meta import MAX_TOKEN_BYTES

if TYPE_CHECKING:
    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

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

log = logging.getLogger("tensorwire.security")

TOKEN_ENV = "TENSORWIRE_TOKEN"
# A client's TLS files when its code names none: the CA of a private cluster (a Kubernetes Secret
# mounted as a file, a Slurm job's certificates), and a client certificate where servers ask for one.
TLS_CA_ENV = "TENSORWIRE_TLS_CA"
TLS_CERT_ENV = "TENSORWIRE_TLS_CERT"
TLS_KEY_ENV = "TENSORWIRE_TLS_KEY"


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


# A token file is read with this bound so that pointing --token-file at a large file (a log, a
# device) fails fast instead of reading it all; the token itself must still fit MAX_TOKEN_BYTES.
_MAX_TOKEN_FILE_BYTES = 64 * 1024


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


# --- shared tokens --------------------------------------------------------------------------------


def load_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace stripped.

    Refuses (``ValueError``) an empty token, one over ``MAX_TOKEN_BYTES``, or one with characters
    outside printable ASCII. Logs a warning when the file is readable by group or others.
    """
    with open(path, "rb") as f:
        _warn_if_shared(path, os.fstat(f.fileno()).st_mode)
        raw = f.read(_MAX_TOKEN_FILE_BYTES + 1)
    if len(raw) > _MAX_TOKEN_FILE_BYTES:
        raise ValueError(
            f"token file {path} is larger than {_MAX_TOKEN_FILE_BYTES} bytes; is it a token file?"
        )
    token = raw.strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"token in {path} is {len(token)} bytes; at most {MAX_TOKEN_BYTES} are allowed")
    # Printable ASCII only: the token travels in headers/metadata and is compared byte for byte, so
    # an invisible or non-ASCII character would make two "equal-looking" tokens differ.
    if not all(0x20 <= b <= 0x7E for b in token):
        raise ValueError(f"token in {path} has characters outside printable ASCII")
    return token.decode("ascii")


def _warn_if_shared(path: Path, mode: int) -> None:
    if os.name == "nt":  # POSIX mode bits say nothing about Windows ACLs
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "token file %s is readable by group or others (mode %o); chmod 600 it", path, mode & 0o777
        )


def write_token_file(path: Path, token: str | None = None) -> Path:
    """``token`` (default: a fresh random one, 256 bits, printable) in a new file ``path``, mode
    0600 from the start; never an existing file or a symlink (FileExistsError). For scripts and
    tests that start servers: ``serve --token-file``, ``--peer-token-file``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        f.write(secrets.token_urlsafe(32) if token is None else token)
    return Path(path)


def client_token(token: str | None) -> str | None:
    """``token`` if given, else ``$TENSORWIRE_TOKEN`` when set and non-empty, else ``None``."""
    if token:
        return token
    return os.environ.get(TOKEN_ENV) or None


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


def client_security(tls: TlsFiles | None, token: str | None) -> Security:
    """What a client brings when its caller names nothing: TLS files and token from the environment."""
    return Security(client_tls(tls), client_token(token))


def tokens_match(expected: str, offered: str | None) -> bool:
    """Whether ``offered`` equals ``expected``, in time independent of where they differ.

    ``None`` never matches, and neither does anything when ``expected`` is empty: an unset secret
    must fail closed rather than admit a client that sends an empty token.
    """
    if offered is None or not expected:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), offered.encode("utf-8"))


# --- development certificates ---------------------------------------------------------------------

_DEV_FILES = {
    "ca": "ca.pem",
    "ca_key": "ca-key.pem",
    "server": "server.pem",
    "server_key": "server-key.pem",
    "client": "client.pem",
    "client_key": "client-key.pem",
}


DEV_CERT_HOSTS = ("localhost", "127.0.0.1", "::1")  # `tensorwire certs` always names these
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_cert_host(host: str) -> str:
    """``host`` if a certificate can name it: an IP address, or a DNS name (letters, digits and
    hyphens in dot-separated labels, optionally ``*.`` first); ValueError otherwise."""
    text = host.strip().strip("[]")
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text))
    labels = text.removeprefix("*.").removesuffix(".").split(".")
    if not text or len(text) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{host!r} is neither an IP address nor a DNS name")
    return text


def write_dev_certs(
    directory: Path,
    hosts: Sequence[str] = DEV_CERT_HOSTS,
    days: int = 365,
    *,
    overwrite: bool = False,
) -> dict[str, Path]:
    """Write a development CA and a server and client certificate it signed into ``directory``.

    For development and tests only: the CA key sits next to the certificates, unencrypted. The
    server certificate names every host in ``hosts`` (DNS names or IP addresses) and serves as a
    client certificate too (a relay reader's certificate is both: broadcast/peer.py; for readers
    on other hosts, ``write_reader_certs`` makes one per host). Keys are EC P-256,
    written with mode 0o600. Raises ``FileExistsError`` if any of the six files exists, unless
    ``overwrite``. Returns the paths under the keys ca, ca_key, server, server_key, client, client_key.
    """
    if isinstance(hosts, str):  # a bare string is a Sequence[str] of characters: surely a mistake
        raise ValueError("hosts must be a sequence of host names, not a single string")
    if not hosts:
        raise ValueError("hosts must name at least one host")
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days}")
    directory = Path(directory)
    paths = {name: directory / filename for name, filename in _DEV_FILES.items()}
    if not overwrite:
        # Check all six before writing any, so a refusal leaves no half-written set behind.
        existing = [str(p) for p in paths.values() if os.path.lexists(p)]  # a dangling link counts
        if existing:
            raise FileExistsError(
                f"refusing to overwrite {', '.join(existing)} (certs --overwrite; overwrite=True)"
            )
    directory.mkdir(parents=True, exist_ok=True)
    pems = _dev_cert_pems([check_cert_host(h) for h in hosts], days)
    for name, path in paths.items():
        _write_pem(path, pems[name], private=name.endswith("_key"), overwrite=overwrite)
    return paths


def _dev_cert_pems(hosts: list[str], days: int) -> dict[str, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

    now = datetime.datetime.now(datetime.UTC)
    # Backdate a little so a peer whose clock runs slightly behind still accepts the certificates.
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _build_ca(ca_key, _name("tensorwire development CA"), validity)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _build_leaf(
        ca_cert, ca_key, server_key, name=_name("tensorwire development server"), validity=validity,
        usages=_both_ways(), san=_san(hosts),
    )  # fmt: skip
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _build_leaf(
        ca_cert, ca_key, client_key, name=_name("tensorwire development client"), validity=validity,
        usages=[x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH], san=None,
    )  # fmt: skip
    return {
        "ca": _cert_pem(ca_cert),
        "ca_key": _key_pem(ca_key),
        "server": _cert_pem(server_cert),
        "server_key": _key_pem(server_key),
        "client": _cert_pem(client_cert),
        "client_key": _key_pem(client_key),
    }


def write_reader_certs(
    directory: Path, hosts: Sequence[str], days: int = 365, *, overwrite: bool = False
) -> dict[str, Path]:
    """Write one relay reader certificate per host in ``hosts`` into ``directory``, signed by the
    development CA there (``write_dev_certs`` made it: ca.pem, ca-key.pem): ``reader-HOST.pem`` and
    ``reader-HOST-key.pem``, naming HOST (the address its relay server is reached at) and valid for
    both a server and a client, as a relay over TLS needs (broadcast/peer.py). Development only, as
    ``write_dev_certs``. ``FileExistsError`` if one exists, unless ``overwrite``; FileNotFoundError
    without the CA. Returns the paths under the keys reader:HOST and reader_key:HOST."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    directory = Path(directory)
    names = [check_cert_host(h) for h in hosts]
    paths: dict[str, Path] = {}
    for host in names:
        stem = "reader-" + host.replace(":", "-").replace("*", "_")
        paths[f"reader:{host}"] = directory / f"{stem}.pem"
        paths[f"reader_key:{host}"] = directory / f"{stem}-key.pem"
    existing = [str(p) for p in paths.values() if os.path.lexists(p)]
    if existing and not overwrite:
        raise FileExistsError(
            f"refusing to overwrite {', '.join(existing)} (certs --overwrite; overwrite=True)"
        )
    ca_cert = x509.load_pem_x509_certificate((directory / _DEV_FILES["ca"]).read_bytes())
    ca_key = serialization.load_pem_private_key((directory / _DEV_FILES["ca_key"]).read_bytes(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / _DEV_FILES['ca_key']} is not the EC key `tensorwire certs` writes")
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    for host in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _build_leaf(
            ca_cert, ca_key, key, name=_name(f"tensorwire relay reader {host}"), validity=validity,
            usages=_both_ways(), san=_san([host]),
        )  # fmt: skip
        _write_pem(paths[f"reader:{host}"], _cert_pem(cert), private=False, overwrite=overwrite)
        _write_pem(paths[f"reader_key:{host}"], _key_pem(key), private=True, overwrite=overwrite)
    return paths


def _both_ways() -> list[x509.ObjectIdentifier]:
    """serverAuth and clientAuth: a relay reader's certificate serves its relay server and is its
    client certificate towards its peers and the origin (broadcast/peer.py)."""
    from cryptography import x509

    return [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]


def _name(common_name: str) -> x509.Name:
    from cryptography import x509

    return x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def _build_ca(
    key: ec.EllipticCurvePrivateKey,
    name: x509.Name,
    validity: tuple[datetime.datetime, datetime.datetime],
) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    # Extensions as RFC 5280 (and Python 3.13's VERIFY_X509_STRICT) expect of a CA: critical basic
    # constraints, key usage limited to signing, and a subject key identifier.
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return builder.sign(key, hashes.SHA256())


def _build_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    *,
    name: x509.Name,
    validity: tuple[datetime.datetime, datetime.datetime],
    usages: Sequence[x509.ObjectIdentifier],
    san: x509.SubjectAlternativeName | None,
) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    from cryptography import x509

    # A CA only signs certificates (and CRLs); an EC leaf signs the TLS handshake (digital_signature).
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_pem(path: Path, data: bytes, *, private: bool, overwrite: bool) -> None:
    # Never through a link planted in the directory: a new file is created O_EXCL | O_NOFOLLOW
    # (closing the race between the existence check and the write), an overwrite goes to a fresh
    # temporary file renamed over the old one. A key file is 0o600 from its first byte.
    mode = 0o600 if private else 0o644
    (write_file if overwrite else create_file)(path, lambda f: f.write(data), mode)


# --- exposure -------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    ``localhost`` and loopback addresses (127.0.0.0/8, ::1, also IPv4-mapped) are; the wildcard
    addresses (``0.0.0.0``, ``::``, ``""``) and any other name or address are not.
    """
    name = host.strip().lower().strip("[]")
    if name in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False  # another host name: it may resolve to anything
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def exposure_warning(host: str, tls: bool, token: bool) -> str | None:
    """A one-line warning when a server on ``host`` is reachable beyond loopback with neither TLS
    nor a token, else ``None``."""
    if tls or token or is_loopback(host):
        return None
    where = repr(host) if host else "all interfaces"
    return (
        f"tensorwire server listening on {where} beyond loopback with neither TLS nor a token: "
        "anyone who can reach the port can read, overwrite and delete tensors, and traffic is "
        "unencrypted; configure TLS and a token, or listen on 127.0.0.1"
    )
