"""Strings a peer chose, made safe to show on a terminal.

Tensor names, error messages, STATUS fields and data set names come from servers (or from the
clients that named the tensors). Printed as they are, an escape sequence in one can rewrite the
screen, retitle the terminal or hide lines, and rich markup in one (``[red]``, ``[link=file://...]``)
is interpreted by every rich table, progress bar and ``console.print``. So a peer's string goes
through ``printable`` before it is echoed, and through ``markup`` before rich renders it.
"""

from __future__ import annotations

from rich.markup import escape

MAX_SHOWN = 4096  # characters of one peer string shown (an error message is at most 4096 bytes)


def printable(value: object, limit: int = MAX_SHOWN) -> str:
    """``value`` as text in which every control or format character (ESC, CR, BEL, bidi overrides,
    zero-width ones...) is shown as its escape (``\\x1b``, ``\\u202e``); cut at ``limit`` characters.
    Newlines and tabs are escaped too: one peer string is one line."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    # isprintable() is False for every "Other" (control, format, surrogate, unassigned) and
    # "Separator" character but the space: exactly what must not reach a terminal raw.
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def markup(value: object, limit: int = MAX_SHOWN) -> str:
    """``printable(value)`` with rich markup escaped: for table cells and ``console.print``."""
    return escape(printable(value, limit))


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
