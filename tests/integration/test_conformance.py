"""The conformance suite over every transport: in-process, TCP and gRPC on loopback."""

from __future__ import annotations

import pytest

from tensorwire.testing.conformance import (
    CASES,
    RPC_CASES,
    SCHEMES,
    STREAM_CASES,
    STREAM_SCHEMES,
    Case,
    run_case,
)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_conformance(case: Case, scheme: str) -> None:
    run_case(case, scheme)


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_conformance_compressed(case: Case, compression: str) -> None:
    """The same cases over tcp:// with lossless chunk compression negotiated."""
    run_case(case, "tcp", compression)


@pytest.mark.parametrize("scheme", STREAM_SCHEMES)
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda c: c.__name__)
def test_frame_protocol(case: Case, scheme: str) -> None:
    run_case(case, scheme)


@pytest.mark.parametrize("case", RPC_CASES, ids=lambda c: c.__name__)
def test_grpc_hostile_input(case: Case) -> None:
    run_case(case, "grpc")
