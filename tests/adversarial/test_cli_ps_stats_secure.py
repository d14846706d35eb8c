"""`tensorwire ps stats` reaches servers that need a token or TLS (it took neither flag, so a
secured parameter server could only be asked through $TENSORWIRE_TOKEN, and a tls:// one with a
private CA not at all)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tensorwire import cli
from tensorwire.ps import ParamServer
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions

TOKEN = "a-token-for-ps-stats"


def test_ps_stats_takes_the_token_and_the_tls_ca(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path)
    served = ServerOptions(tls=TlsFiles(paths["server"], paths["server_key"]), token=TOKEN)
    with ServerThread(
        ["tls://127.0.0.1:0"],
        served,
        extensions=[ParamServer()],
    ) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        runner = CliRunner(env={"TENSORWIRE_TOKEN": None})
        ok = runner.invoke(cli.main, ["ps", "stats", url, "--token", TOKEN, "--tls-ca", str(paths["ca"])])
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.output)[0]["role"] == "primary"
        refused = runner.invoke(cli.main, ["ps", "stats", url, "--tls-ca", str(paths["ca"])])
        assert refused.exit_code == 1
        # (the in-process server's own log line shares the captured output)
        assert "error: authentication failed: no token was offered" in refused.output.splitlines()
