"""Token-less gRPC calls cost a token-guarded server nothing but their headers (issue 13, item 8).

grpcio used to read a unary call's whole message (up to 256 MiB) before the token gate's refusal
ran: four token-less 200 MiB uploads raised a server's peak RSS by 1.3 GiB. The gate now answers
before any message is read. Measured on a real ``tensorwire serve`` process: its peak resident
memory (``VmHWM``) against its resident memory before the calls.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from tensorwire.testing.process import ServerProcess
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire.rpc import SERVICE, encode_chunk

MiB = 1 << 20
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")


def peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_token_less_uploads_do_not_raise_the_servers_peak_memory(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-the-caller-does-not-have")
    extra = ["--grpc-listen", "127.0.0.1:0", "--token-file", str(token)]
    with ServerProcess(capacity="1GiB", extra=extra) as srv:
        target = srv.urls[1].removeprefix("grpc://")
        before = psutil.Process(srv.pid).memory_info().rss
        # One 200 MiB message, serialized once: the calls send the same bytes.
        upload = pb.TensorRequest(tensor_name="x", data=bytes(200 * MiB), shape=[200 * MiB], dtype="uint8")
        message = upload.SerializeToString()
        del upload
        chunk = encode_chunk(memoryview(bytes(60 * MiB)), 1, 0, pb.TensorInfo(name="y", dtype="uint8"))
        options = [("grpc.max_send_message_length", 512 * MiB)]
        with grpc.insecure_channel(target, options=options) as channel:
            upload_call = channel.unary_unary(f"/{SERVICE}/UploadTensor", None, None)
            put_call = channel.stream_unary(f"/{SERVICE}/Put", None, None)

            def upload_once(_: int) -> grpc.StatusCode:
                try:
                    upload_call(message, timeout=60)
                except grpc.RpcError as exc:
                    return exc.code()  # type: ignore[no-any-return]
                return grpc.StatusCode.OK

            def put_once() -> grpc.StatusCode:
                try:
                    put_call(iter([chunk]), timeout=60)
                except grpc.RpcError as exc:
                    return exc.code()  # type: ignore[no-any-return]
                return grpc.StatusCode.OK

            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(upload_once, range(4)))
            codes.append(put_once())
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 5
        grown = peak_rss(srv.pid) - before
        assert grown < 128 * MiB, (
            f"five token-less calls raised the server's peak memory by {grown >> 20} MiB"
        )
