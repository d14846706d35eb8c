"""``ServerOptions``: what ``tensorwire serve`` builds from its flags is what Python builds by hand;
the parameter server's flags are on ``ps serve`` only; ``tls=TlsFiles(...)`` is the one way to say
TLS, and the old client keywords still work, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import tensorwire
from tensorwire import cli, topology
from tensorwire.cli.ps_options import PsOptions
from tensorwire.cli.server_options import Listen
from tensorwire.client.options import transport_options
from tensorwire.security import Security, TlsFiles, write_dev_certs, write_token_file
from tensorwire.server.options import (
    ConnectionOptions,
    MetricsOptions,
    ServerOptions,
    StoreOptions,
    UploadOptions,
)
from tensorwire.store.generation_config import GenerationConfig
from tensorwire.types import GiB, MiB


def _started(monkeypatch: pytest.MonkeyPatch, module: str, argv: list[str]) -> dict[str, Any]:
    """What ``tensorwire ARGV`` hands ``start`` (which would run the server)."""
    seen: dict[str, Any] = {}

    def start(listen: Listen, options: ServerOptions, ps: PsOptions, **rest: Any) -> None:
        seen.update(listen=listen, options=options, ps=ps, **rest)

    monkeypatch.setattr(f"tensorwire.cli.{module}.start", start)
    result = CliRunner().invoke(cli.main, argv)
    assert result.exit_code == 0, result.output
    return seen


def test_the_flags_build_the_options_python_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token = write_token_file(tmp_path / "token", "the-clients-token")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert")
    key.write_text("key")
    argv = [
        "serve", "--listen", "127.0.0.1:0", "--capacity", "1GiB", "--data-dir", str(tmp_path / "data"),
        "--max-tensors", "99", "--stall-timeout", "7", "--max-connections", "12", "--idle-timeout", "30",
        "--busy-poll", "0.0001", "--auth-timeout", "2", "--max-uploads", "5", "--uploads-per-client", "2",
        "--resumable-min-bytes", "1MiB", "--keep-generations", "3", "--max-parts", "9",
        "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token),
        "--metrics-port", "0", "--metrics-connections", "3", "--rack", "r7",
    ]  # fmt: skip
    seen = _started(monkeypatch, "serve", argv)
    by_hand = ServerOptions(
        store=StoreOptions(1 * GiB, tmp_path / "data", max_tensors=99),
        connections=ConnectionOptions(max_connections=12, stall_timeout=7, idle_timeout=30, auth_timeout=2,
                                      busy_poll=0.0001),
        uploads=UploadOptions(max_uploads=5, per_client=2, resumable_min_bytes=1 * MiB),
        metrics=MetricsOptions(port=0, connections=3),
        generations=GenerationConfig(keep=3, max_parts=9),
        location=topology.here("r7"),
        tls=TlsFiles(cert, key),
        token="the-clients-token",
    )  # fmt: skip
    assert seen["options"] == by_hand
    assert seen["listen"] == Listen(("tcp://127.0.0.1:0",))
    assert seen["ps"] == PsOptions()  # plain serve: the parameter server with its defaults


def test_the_defaults_are_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _started(monkeypatch, "serve", ["serve"])
    assert seen["options"] == ServerOptions(location=topology.here(), generations=GenerationConfig())
    assert seen["page"] is None and seen["relay_networks"] == ()


def test_the_parameter_server_flags_are_on_ps_serve_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    peer = write_token_file(tmp_path / "peer", "the-peer-token")
    argv = ["ps", "serve", "--workers", "4", "--max-jobs", "2", "--checkpoint-dir", str(tmp_path),
            "--standby", "--peer-token-file", str(peer), "--threads", "2"]  # fmt: skip
    ps = _started(monkeypatch, "ps", argv)["ps"]
    assert ps == PsOptions(workers=4, max_jobs=2, checkpoint_dir=tmp_path, standby=True,
                           peer=Security(token="the-peer-token"), threads=2)  # fmt: skip
    refused = CliRunner().invoke(cli.main, ["serve", "--checkpoint-dir", str(tmp_path)])
    assert refused.exit_code == 2 and "use `tensorwire ps serve`" in refused.output
    refused = CliRunner().invoke(cli.main, ["serve", "--workers=2"])
    assert refused.exit_code == 2 and "--workers is a parameter-server option" in refused.output


def test_a_group_checks_its_values() -> None:
    with pytest.raises(ValueError, match="busy_poll"):
        ConnectionOptions(busy_poll=1.0)
    with pytest.raises(ValueError, match="refusals"):
        ConnectionOptions(refusals=-1)
    with pytest.raises(ValueError, match="metrics token"):
        tensorwire.Server(ServerOptions(token="t", metrics=MetricsOptions(token="t")))


def test_the_old_tls_keywords_warn_and_mean_the_same(tmp_path: Path) -> None:
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem"
    with pytest.warns(DeprecationWarning, match="tls=tensorwire.TlsFiles") as caught:
        old = tensorwire.ClientOptions(tls_ca=str(ca), tls_cert=str(cert), tls_key=str(key))
    assert caught[0].filename == __file__  # the warning names the caller's line
    new = tensorwire.ClientOptions(tls=TlsFiles(ca=ca, cert=cert, key=key))
    assert old.tls == new.tls and transport_options(old) == transport_options(new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tensorwire.ClientOptions(tls=TlsFiles(ca=ca)).security() == Security(TlsFiles(ca=ca))
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        tensorwire.ClientOptions(tls_ca=str(ca), tls=TlsFiles(ca=cert))


def test_connect_takes_tls_files_and_the_old_keywords(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path)
    served = ServerOptions(tls=TlsFiles(paths["server"], paths["server_key"]), token="tok")
    with tensorwire.ServerThread(["tls://127.0.0.1:0"], served) as srv:
        with tensorwire.connect(srv.url, tls=TlsFiles(ca=paths["ca"]), token="tok") as client:
            client.put("w", torch.ones(3))
        with pytest.warns(DeprecationWarning) as caught:
            client = tensorwire.connect(srv.url, tls_ca=str(paths["ca"]), token="tok")
        assert caught[0].filename == __file__
        with client:
            assert torch.equal(client.get("w"), torch.ones(3))


def test_the_old_server_keywords_warn_and_build_the_same_options() -> None:
    security = Security(TlsFiles(Path("c.pem"), Path("k.pem")), "tok")
    with pytest.warns(DeprecationWarning, match="ServerOptions") as caught:
        server = tensorwire.Server(
            security=security, stall_timeout=7.0, metrics_port=0, max_uploads=3, limits=None
        )
    assert caught[0].filename == __file__
    assert server.options == ServerOptions(
        tls=security.tls, token="tok", connections=ConnectionOptions(stall_timeout=7.0),
        metrics=MetricsOptions(port=0), uploads=UploadOptions(max_uploads=3),
    )  # fmt: skip
    with pytest.warns(DeprecationWarning) as caught, tensorwire.ServerThread(busy_poll=1e-4) as srv:
        assert srv.server.options.connections.busy_poll == 1e-4
    assert caught[0].filename == __file__
    with pytest.raises(TypeError, match="store="):
        tensorwire.Server(tensorwire.TensorStore(1024))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        tensorwire.Server(ServerOptions(), idle_timeout=1.0)
    with pytest.raises(TypeError, match="unexpected keyword arguments: nonsense"):
        tensorwire.Server(nonsense=1)
