"""The conformance suite over every transport: in-process and TCP on loopback."""

from __future__ import annotations

import pytest

from tensorwire.testing.conformance import CASES, SCHEMES, Case, run_case


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_conformance(case: Case, scheme: str) -> None:
    run_case(case, scheme)
