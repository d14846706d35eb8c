"""Tensor name rules. Names are keys, and with a data directory they are kept on disk, so a name
may never escape its namespace or smuggle control characters into logs and terminals."""

from __future__ import annotations

import re

from tensorwire.errors import InvalidName

MAX_NAME_BYTES = 1024
# A "/"-separated segment that is empty, "." or "..": one regex search instead of a split and a loop.
_BAD_SEGMENT = re.compile(r"(?:^|/)\.{0,2}(?:/|$)")


def validate_name(name: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    """Return ``name`` if it is a valid tensor name, else raise InvalidName saying why.

    Valid: 1..max_bytes UTF-8 bytes; printable characters only (no control or format characters);
    "/"-separated segments that are neither empty nor "." or ".."; no backslash.
    """
    if not isinstance(name, str) or not name:
        raise InvalidName("tensor name must be a non-empty string")
    if len(name) * 4 > max_bytes:  # only a name this long can exceed the bound (4 bytes a char at most)
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise InvalidName(f"tensor name of {size} bytes exceeds {max_bytes}")
    # isprintable() is False for control, format, surrogate, unassigned and non-space separators.
    if not name.isprintable() or "\\" in name:
        bad = next(ch for ch in name if not ch.isprintable() or ch == "\\")
        raise InvalidName(f"tensor name {name[:80]!r} contains the forbidden character {bad!r}")
    # Only a name that starts with "." or "/", ends with "/", or holds "//" or "/." can have such a
    # segment: four substring tests, a quarter of the regex's time, clear the names that cannot.
    suspect = name[0] in "./" or name[-1] == "/" or "//" in name or "/." in name
    if suspect and _BAD_SEGMENT.search(name):
        raise InvalidName(f"tensor name {name[:80]!r} has an empty, '.' or '..' path segment")
    return name


def validate_prefix(prefix: str, max_bytes: int = MAX_NAME_BYTES) -> str:
    """A listing prefix: empty, or the start of a valid name (it may end in "/")."""
    if prefix:
        validate_name(prefix.rstrip("/") or "x", max_bytes)
        if prefix.startswith("/"):
            raise InvalidName("a prefix cannot start with '/'")
    return prefix
