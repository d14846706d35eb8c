"""Every Python example of the README and of the documentation site (docs/) runs as written against
real servers on loopback.

A page is one story: its ```python blocks run in order, in one namespace, in a fresh working
directory. Each distinct ``host:port`` the page names (``tls://node-a:7443``, ``tcp://127.0.0.1:7070``)
is one real server here, and the test alone rewrites the page's addresses to those servers' loopback
addresses: an example may speak of two machines, the test runs it on one. A page says what else its
examples need in a comment (``SETUP_LINE``); a ``secure`` page gets servers with TLS and a token, and
finds what its tutorial made beside it: ``certs/`` (``tensorwire certs``'s files, naming every host of
the page) and a ``token`` file, with ``TENSORWIRE_TOKEN`` set. Every Python example is a ```python
fence: no other spelling of one (``{code-block} python``, ``py``) is allowed, so none escapes this test.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import tensorwire
from tensorwire import ps
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.dataset import DigestService
from tensorwire.security import TlsFiles
from tensorwire.security.certs import write_dev_certs
from tensorwire.security.tokens import write_token_file

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
# scheme://host:port in an example: the host a name, an IPv4 address or a bracketed IPv6 one.
URL = re.compile(r"\b(tcp|tls|shm|grpc|grpcs)://([A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:]+\]):(\d+)")
OTHER_PYTHON = re.compile(
    r"^\s*(```|:::)\s*(\{code-block\}|\{code\}|\{sourcecode\})?\s*(py|python3|pycon|ipython)?\s*$"
)
EXAMPLE_TIMEOUT = 180  # seconds for one page (most take a second or two; a Ray page ~20)
TOKEN = "doc-examples-token-0123456789abcdef"


# A page says what its examples need in an HTML comment (which the site does not show):
# ``<!-- examples: secure slow ray servers=3 -->``. secure: servers with TLS and a token; servers=N:
# at least N servers (those the page does not name it finds in TENSORWIRE_SERVERS); slow: the page
# takes over 2 s (make test-fast leaves it out); ray: it starts a Ray cluster (run on the worker of
# the other Ray tests); vllm: it needs vLLM, so it runs in `make test-engines` (tests/engines).
SETUP_LINE = re.compile(r"^<!--\s*examples:(?P<words>[^>]*)-->\s*$", re.MULTILINE)
WORDS = re.compile(r"^(secure|slow|ray|vllm|servers=\d+)$")


@dataclass(frozen=True)
class Setup:
    """What a page's examples assume is there."""

    secure: bool = False
    servers: int = 1
    slow: bool = False
    ray: bool = False
    vllm: bool = False

    @classmethod
    def of(cls, text: str) -> Setup:
        match = SETUP_LINE.search(text)
        words = match.group("words").split() if match else []
        wrong = [word for word in words if not WORDS.match(word)]
        if wrong:
            raise ValueError(f"unknown words in <!-- examples: -->: {wrong}")
        servers = max([int(w.split("=")[1]) for w in words if w.startswith("servers=")], default=1)
        flags = {name: name in words for name in ("secure", "slow", "ray", "vllm")}
        return cls(servers=servers, **flags)

    def marks(self) -> list[Any]:
        marks: list[Any] = [pytest.mark.slow] if self.slow or self.ray else []
        return [*marks, pytest.mark.xdist_group("ray")] if self.ray else marks


