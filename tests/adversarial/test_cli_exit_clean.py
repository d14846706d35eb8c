"""Programs that drop a client (or a ``ShardDataset``) without closing it, or exit with one open,
end cleanly: no "Task was destroyed but it is pending!", no "Exception ignored" on stderr. And
``tensorwire demo`` that misses its accuracy target says so in one error line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensorwire import cli
from tensorwire.cli import demo as demo_module
from tensorwire.dataset import scatter
from tensorwire.testing.process import ServerProcess

SCRIPTS = {
    "a client dropped in a function": """
        def work():
            c = tensorwire.connect(URL)
            c.put("x", torch.ones(4))
            c.get("x")
        work()
        gc.collect()
    """,
    "a client open at exit": """
        c = tensorwire.connect(URL)
        c.put("x", torch.ones(4))
    """,
    "a ShardDataset dropped": """
        from tensorwire.dataset import ShardDataset
        ds = ShardDataset(URL, "photos")
        assert len(ds) == 3 and ds[0][1].numel() == 100
        del ds
        gc.collect()
    """,
    "a ShardDataset open at exit": """
        from tensorwire.dataset import ShardDataset
        ds = ShardDataset(URL, "photos")
        ds[1]
    """,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    src = tmp_path_factory.mktemp("data") / "photos"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.bin").write_bytes(bytes([i]) * 100)
    with ServerProcess() as srv:
        assert scatter(src, [srv.url]).ok
        yield srv.url


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_no_pending_task_is_destroyed_at_exit(server: str, case: str) -> None:
    body = textwrap.dedent(SCRIPTS[case])
    script = f"import gc, torch, tensorwire\nURL = {server!r}\n{body}\nprint('done')\n"
    command = [sys.executable, "-c", script]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr
    assert "Task was destroyed" not in result.stderr, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


def test_a_missed_demo_target_is_one_error_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The whole job takes ~10 s on two cores: its outcome is what this checks, so it is stood in for.
    monkeypatch.setattr(demo_module, "train", lambda mode, epochs: {"accuracy": 0.9331})
    result = CliRunner().invoke(cli.main, ["demo", "--epochs", "2"])
    assert result.exit_code == 1
    assert result.output.startswith("error: test accuracy 93.31% missed") and "2 epoch" in result.output
