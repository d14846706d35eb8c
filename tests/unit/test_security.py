"""security: dev certificates, real TLS/mTLS handshakes on loopback, gRPC credentials, tokens, exposure."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509

from tensorwire.security import (
    MAX_TOKEN_BYTES,
    TOKEN_ENV,
    TlsFiles,
    client_ssl_context,
    client_token,
    exposure_warning,
    grpc_channel_credentials,
    grpc_server_credentials,
    is_loopback,
    load_token,
    server_ssl_context,
    tokens_match,
    write_dev_certs,
)

TIMEOUT = 10.0  # seconds; every socket wait and thread join is bounded by this
KEYS = ("ca", "ca_key", "server", "server_key", "client", "client_key")
POSIX = os.name == "posix"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certs(tmp_path_factory.mktemp("other-certs"))


# --- a one-connection TLS echo server on loopback -------------------------------------------------


class EchoServer:
    """Accepts one connection, does the TLS handshake, echoes one message, and records any error."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(TIMEOUT)
        self.port: int = self.listener.getsockname()[1]
        self.error: BaseException | None = None
        self.peer_cert: dict[str, Any] | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tls-echo", daemon=True)

    def _run(self) -> None:
        try:
            conn, _ = self.listener.accept()
            conn.settimeout(TIMEOUT)
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                self.peer_cert = tls.getpeercert()
                data = tls.recv(1024)
                tls.sendall(data)
        except BaseException as exc:  # recorded for the test to assert on
            self.error = exc
        finally:
            self.done.set()


@contextlib.contextmanager
def echo_server(ctx: ssl.SSLContext) -> Iterator[EchoServer]:
    server = EchoServer(ctx)
    server.thread.start()
    try:
        yield server
    finally:
        server.thread.join(TIMEOUT)
        server.listener.close()
        assert not server.thread.is_alive(), "echo server thread did not finish"


def tls_echo(ctx: ssl.SSLContext, port: int, hostname: str, message: bytes = b"ping") -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
        ctx.wrap_socket(raw, server_hostname=hostname) as tls,
    ):
        tls.sendall(message)
        return tls.recv(1024)


def server_files(certs: dict[str, Path], *, mtls: bool = False) -> TlsFiles:
    return TlsFiles(cert=certs["server"], key=certs["server_key"], ca=certs["ca"] if mtls else None)


# --- write_dev_certs ------------------------------------------------------------------------------


