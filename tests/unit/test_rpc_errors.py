"""transport/rpc.py: how a failed gRPC call becomes a tensorwire error."""

from __future__ import annotations

import asyncio

import grpc

from tensorwire.errors import ConnectionLost, ServerError
from tensorwire.security import Security
from tensorwire.transport.rpc import RpcTransport
from tensorwire.types import Address
from tensorwire.wire.checksum import ChecksumKind


def translate(code: grpc.StatusCode, debug: str) -> Exception:
    async def go() -> Exception:
        transport = RpcTransport(
            Address.parse("grpc://127.0.0.1:1"), ChecksumKind.XXH3_64, None, 5.0, Security()
        )
        try:
            empty = grpc.aio.Metadata()
            return transport._translate(
                grpc.aio.AioRpcError(code, empty, empty, "Internal error from Core", debug), "put"
            )
        finally:
            await transport.close()

    return asyncio.run(go())


def test_a_status_grpc_lost_to_a_send_as_the_server_ended_the_call_is_sent_again() -> None:
    """grpc/grpc#36066: a put the server refused (over capacity) while a message was being sent
    came back as INTERNAL, a ServerError nothing retried (a conformance case failed on it); sent
    again, it meets the refusal itself."""
    lost = translate(grpc.StatusCode.INTERNAL, 'Failed "execute_batch": (<SendMessageOperation>,)')
    assert isinstance(lost, ConnectionLost) and lost.retryable and "127.0.0.1:1" in str(lost)


def test_any_other_internal_error_stays_a_server_error() -> None:
    other = translate(grpc.StatusCode.INTERNAL, "something else")
    assert isinstance(other, ServerError) and not other.retryable
