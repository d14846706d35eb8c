"""One version: ``tensorwire.__version__`` says it, pyproject.toml reads it from there,
``tensorwire --version`` prints it, and CHANGELOG.md's newest release is it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from click.testing import CliRunner

import tensorwire
from tensorwire import cli

ROOT = Path(__file__).resolve().parents[2]
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def test_the_package_says_a_semantic_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", tensorwire.__version__)


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tensorwire.__version__"}


def test_tensorwire_version_prints_it_and_how_the_hot_path_runs() -> None:
    result = CliRunner().invoke(cli.main, ["--version"])
    first, second = result.output.strip().splitlines()
    assert result.exit_code == 0 and first == f"tensorwire, version {tensorwire.__version__}"
    assert second.startswith("hot path: ") and ("compiled" in second or "pure Python" in second)


def test_the_changelogs_newest_release_is_the_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = RELEASE.findall(text)
    assert releases, "CHANGELOG.md lists no release (## [X.Y.Z] - YYYY-MM-DD)"
    assert releases[0][0] == tensorwire.__version__
    assert [r[1] for r in releases] == sorted((r[1] for r in releases), reverse=True)  # newest first
    for version, _ in releases:  # each release has its link at the bottom (Keep a Changelog)
        assert re.search(rf"^\[{re.escape(version)}\]: https://", text, re.MULTILINE), version
