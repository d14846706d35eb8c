"""docs/reference/configuration.md lists every environment variable the code reads, and nothing else.

Every ``TENSORWIRE_*`` name written anywhere in ``src/`` (a constant, a help text, a docstring)
must be on the page, and every ``TENSORWIRE_*`` name on the page must be in ``src/``: so a new
variable cannot go undocumented, and a removed one cannot stay documented. A name that ends in
``_`` (``TENSORWIRE_TLS_*`` in a docstring) is a family, not a variable: it stands for the names
that start with it, each of which is checked on its own. The standard variables the code reads by
name (``RANK``, ``MASTER_ADDR``, ...) must be on the page too.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "tensorwire"
PAGE = ROOT / "docs" / "reference" / "configuration.md"
NAME = re.compile(r"\bTENSORWIRE_[A-Z0-9_]*[A-Z0-9_]")
# A process variable read by its own name (not a WSGI request's environ): os.environ.get("X"),
# os.environ["X"] (not assigned to), env_int("X", ...)
READ = re.compile(
    r"""(?:os\.environ\.get\(\s*|os\.environ\[\s*|env_int\(\s*)["']([A-Z][A-Z0-9_]*)["'](?!\]\s*=[^=])"""
)


def _sources() -> list[str]:
    return [path.read_text() for path in sorted(SRC.rglob("*.py"))]


def _split(names: set[str]) -> tuple[set[str], set[str]]:
    """(variables, families): a name ending in ``_`` is a family (a prefix)."""
    return {n for n in names if not n.endswith("_")}, {n for n in names if n.endswith("_")}


def _in_src() -> set[str]:
    return {m.group(0) for text in _sources() for m in NAME.finditer(text)}


def _on_page() -> set[str]:
    return {m.group(0) for m in NAME.finditer(PAGE.read_text())}


def test_the_scan_finds_the_variables() -> None:
    variables, families = _split(_in_src())
    assert {"TENSORWIRE_TOKEN", "TENSORWIRE_SERVERS", "TENSORWIRE_RDMA_PROTOCOL"} <= variables
    assert families == {"TENSORWIRE_TLS_"}, "a new family of names: check its members are on the page"


def test_every_variable_in_src_is_on_the_page() -> None:
    variables, families = _split(_in_src())
    missing = sorted(variables - _on_page())
    assert not missing, f"docs/reference/configuration.md lacks {missing}"
    for family in families:  # a family stands for its members, each of which must be a variable
        assert any(v.startswith(family) for v in variables), f"{family}* names no variable in src"


def test_every_variable_on_the_page_is_in_src() -> None:
    variables, families = _split(_on_page())
    in_src = _in_src()
    stale = sorted(variables - in_src)
    assert not stale, f"docs/reference/configuration.md names variables the code never reads: {stale}"
    for family in families:
        members = [v for v in in_src if v.startswith(family) and not v.endswith("_")]
        assert members, f"{family}* is in no name in src"


def test_standard_variables_read_by_name_are_on_the_page() -> None:
    read = {m.group(1) for text in _sources() for m in READ.finditer(text)}
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= read  # the scan still sees them
    page = PAGE.read_text()
    missing = sorted(name for name in read if not re.search(rf"`{name}`", page))
    assert not missing, f"docs/reference/configuration.md lacks {missing}"
