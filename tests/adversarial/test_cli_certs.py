"""``tensorwire certs --host``: certificates for the names other hosts use (the README's multi-host
TLS example), localhost always included; and certificate files are never written through a link
planted in the directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import tensorwire
from tensorwire import cli, errors
from tensorwire.security import TlsFiles
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions

OTHER_HOST = "127.0.0.2"  # a loopback address that is not 127.0.0.1: "another host's" address here


def _certs(directory: Path, *hosts: str) -> None:
    args = ["certs", str(directory)] + [a for h in hosts for a in ("--host", h)]
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output


def _serve(directory: Path) -> ServerThread:
    files = TlsFiles(directory / "server.pem", directory / "server-key.pem")
    return ServerThread([f"tls://{OTHER_HOST}:0"], ServerOptions(tls=files))


def test_a_certificate_for_another_address_is_accepted_there(tmp_path: Path) -> None:
    _certs(tmp_path, OTHER_HOST, "trainer-0")
    with _serve(tmp_path) as srv:
        assert srv.url.startswith(f"tls://{OTHER_HOST}:")
        with tensorwire.connect(srv.url, tls=TlsFiles(ca=tmp_path / "ca.pem"), retries=0) as c:
            c.ping()


def test_without_host_the_other_address_is_a_mismatch(tmp_path: Path) -> None:
    _certs(tmp_path)
    with _serve(tmp_path) as srv, pytest.raises(errors.TransportError, match=r"mismatch|match"):
        tensorwire.connect(srv.url, tls=TlsFiles(ca=tmp_path / "ca.pem"), retries=0, connect_timeout=5)


def test_localhost_is_always_in_the_certificate(tmp_path: Path) -> None:
    _certs(tmp_path, OTHER_HOST)
    files = TlsFiles(tmp_path / "server.pem", tmp_path / "server-key.pem")
    with (
        ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=files)) as srv,
        tensorwire.connect(srv.url, tls=TlsFiles(ca=tmp_path / "ca.pem"), retries=0) as c,
    ):
        c.ping()


@pytest.mark.parametrize("host", ["", "a b", "-x.example", "x" * 64 + ".example", "é.example"])
def test_a_bad_host_is_a_usage_error(tmp_path: Path, host: str) -> None:
    result = CliRunner().invoke(cli.main, ["certs", str(tmp_path), "--host", host])
    assert result.exit_code == 2 and "--host" in result.output and "Traceback" not in result.output


def test_overwrite_never_writes_a_key_through_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    certs = tmp_path / "certs"
    _certs(certs)
    (certs / "server-key.pem").unlink()
    os.symlink(victim, certs / "server-key.pem")
    result = CliRunner().invoke(cli.main, ["certs", str(certs), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me"
    key = certs / "server-key.pem"
    assert not key.is_symlink() and key.stat().st_mode & 0o777 == 0o600


def test_without_overwrite_a_planted_link_is_refused(tmp_path: Path) -> None:
    os.symlink(tmp_path / "nowhere", tmp_path / "ca.pem")  # dangling: exists() says no
    result = CliRunner().invoke(cli.main, ["certs", str(tmp_path)])
    assert result.exit_code == 1 and result.output.startswith("error: ")
    assert not (tmp_path / "nowhere").exists()


def _usages(path: Path) -> set[str]:
    from cryptography import x509

    known = {
        x509.ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
        x509.ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    }
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return {
        known.get(oid, oid.dotted_string)
        for oid in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    }


def test_the_server_certificate_also_serves_as_a_relay_readers(tmp_path: Path) -> None:
    # A relay reader's certificate is its relay server's and its client certificate towards its
    # peers, which ask for one: the README's single-host setup hands readers server.pem.
    _certs(tmp_path)
    assert _usages(tmp_path / "server.pem") == {"serverAuth", "clientAuth"}
    assert _usages(tmp_path / "client.pem") == {"clientAuth"}


def test_reader_certificates_are_signed_by_the_ca_already_there(tmp_path: Path) -> None:
    from cryptography import x509

    _certs(tmp_path)
    ca = (tmp_path / "ca.pem").read_bytes()
    result = CliRunner().invoke(
        cli.main, ["certs", str(tmp_path), "--reader", OTHER_HOST, "--reader", "fd00::7"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ca.pem").read_bytes() == ca  # not a new CA: the origin and the others trust it
    for stem, host in ((f"reader-{OTHER_HOST}", OTHER_HOST), ("reader-fd00--7", "fd00::7")):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{stem}.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == [host]
        assert _usages(tmp_path / f"{stem}.pem") == {"serverAuth", "clientAuth"}
        assert (tmp_path / f"{stem}-key.pem").stat().st_mode & 0o777 == 0o600
    again = CliRunner().invoke(cli.main, ["certs", str(tmp_path), "--reader", OTHER_HOST])
    assert again.exit_code == 1 and "--overwrite" in again.output  # never replaced unasked
    # Its relay server serves with it; a peer checking against the CA accepts it (as a server here).
    reader = TlsFiles(tmp_path / f"reader-{OTHER_HOST}.pem", tmp_path / f"reader-{OTHER_HOST}-key.pem")
    with (
        ServerThread([f"tls://{OTHER_HOST}:0"], ServerOptions(tls=reader)) as srv,
        tensorwire.connect(srv.url, tls=TlsFiles(ca=tmp_path / "ca.pem"), retries=0) as c,
    ):
        c.ping()


def test_reader_certificates_in_an_empty_directory_come_with_a_ca(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.main, ["certs", str(tmp_path / "new"), "--reader", OTHER_HOST])
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "new").iterdir()} >= {
        "ca.pem",
        "server.pem",
        f"reader-{OTHER_HOST}.pem",
    }