def test_dev_certs_written(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path / "new" / "dir")
    assert set(paths) == set(KEYS)
    for name, path in paths.items():
        assert path.is_file() and path.parent == tmp_path / "new" / "dir"
        assert path.read_bytes().startswith(b"-----BEGIN ")
        if POSIX and name.endswith("_key"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    assert b"ENCRYPTED" not in paths["server_key"].read_bytes()


def test_dev_cert_contents(certs: dict[str, Path]) -> None:
    ca = x509.load_pem_x509_certificate(certs["ca"].read_bytes())
    server = x509.load_pem_x509_certificate(certs["server"].read_bytes())
    client = x509.load_pem_x509_certificate(certs["client"].read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert server.issuer == ca.subject and client.issuer == ca.subject
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    server_eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    client_eku = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # Both ways: on the origin's host a relay reader serves its peers with it and is their client.
    assert list(server_eku) == [
        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
        x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH,
    ]
    assert list(client_eku) == [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]


def test_dev_certs_custom_hosts(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path, hosts=["node-1.cluster", "10.0.0.7"], days=2)
    server = x509.load_pem_x509_certificate(paths["server"].read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["node-1.cluster"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert 2 <= lifetime.days <= 3


def test_dev_certs_refuse_overwrite(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path)
    before = {name: path.read_bytes() for name, path in paths.items()}
    with pytest.raises(FileExistsError):
        write_dev_certs(tmp_path)
    assert {name: path.read_bytes() for name, path in paths.items()} == before

    # Any one existing file is enough to refuse, and nothing else gets written.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "client.pem").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match=r"client\.pem"):
        write_dev_certs(lone)
    assert sorted(p.name for p in lone.iterdir()) == ["client.pem"]


def test_dev_certs_overwrite(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path)
    old_ca = paths["ca"].read_bytes()
    paths["server_key"].chmod(0o644)
    again = write_dev_certs(tmp_path, overwrite=True)
    assert again == paths
    assert paths["ca"].read_bytes() != old_ca
    if POSIX:  # an overwritten key file is narrowed back to owner-only
        assert stat.S_IMODE(paths["server_key"].stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"hosts": "localhost"}, "single string"), ({"hosts": []}, "at least one"), ({"days": 0}, "days")],
)
def test_dev_certs_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_dev_certs(tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())


# --- TLS round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("hostname", ["localhost", "127.0.0.1"])
def test_tls_round_trip(certs: dict[str, Path], hostname: str) -> None:
    client_ctx = client_ssl_context(TlsFiles(ca=certs["ca"]))
    with echo_server(server_ssl_context(server_files(certs))) as server:
        assert tls_echo(client_ctx, server.port, hostname, b"tensor bytes") == b"tensor bytes"
    assert server.error is None


def test_server_contexts_refuse_renegotiation(certs: dict[str, Path]) -> None:
    """A TLS 1.2 client may not ask for a new handshake mid-connection: each would cost the server a
    handshake's CPU outside every deadline (the server says so itself, not only OpenSSL 3's default)."""
    assert server_ssl_context(server_files(certs)).options & ssl.OP_NO_RENEGOTIATION


def test_tls_wrong_hostname_refused(certs: dict[str, Path]) -> None:
    client_ctx = client_ssl_context(TlsFiles(ca=certs["ca"]))
    with (
        echo_server(server_ssl_context(server_files(certs))) as server,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        tls_echo(client_ctx, server.port, "not-the-server.example")
    assert isinstance(server.error, ssl.SSLError)


def test_tls_wrong_ca_refused(certs: dict[str, Path], other_certs: dict[str, Path]) -> None:
    client_ctx = client_ssl_context(TlsFiles(ca=other_certs["ca"]))
    with (
        echo_server(server_ssl_context(server_files(certs))) as server,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        tls_echo(client_ctx, server.port, "localhost")
    assert isinstance(server.error, ssl.SSLError)


def test_mtls_without_client_cert_refused(certs: dict[str, Path]) -> None:
    client_ctx = client_ssl_context(TlsFiles(ca=certs["ca"]))
    client_error: OSError | None = None
    reply = None
    with echo_server(server_ssl_context(server_files(certs, mtls=True))) as server:
        try:
            # Under TLS 1.3 the client's handshake completes before the server checks the client's
            # certificate, so the refusal may only surface on the first read (or as a reset/EOF).
            reply = tls_echo(client_ctx, server.port, "localhost")
        except OSError as exc:
            client_error = exc
        assert server.done.wait(TIMEOUT)
    assert isinstance(server.error, ssl.SSLError)
    assert "CERTIFICATE" in str(server.error).upper()
    # The client never gets the echo: it sees an SSL error (alert or EOF), a reset, or a clean EOF.
    assert client_error is not None or reply == b""


def test_mtls_with_client_cert(certs: dict[str, Path]) -> None:
    client_ctx = client_ssl_context(TlsFiles(cert=certs["client"], key=certs["client_key"], ca=certs["ca"]))
    with echo_server(server_ssl_context(server_files(certs, mtls=True))) as server:
        assert tls_echo(client_ctx, server.port, "localhost") == b"ping"
    assert server.error is None
    assert server.peer_cert is not None
    subject = dict(pair[0] for pair in server.peer_cert["subject"])
    assert subject["commonName"] == "tensorwire development client"


def test_mtls_client_cert_from_other_ca_refused(certs: dict[str, Path], other_certs: dict[str, Path]) -> None:
    client_ctx = client_ssl_context(
        TlsFiles(cert=other_certs["client"], key=other_certs["client_key"], ca=certs["ca"])
    )
    with echo_server(server_ssl_context(server_files(certs, mtls=True))) as server:
        with contextlib.suppress(OSError):
            assert tls_echo(client_ctx, server.port, "localhost") == b""
        assert server.done.wait(TIMEOUT)
    assert isinstance(server.error, ssl.SSLCertVerificationError)


# --- context configuration ------------------------------------------------------------------------


def test_context_settings(certs: dict[str, Path]) -> None:
    server = server_ssl_context(server_files(certs))
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert server.verify_mode == ssl.CERT_NONE
    assert server_ssl_context(server_files(certs, mtls=True)).verify_mode == ssl.CERT_REQUIRED
    for files in (TlsFiles(), TlsFiles(ca=certs["ca"])):  # system store and private CA
        client = client_ssl_context(files)
        assert client.check_hostname
        assert client.verify_mode == ssl.CERT_REQUIRED
        assert client.minimum_version >= ssl.TLSVersion.TLSv1_2


@pytest.mark.parametrize(
    ("files", "missing"),
    [(TlsFiles(), "cert, key"), (TlsFiles(cert=Path("c.pem")), "key"), (TlsFiles(key=Path("k.pem")), "cert")],
)
def test_server_context_needs_cert_and_key(files: TlsFiles, missing: str) -> None:
    with pytest.raises(ValueError, match=f"missing: {missing}$"):
        server_ssl_context(files)


def test_client_context_needs_both_or_neither(certs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="missing: key"):
        client_ssl_context(TlsFiles(cert=certs["client"], ca=certs["ca"]))


def test_context_file_errors(certs: dict[str, Path], tmp_path: Path) -> None:
    absent = tmp_path / "absent.pem"
    with pytest.raises(FileNotFoundError, match=r"absent\.pem"):
        server_ssl_context(TlsFiles(cert=absent, key=certs["server_key"]))
    with pytest.raises(FileNotFoundError, match=r"absent\.pem"):
        client_ssl_context(TlsFiles(ca=absent))
    with pytest.raises(ValueError, match="cannot load TLS certificate"):  # key of another certificate
        server_ssl_context(TlsFiles(cert=certs["server"], key=certs["client_key"]))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="cannot load TLS CA bundle"):
        client_ssl_context(TlsFiles(ca=garbage))


# --- gRPC credentials -----------------------------------------------------------------------------


def test_grpc_credentials_built(certs: dict[str, Path]) -> None:
    assert isinstance(grpc_server_credentials(server_files(certs)), grpc.ServerCredentials)
    assert isinstance(grpc_server_credentials(server_files(certs, mtls=True)), grpc.ServerCredentials)
    for files in (
        TlsFiles(),
        TlsFiles(ca=certs["ca"]),
        TlsFiles(cert=certs["client"], key=certs["client_key"], ca=certs["ca"]),
    ):
        assert isinstance(grpc_channel_credentials(files), grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="missing: key"):
        grpc_server_credentials(TlsFiles(cert=certs["server"]))
    with pytest.raises(ValueError, match="missing: cert"):
        grpc_channel_credentials(TlsFiles(key=certs["client_key"]))


def test_grpc_mtls_round_trip(certs: dict[str, Path]) -> None:
    """The credentials actually work: a unary echo over gRPC with mutual TLS on loopback."""
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    executor = ThreadPoolExecutor(max_workers=1)
    server = grpc.server(executor, handlers=[grpc.method_handlers_generic_handler("t.Echo", {"Echo": echo})])
    port = server.add_secure_port("localhost:0", grpc_server_credentials(server_files(certs, mtls=True)))
    server.start()
    try:
        files = TlsFiles(cert=certs["client"], key=certs["client_key"], ca=certs["ca"])
        with grpc.secure_channel(f"localhost:{port}", grpc_channel_credentials(files)) as channel:
            assert channel.unary_unary("/t.Echo/Echo")(b"hello", timeout=TIMEOUT) == b"hello"
        no_cert = TlsFiles(ca=certs["ca"])
        with grpc.secure_channel(f"localhost:{port}", grpc_channel_credentials(no_cert)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/t.Echo/Echo")(b"hello", timeout=TIMEOUT)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert server.stop(grace=None).wait(TIMEOUT)
        executor.shutdown(wait=True)


# --- tokens ---------------------------------------------------------------------------------------


def write_token(tmp_path: Path, data: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_load_token_strips(tmp_path: Path) -> None:
    assert load_token(write_token(tmp_path, b"  s3cret-token_42 \n\n")) == "s3cret-token_42"
    assert load_token(write_token(tmp_path, b"x" * MAX_TOKEN_BYTES + b"\n")) == "x" * MAX_TOKEN_BYTES


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (b" \n\t\r\n", "empty"),
        (b"x" * (MAX_TOKEN_BYTES + 1), "at most 4096"),
        (b"x" * (1 << 20), "larger than"),
        (b"tok\x00en", "printable ASCII"),
        (b"tok\ten", "printable ASCII"),
        ("tök".encode(), "printable ASCII"),
        (b"\xff\xfe", "printable ASCII"),
    ],
)
def test_load_token_refuses(tmp_path: Path, data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_token(write_token(tmp_path, data))


@pytest.mark.skipif(not POSIX, reason="POSIX permission bits")
def test_load_token_warns_when_shared(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tensorwire.security"):
        load_token(write_token(tmp_path, b"tok", 0o600))
        assert not caplog.records
        load_token(write_token(tmp_path, b"tok", 0o640))
    assert len(caplog.records) == 1
    assert "readable by group or others" in caplog.records[0].getMessage()


def test_load_token_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_token(tmp_path / "nope")


def test_tokens_match() -> None:
    assert tokens_match("abc", "abc")
    assert not tokens_match("abc", "abd")
    assert not tokens_match("abc", "ab")
    assert not tokens_match("abc", "")
    assert not tokens_match("abc", None)
    assert not tokens_match("", "")  # an unset secret admits nobody
    assert tokens_match("größe", "größe")  # no ASCII restriction here: it compares UTF-8 bytes


def test_client_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert client_token(None) is None
    assert client_token("given") == "given"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert client_token(None) == "from-env"
    assert client_token("given") == "given"
    monkeypatch.setenv(TOKEN_ENV, "")
    assert client_token(None) is None


# --- exposure -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST",
        "localhost.",
        " localhost ",
        "127.0.0.1",
        "127.0.0.2",
        "127.1.2.3",
        "::1",
        "[::1]",
        "::ffff:127.0.0.1",
        "[::FFFF:127.0.0.1]",
    ],
)
def test_is_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "::",
        "[::]",
        "",
        "10.0.0.1",
        "192.168.1.5",
        "fe80::1",
        "::ffff:10.0.0.1",
        "example.com",
        "localhost.example",
        "localhost.localdomain",
    ],
)
def test_is_not_loopback(host: str) -> None:
    assert not is_loopback(host)


