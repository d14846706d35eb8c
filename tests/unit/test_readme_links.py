"""The README is the front door: every link it makes into the repository (the docs site's pages,
the changelog, images) leads to a file that exists, and every page of the site is one it can reach
through the site's tables of contents (Sphinx checks those: `make docs`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = [t for t in LINK.findall((ROOT / "README.md").read_text()) if "://" not in t]
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_is_a_front_door() -> None:
    """About 200-300 lines: what it is, the two commands, an example, figures, links (issue 36)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move detail into docs/"
