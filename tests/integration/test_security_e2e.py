"""TLS, mTLS and tokens end to end: a real `tensorwire serve` process, real certificates from
`tensorwire certs`, and clients that get in or are refused with one clear error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import tensorwire
from tensorwire import errors
from tensorwire.cli import main
from tensorwire.security import TlsFiles
from tensorwire.testing.process import ServerProcess

TOKEN = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("certs")
    result = CliRunner().invoke(main, ["certs", str(directory)])
    assert result.exit_code == 0, result.output
    other = tmp_path_factory.mktemp("other-ca")
    assert CliRunner().invoke(main, ["certs", str(other)]).exit_code == 0
    token = directory / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    files = {p.stem: p for p in directory.iterdir()}
    files["other_ca"] = other / "ca.pem"
    return files


@pytest.fixture(scope="module")
def server(certs: dict[str, Path]) -> Iterator[ServerProcess]:
    extra = [
        "--listen", "tls://127.0.0.1:0", "--grpc-listen", "grpcs://127.0.0.1:0",
        "--tls-cert", str(certs["server"]), "--tls-key", str(certs["server-key"]),
        "--token-file", str(certs["token"]),
    ]  # fmt: skip
    with ServerProcess(extra=extra) as srv:
        yield srv


def urls(srv: ServerProcess) -> dict[str, str]:
    return {url.split("://")[0]: url for url in srv.urls}


@pytest.mark.parametrize("scheme", ["tcp", "tls", "grpcs"])
def test_the_right_token_and_ca_get_in(server: ServerProcess, certs: dict[str, Path], scheme: str) -> None:
    with tensorwire.connect(urls(server)[scheme], tls=TlsFiles(ca=certs["ca"]), token=TOKEN) as c:
        assert c.transport == scheme
        c.put(f"sec/{scheme}", torch.arange(5))
        assert torch.equal(c.get(f"sec/{scheme}"), torch.arange(5))


@pytest.mark.parametrize("scheme", ["tcp", "tls", "grpcs"])
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_missing_or_wrong_token_is_refused(
    server: ServerProcess,
    certs: dict[str, Path],
    scheme: str,
    token: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TENSORWIRE_TOKEN", raising=False)
    with pytest.raises(errors.AuthenticationError, match="authentication failed"):
        tensorwire.connect(
            urls(server)[scheme], tls=TlsFiles(ca=certs["ca"]), token=token, retries=2, backoff=0.01
        )


def test_the_token_comes_from_the_environment(
    server: ServerProcess, certs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORWIRE_TOKEN", TOKEN)
    with tensorwire.connect(urls(server)["tls"], tls=TlsFiles(ca=certs["ca"])) as c:
        c.ping()


@pytest.mark.parametrize("scheme", ["tls", "grpcs"])
def test_a_server_signed_by_another_ca_is_refused(
    server: ServerProcess, certs: dict[str, Path], scheme: str
) -> None:
    with pytest.raises(errors.TransportError):
        tensorwire.connect(
            urls(server)[scheme],
            tls=TlsFiles(ca=certs["other_ca"]),
            token=TOKEN,
            retries=0,
            connect_timeout=5,
        )


def test_plaintext_to_a_tls_port_fails_clearly(server: ServerProcess) -> None:
    plain = urls(server)["tls"].replace("tls://", "tcp://")
    with pytest.raises(errors.TransportError, match=r"tls://"):
        tensorwire.connect(plain, token=TOKEN, retries=0, connect_timeout=5)
    plain_grpc = urls(server)["grpcs"].replace("grpcs://", "grpc://")
    with pytest.raises(errors.TransportError):
        tensorwire.connect(plain_grpc, token=TOKEN, retries=0, connect_timeout=3)


def test_mutual_tls_requires_a_client_certificate(certs: dict[str, Path]) -> None:
    extra = [
        "--listen", "tls://127.0.0.1:0", "--grpc-listen", "grpcs://127.0.0.1:0",
        "--tls-cert", str(certs["server"]), "--tls-key", str(certs["server-key"]),
        "--tls-client-ca", str(certs["ca"]),
    ]  # fmt: skip
    with ServerProcess(extra=extra) as srv:
        for url in srv.urls[1:]:
            with pytest.raises(errors.TransportError):
                tensorwire.connect(url, tls=TlsFiles(ca=certs["ca"]), retries=0, connect_timeout=5).ping()
            mine = TlsFiles(ca=certs["ca"], cert=certs["client"], key=certs["client-key"])
            with tensorwire.connect(url, tls=mine) as c:
                c.ping()


def test_an_exposed_server_warns(tmp_path: Path) -> None:
    with ServerProcess(listen="tcp://0.0.0.0:0") as srv:
        with tensorwire.connect(srv.url.replace("0.0.0.0", "127.0.0.1")) as c:
            c.ping()
        assert "warning" in srv.output().lower()