def python_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(the line the code starts on, the code) of each ```python block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            yield i + 2, "\n".join(lines[i + 1 : end]) + "\n"
            i = end
        i += 1


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def pages_with_examples(*, vllm: bool) -> list[Any]:
    """The pages with a Python example, as parameters: those that need vLLM, or the others."""
    params = []
    for page in PAGES:
        text = page.read_text()
        setup = Setup.of(text)
        if setup.vllm == vllm and any(True for _ in python_blocks(text)):
            params.append(pytest.param(page, id=_relative(page), marks=setup.marks()))
    return params


def authorities(code: str) -> list[str]:
    """The distinct ``host:port`` of the page's URLs, in the order they first appear; port 0 is an
    address to listen on (``share="shm://127.0.0.1:0"``), not a server's, and is left as written."""
    named = (f"{m.group(2)}:{m.group(3)}" for m in URL.finditer(code) if m.group(3) != "0")
    return list(dict.fromkeys(named))


def schemes(code: str) -> set[str]:
    return {m.group(1) for m in URL.finditer(code) if m.group(3) != "0"}


class Cluster:
    """One real server per address of a page (tcp://, shm:// and, when secure, tls:// listeners; a
    grpc:// or grpcs:// one when the page uses it), each with the parameter-server extension, the
    relay coordinator and the dataset digests, as ``tensorwire serve``."""

    def __init__(
        self, stack: ExitStack, count: int, where: Path, *, secure: bool, hosts: list[str], used: set[str]
    ) -> None:
        options = tensorwire.ServerOptions()
        urls = ["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]
        urls += [f"{scheme}://127.0.0.1:0" for scheme in sorted(used & {"grpc", "grpcs"})]
        if secure:
            written = write_dev_certs(where / "certs", ["localhost", "127.0.0.1", "::1", *hosts], 1)
            write_token_file(where / "token", TOKEN)
            options = tensorwire.ServerOptions(
                tls=TlsFiles(cert=written["server"], key=written["server_key"]), token=TOKEN
            )
            urls.append("tls://127.0.0.1:0")
        self.servers = []
        for _ in range(count):
            server = stack.enter_context(
                tensorwire.ServerThread(urls, options, extensions=[ps.ParamServer()])
            )
            RelayCoordinator.of(server.server)
            server.server.extend(DigestService(server.server.store))  # dataset scatter's checks
            self.servers.append({address.scheme: str(address) for address in server.addresses})

    def rewrite(self, code: str, names: list[str]) -> str:
        def bound(m: re.Match[str]) -> str:
            scheme, authority = m.group(1), f"{m.group(2)}:{m.group(3)}"
            if m.group(3) == "0":
                return m.group(0)
            listeners = self.servers[names.index(authority)]
            if scheme not in listeners:
                raise AssertionError(
                    f"an example names {m.group(0)}: the test serves {sorted(listeners)} only"
                )
            return listeners[scheme]

        return URL.sub(bound, code)


def test_every_python_example_is_a_python_fence() -> None:
    """``{code-block} python`` and friends would render as Python and escape this test."""
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            match = OTHER_PYTHON.match(line)
            assert not (match and (match.group(2) or match.group(3))), (
                f"{_relative(page)}:{number}: write a Python example as a ```python fence, so that it runs"
            )


def test_every_page_says_its_setup_in_known_words() -> None:
    for page in PAGES:
        Setup.of(page.read_text())  # raises on a word it does not know


@pytest.mark.timeout(EXAMPLE_TIMEOUT)
@pytest.mark.parametrize("page", pages_with_examples(vllm=False))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_page(page, tmp_path, monkeypatch)


def run_page(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``page``'s examples, in order, in one namespace, against the servers it names."""
    text = page.read_text()
    setup = Setup.of(text)
    blocks = list(python_blocks(text))
    source = "".join(code for _, code in blocks)
    names = authorities(source)
    hosts = sorted({name.rsplit(":", 1)[0].strip("[]") for name in names})
    monkeypatch.chdir(tmp_path)
    with ExitStack() as stack:
        cluster = Cluster(
            stack,
            max(setup.servers, len(names)),
            tmp_path,
            secure=setup.secure,
            hosts=hosts,
            used=schemes(source),
        )
        # A worker finds its servers, rank and world size in the environment (torchrun, ps launch).
        monkeypatch.setenv("TENSORWIRE_SERVERS", ",".join(s["tcp"] for s in cluster.servers))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        if setup.secure:
            monkeypatch.setenv("TENSORWIRE_TOKEN", TOKEN)
        if "import ray" in source:
            _retry_ray_start(monkeypatch)
        namespace: dict[str, Any] = {"__name__": "__main__"}
        for line, code in blocks:
            # Blank lines first, so that a traceback names the page's own line numbers.
            runnable = "\n" * (line - 1) + cluster.rewrite(code, names)
            exec(compile(runnable, str(page), "exec"), namespace)


def _retry_ray_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's ``ray.init`` as the Ray tests start Ray: once more if Ray's own wait for its
    control store ran out (``bench.peers_ray.start_ray``); the page's code runs as written."""
    import ray

    from tensorwire.bench.peers_ray import start_ray

    first = SimpleNamespace(init=ray.init, shutdown=ray.shutdown)
    monkeypatch.setattr(ray, "init", lambda **options: start_ray(first, **options))


def test_docstring_examples_run() -> None:
    """The API reference shows the docstrings: every module's ``>>>`` examples run too (doctest)."""
    import doctest
    import importlib

    src = ROOT / "src"
    files = [f for f in sorted((src / "tensorwire").rglob("*.py")) if ">>> " in f.read_text()]
    assert files, "the package's docstring shows an example"
    for file in files:
        name = ".".join(file.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, f"{name}'s docstring examples: {result}"
