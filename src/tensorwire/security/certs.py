"""Development certificates, for ``tensorwire certs`` and tests only, never for production: a
self-signed CA plus server and client certificates (EC P-256), and relay reader certificates signed
by that CA.

``cryptography`` is imported only by the functions that use it: it takes about 0.1 s to import,
which a server or a short CLI command should not pay.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tensorwire._fs import create_file, write_file

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = ["DEV_CERT_HOSTS", "check_cert_host", "write_dev_certs", "write_reader_certs"]

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
