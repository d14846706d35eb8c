"""docs/reference/errors.md has a section for every exception tensorwire defines, and says rightly
whether each is retryable.

The classes are found in the source (every class in ``src/`` that derives, directly or through
others, from ``tensorwire.errors.TensorwireError``), so an exception added anywhere, in
``errors.py`` or beside the code that raises it (``tensorwire.ray``'s, say), needs its section. Each
section is a ``### ClassName`` heading whose text says ``**Retryable: yes.**`` or ``**Retryable:
no.**``; for the classes of ``tensorwire.errors`` that must match the class's ``retryable``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import tensorwire.errors

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "tensorwire"
PAGE = ROOT / "docs" / "reference" / "errors.md"
HEADING = re.compile(r"^### (\w+)\s*$", re.MULTILINE)
RETRYABLE = re.compile(r"\*\*Retryable: (yes|no)\.?\*\*")


def _base_names(node: ast.ClassDef) -> set[str]:
    names = set()
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


@functools.cache
def defined_errors() -> frozenset[str]:
    """Every public class in src/ that is a TensorwireError (by the names of its bases)."""
    classes = [
        node
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    ]
    errors = {"TensorwireError"}
    grew = True
    while grew:  # a class whose base is an error is an error; repeat until nothing is added
        grew = False
        for node in classes:
            if node.name not in errors and _base_names(node) & errors:
                errors.add(node.name)
                grew = True
    return frozenset(name for name in errors if not name.startswith("_"))


def sections() -> dict[str, str]:
    """The page's ``### Name`` sections: name -> its text up to the next heading."""
    text = PAGE.read_text()
    found: dict[str, str] = {}
    matches = list(HEADING.finditer(text))
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following is not None else len(text)
        found[match.group(1)] = text[match.end() : end]
    return found


def test_the_scan_finds_errors_inside_and_outside_errors_py() -> None:
    found = defined_errors()
    module = {
        name
        for name, cls in vars(tensorwire.errors).items()
        if inspect.isclass(cls) and issubclass(cls, tensorwire.errors.TensorwireError)
    }
    assert module <= found
    assert {"SenderUnreachable", "ObjectNotFound", "InvalidMetadata", "UploadBusy"} <= found


def test_every_error_has_a_section() -> None:
    missing = sorted(defined_errors() - set(sections()))
    assert not missing, f"docs/reference/errors.md has no '### Name' section for {missing}"


def test_every_section_is_an_error() -> None:
    stale = sorted(set(sections()) - defined_errors())
    assert not stale, f"docs/reference/errors.md has sections for classes src does not define: {stale}"


def test_each_section_says_whether_it_is_retryable_as_the_class_does() -> None:
    for name, text in sections().items():
        said = RETRYABLE.findall(text)
        assert len(said) == 1, f"the section {name} must say **Retryable: yes.** or **Retryable: no.** once"
        cls = getattr(tensorwire.errors, name, None)
        if cls is not None:
            assert (said[0] == "yes") == cls.retryable, (
                f"{name}.retryable is {cls.retryable}, the page says {said[0]}"
            )


def test_the_tree_names_every_error() -> None:
    tree = PAGE.read_text().split("```text", 1)[1].split("```", 1)[0]
    missing = sorted(name for name in defined_errors() if not re.search(rf"\b{name}\b", tree))
    assert not missing, f"the tree in docs/reference/errors.md lacks {missing}"
