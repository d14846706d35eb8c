"""One vocabulary of options on every command that talks to a server, the deprecated spellings
that still work for a release (with their warning line), and --timeout reaching the client.

Real click invocations (CliRunner) of the real command tree; the silent server is a real socket on
loopback that completes the TCP handshake and never answers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tensorwire import cli
from tensorwire.cli.dashboard import split_page_tls
from tensorwire.cli.ps import ps_launch
from tensorwire.security import TlsFiles
from tensorwire.testing.faults import silent_listener

VOCABULARY = {"--tls-ca", "--tls-cert", "--tls-key", "--token", "--token-file", "--timeout"}
# The commands that talk to a server as its client. A new one is caught by the test below: it
# must either take the vocabulary or be listed as not a client (with why).
CLIENTS = {
    "put", "get", "ls", "stat", "rm", "status", "probe", "dashboard",
    "ps stats", "ps end", "dataset scatter", "dataset fetch",
}  # fmt: skip
NOT_CLIENTS = {  # a server's own listener, a local plan, files, the demo's own cluster
    "serve", "ps serve", "ps launch", "ps plan", "certs", "demo",
}  # fmt: skip
# What names a server to reach: --server, SERVERS, URL, --to (nodes), URL|DATA_DIR (source).
SERVER_PARAMS = {"server", "servers", "url", "nodes", "source"}
ROLES = ("--page-", "--job-", "--operator-")  # options named for another party than this client
DEPRECATION = "tensorwire: warning: {old} is deprecated, say {new} (the old spelling goes in 0.3.0"


def commands(group: click.Group = cli.main, path: str = "") -> Iterator[tuple[str, click.Command]]:
    """Every command of the tree, by its full name (``ps stats``); benchmarks left out (each
    parses its own arguments)."""
    for name, command in group.commands.items():
        full = f"{path} {name}".strip()
        if full == "bench":
            continue
        if isinstance(command, click.Group):
            yield from commands(command, full)
        else:
            yield full, command


def visible_options(command: click.Command) -> set[str]:
    return {opt for p in command.params if isinstance(p, click.Option) and not p.hidden for opt in p.opts}


def test_every_command_that_talks_to_a_server_takes_the_one_vocabulary() -> None:
    tree = dict(commands())
    assert set(tree) == CLIENTS | NOT_CLIENTS, "a command is neither a client nor listed as not one"
    naming_a_server = {name for name, c in tree.items() if SERVER_PARAMS & {p.name for p in c.params}}
    assert naming_a_server - NOT_CLIENTS == CLIENTS
    for name in CLIENTS:
        options = visible_options(tree[name])
        assert options >= VOCABULARY, (name, VOCABULARY - options)
        security_like = {o for o in options if "tls" in o or "token" in o or o == "--timeout"}
        assert security_like - VOCABULARY == {o for o in security_like if o.startswith(ROLES)}, name
        cert = next(p for p in tree[name].params if "--tls-cert" in getattr(p, "opts", ()))
        assert "client's certificate" in (cert.help or ""), name  # the client's, on every command


def test_each_command_keeps_its_own_timeout_default() -> None:
    tree = dict(commands())

    def default(name: str) -> object:
        return next(p.default for p in tree[name].params if p.name == "timeout")

    assert (default("status"), default("probe"), default("dashboard")) == (2.0, 2.0, 1.0)
    assert default("ps stats") == default("ps end") == 10.0
    assert default("put") == default("dataset fetch") == cli.options.CLIENT_DEFAULTS.timeout
    help_text = CliRunner().invoke(cli.main, ["dataset", "fetch", "--help"]).output
    assert "--deadline bounds the whole command" in " ".join(help_text.split())


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A tcp:// URL whose socket listens (the kernel completes the handshake) and never answers."""
    with silent_listener() as listener:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "--server", "{url}"],
        ["get", "model/w", "-o", "{tmp}/w.npy", "--server", "{url}"],
        ["ps", "stats", "{url}"],
        ["ps", "end", "job-1", "{url}"],
        ["dataset", "fetch", "{url}", "--out", "{tmp}"],
    ],
    ids=lambda args: " ".join(a for a in args if not a.startswith(("{", "-")))[:20],
)
def test_timeout_reaches_the_client(args: list[str], silent_server: str, tmp_path: Path) -> None:
    argv = [a.format(url=silent_server, tmp=tmp_path) for a in args] + ["--timeout", "0.3"]
    started = time.monotonic()
    result = CliRunner().invoke(cli.main, argv)
    elapsed = time.monotonic() - started
    assert result.exit_code == 1, result.output
    assert "waited 0.3s" in result.stderr, result.stderr  # the client's wait, named by the error
    assert elapsed < 8.0  # a few 0.3 s waits, not the client's default 10 s connect timeout


