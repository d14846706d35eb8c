from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorwire.errors import InvalidName
from tensorwire.wire.names import validate_name, validate_prefix


@pytest.mark.parametrize("name", ["w", "model/layer.0/weight", "emb/größe", "a b", "x" * 1024, "日本/語"])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "/abs", "a//b", "a/", "../x", "a/../../x", "./a", "a/.", "a\\b", "tab\there", "nl\n", "nul\x00",
     "bidi\u202e", "x" * 1025, "é" * 513],
)  # fmt: skip
def test_invalid_names(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_name(name)


def test_prefixes() -> None:
    assert validate_prefix("") == ""
    assert validate_prefix("model/") == "model/"
    with pytest.raises(InvalidName):
        validate_prefix("/etc")
    with pytest.raises(InvalidName):
        validate_prefix("../")


@given(st.text(alphabet="a./", min_size=1, max_size=12))
def test_the_quick_segment_test_agrees_with_the_rule_it_shortcuts(name: str) -> None:
    """Segments that are empty, "." or "..": the substring pre-test may only skip the regex for
    names that have none (split and compare, the rule as written)."""
    bad = any(segment in ("", ".", "..") for segment in name.split("/"))
    try:
        validate_name(name)
    except InvalidName:
        assert bad
    else:
        assert not bad