def test_one_is_loopback() -> None:
    """The shm:// listener checks and the exposure warning ask the same function: an earlier copy in
    topology.py drifted (no upper case, brackets, ``localhost.`` or IPv4-mapped addresses)."""
    import tensorwire.server.shm as server_shm
    from tensorwire import topology, transport

    assert not hasattr(topology, "is_loopback")
    assert transport.is_loopback is is_loopback
    assert server_shm.is_loopback is is_loopback


def test_exposure_warning() -> None:
    for host in ("0.0.0.0", "10.0.0.1", "::", "node-1"):
        warning = exposure_warning(host, tls=False, token=False)
        assert warning is not None and "\n" not in warning
        assert "neither TLS nor a token" in warning
        assert exposure_warning(host, tls=True, token=False) is None
        assert exposure_warning(host, tls=False, token=True) is None
        assert exposure_warning(host, tls=True, token=True) is None
    assert "all interfaces" in (exposure_warning("", tls=False, token=False) or "")
    for host in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(host, tls=False, token=False) is None


def test_an_empty_token_is_refused() -> None:
    from tensorwire.security import Security

    with pytest.raises(ValueError, match="empty token"):
        Security(token="")


def test_client_tls_comes_from_the_environment_when_the_caller_names_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tensorwire.security import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TlsFiles, client_security

    for name in (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, "TENSORWIRE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert client_security(None, None).tls is None  # the system's CA store
    monkeypatch.setenv(TLS_CA_ENV, str(tmp_path / "ca.pem"))
    monkeypatch.setenv("TENSORWIRE_TOKEN", "t0ken")
    assert client_security(None, None) == client_security(TlsFiles(ca=tmp_path / "ca.pem"), "t0ken")
    given = TlsFiles(ca=tmp_path / "other.pem")
    assert client_security(given, "mine").tls is given  # what the caller names wins
    assert client_security(given, "mine").token == "mine"


def test_tls_files_given_as_strings_are_paths() -> None:
    """``TlsFiles(ca="certs/ca.pem")``, as the docs write it: a relay reader reads its certificate
    with ``read_bytes``, which a str lacks (it raised AttributeError)."""
    files = TlsFiles(cert="c.pem", key="k.pem", ca="ca.pem")  # type: ignore[arg-type]
    assert files == TlsFiles(Path("c.pem"), Path("k.pem"), Path("ca.pem"))
    assert all(isinstance(f, Path) for f in (files.cert, files.key, files.ca))


def test_a_refused_certificate_names_the_address_the_client_used(
    certs: dict[str, Path], other_certs: dict[str, Path]
) -> None:
    """The error says tls://NAME:PORT as the user wrote it (it said tcp://IP:PORT)."""
    import tensorwire
    from tensorwire.errors import CertificateRefused

    options = tensorwire.ServerOptions(tls=server_files(certs))
    with tensorwire.ServerThread(["tls://127.0.0.1:0"], options) as server:
        url = f"tls://localhost:{server.addresses[0].port}"
        with pytest.raises(CertificateRefused, match=f"certificate of {url} does not verify"):
            tensorwire.connect(url, tls=TlsFiles(ca=other_certs["ca"]))