def test_a_renamed_option_takes_its_old_spelling_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = ps_launch.make_context("launch", ["--timeout", "30", "train.py"])
    assert ctx.params["deadline"] == 30.0
    assert DEPRECATION.format(old="--timeout", new="--deadline") in capsys.readouterr().err
    ctx = ps_launch.make_context("launch", ["--deadline", "30", "train.py"])
    assert ctx.params["deadline"] == 30.0 and capsys.readouterr().err == ""
    for both in (["--timeout", "1", "--deadline", "2"], ["--deadline", "2", "--timeout", "1"]):
        with pytest.raises(click.UsageError, match="give --deadline or the deprecated --timeout, not both"):
            ps_launch.make_context("launch", [*both, "train.py"])


def test_dashboard_tls_client_ca_is_the_page_client_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("a CA")
    result = CliRunner().invoke(cli.main, ["dashboard", "tcp://127.0.0.1:1", "--tls-client-ca", str(ca)])
    assert result.exit_code == 2
    assert DEPRECATION.format(old="--tls-client-ca", new="--page-tls-client-ca") in result.stderr
    # parsed as the page's client CA: refused as that, before anything is started
    assert "--page-tls-client-ca needs --page-tls-cert and --page-tls-key" in result.stderr


def test_dashboard_tls_cert_alone_is_still_the_pages_certificate(tmp_path: Path) -> None:
    bogus = tmp_path / "page.pem"
    bogus.write_text("not a certificate")
    pair = ["--tls-cert", str(bogus), "--tls-key", str(bogus)]
    result = CliRunner().invoke(cli.main, ["dashboard", "tcp://127.0.0.1:1", "--port", "0", *pair])
    old, new = "--tls-cert/--tls-key for the page's certificate", "--page-tls-cert/--page-tls-key"
    assert DEPRECATION.format(old=old, new=new) in result.stderr
    assert "from 0.3.0 --tls-cert/--tls-key on dashboard are the client certificate" in result.stderr
    # the page loaded it as its own certificate (and failed on it) before serving anything
    assert result.exit_code == 1 and f"cannot load TLS certificate {bogus}" in result.stderr


def test_split_page_tls_old_and_new_meanings(capsys: pytest.CaptureFixture[str]) -> None:
    cert, key, ca = Path("c.pem"), Path("k.pem"), Path("ca.pem")
    given = {"tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(ca), "token": "t"}
    page, client = split_page_tls(given, None, None, None)  # the old meaning, for this release
    assert page == TlsFiles(cert, key, None) and client == {"tls_ca": str(ca), "token": "t"}
    assert "say --page-tls-cert/--page-tls-key" in capsys.readouterr().err
    page_cert, page_key = Path("page.pem"), Path("page-key.pem")
    page, client = split_page_tls(given, page_cert, page_key, ca)  # the new: the client's own
    assert page == TlsFiles(page_cert, page_key, ca) and client == given
    assert capsys.readouterr().err == ""
    assert split_page_tls({"tls_ca": str(ca)}, None, None, None) == (None, {"tls_ca": str(ca)})
    with pytest.raises(click.UsageError, match="go together"):
        split_page_tls({}, page_cert, None, None)
