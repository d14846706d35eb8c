"""The two-machine tutorial's shell steps, run as written on one host: its certificates, token,
TLS server with a token, and the command-line client (ls, put, get, stat), then the server again
with an shm:// listener. (Its Python steps run in test_doc_examples.py.)

What the test alone changes, so that one host plays both: ``HOME`` is a temporary directory (the
tutorial works in ``~/tw``); a ``tensorwire serve`` runs in the background on free loopback ports
(``--ready-file`` says which), and is stopped when the tutorial starts the next one or ends; the
later commands' ``node-a:PORT`` becomes ``localhost`` and the port it got (the certificate names
localhost too); ``scp`` from node-a is a no-op, since node-a's files are already here. Anything
else runs as written, through bash, and must exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire.testing.process import wait_for

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "two-machines.md"
SHELL_BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LISTEN = re.compile(r"--listen (\w+)://([\d.]+):(\d+)")
COMMAND_TIMEOUT = 60.0


def steps(text: str) -> list[str]:
    """The shell blocks' commands in order, continuation lines joined."""
    lines: list[str] = []
    for block in SHELL_BLOCK.findall(text):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


class Story:
    """The tutorial's shell session: its working directory and environment carry over from one
    command to the next, as in a terminal."""

    def __init__(self, home: Path) -> None:
        self.env = {
            **os.environ,
            "HOME": str(home),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        self.cwd = home
        self.ports: dict[str, int] = {}  # a port the tutorial names -> the one its server got
        self.server: subprocess.Popen[bytes] | None = None
        self.ran: list[str] = []

    def run(self, line: str) -> None:
        # `mkdir -p ~/tw && cd ~/tw`: the cd must last; a subshell's chain `( ... && ... )` is bash's
        parts = [line] if line.startswith("(") else line.split(" && ")
        for part in parts:
            self._one(part.strip())
        self.ran.append(line)

    def _one(self, command: str) -> None:
        words = shlex.split(command, comments=True)
        if not words:
            return
        if words[0] == "cd":
            self.cwd = Path(self.env["HOME"] + words[1][1:] if words[1].startswith("~") else words[1])
        elif words[0] == "export":
            key, value = words[1].split("=", 1)
            self.env[key] = self._here(value)
        elif words[0] == "scp":  # node-a is this host: the file is already where scp would put it
            assert (self.cwd / words[-1]).exists()
        elif words[:2] == ["tensorwire", "serve"]:
            self._serve(command)
        else:
            done = subprocess.run(
                self._here(command), shell=True, executable="/bin/bash",
                cwd=self.cwd, env=self.env, capture_output=True, timeout=COMMAND_TIMEOUT, check=False,
            )  # fmt: skip
            assert done.returncode == 0, f"`{command}` failed: {done.stdout.decode()}{done.stderr.decode()}"

    def _here(self, text: str) -> str:
        """node-a:PORT as this host reaches the server that the tutorial started on that port."""
        return re.sub(r"node-a:(\d+)", lambda m: f"localhost:{self.ports.get(m.group(1), m.group(1))}", text)

    def _serve(self, command: str) -> None:
        self.stop()
        ready = self.cwd / "ready"
        ready.unlink(missing_ok=True)
        named = LISTEN.findall(command)
        command = LISTEN.sub(lambda m: f"--listen {m.group(1)}://127.0.0.1:0", command)
        args = [*shlex.split(command), "--ready-file", str(ready)]
        self.server = subprocess.Popen(args, cwd=self.cwd, env=self.env, stdout=subprocess.DEVNULL)
        server = self.server
        wait_for(lambda: ready.exists() or server.poll() is not None, 30, "the tutorial's server")
        assert server.poll() is None, f"`{command}` exited {server.returncode}"
        bound = ready.read_text().split()
        for (_, _, port), address in zip(named, bound, strict=True):
            self.ports[port] = int(address.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(timeout=30)
            self.server = None


@pytest.mark.timeout(300)
def test_the_two_machine_tutorials_commands_run_as_written(tmp_path: Path) -> None:
    story = Story(tmp_path)
    try:
        for line in steps(TUTORIAL.read_text()):
            story.run(line)
        assert story.server is not None, "the tutorial ends with a server on tls:// and shm://"
    finally:
        story.stop()
    assert any(line.startswith("tensorwire stat") for line in story.ran)
    assert (tmp_path / "tw" / "w.npy").stat().st_size > 256 * 256 * 4  # what `get -o` wrote
