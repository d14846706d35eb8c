"""Shared tokens: a secret read from a file or from ``$TENSORWIRE_TOKEN``, sent by a client in its
HELLO or gRPC metadata, and checked by a server in constant time (``tokens_match``)."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from tensorwire.wire.meta import MAX_TOKEN_BYTES

__all__ = [
    "MAX_TOKEN_BYTES",
    "TOKEN_ENV",
    "client_token",
    "load_token",
    "tokens_match",
    "write_token_file",
]

# The package's logger name, kept from when this was one module (log filters name it).
log = logging.getLogger("tensorwire.security")

TOKEN_ENV = "TENSORWIRE_TOKEN"

# A token file is read with this bound so that pointing --token-file at a large file (a log, a
# device) fails fast instead of reading it all; the token itself must still fit MAX_TOKEN_BYTES.
_MAX_TOKEN_FILE_BYTES = 64 * 1024


def load_token(path: Path) -> str:
    """The token in ``path``, surrounding whitespace stripped.

    Refuses (``ValueError``) an empty token, one over ``MAX_TOKEN_BYTES``, or one with characters
    outside printable ASCII. Logs a warning when the file is readable by group or others.
    """
    with open(path, "rb") as f:
        _warn_if_shared(path, os.fstat(f.fileno()).st_mode)
        raw = f.read(_MAX_TOKEN_FILE_BYTES + 1)
    if len(raw) > _MAX_TOKEN_FILE_BYTES:
        raise ValueError(
            f"token file {path} is larger than {_MAX_TOKEN_FILE_BYTES} bytes; is it a token file?"
        )
    token = raw.strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"token in {path} is {len(token)} bytes; at most {MAX_TOKEN_BYTES} are allowed")
    # Printable ASCII only: the token travels in headers/metadata and is compared byte for byte, so
    # an invisible or non-ASCII character would make two "equal-looking" tokens differ.
    if not all(0x20 <= b <= 0x7E for b in token):
        raise ValueError(f"token in {path} has characters outside printable ASCII")
    return token.decode("ascii")


def _warn_if_shared(path: Path, mode: int) -> None:
    if os.name == "nt":  # POSIX mode bits say nothing about Windows ACLs
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "token file %s is readable by group or others (mode %o); chmod 600 it", path, mode & 0o777
        )


def write_token_file(path: Path, token: str | None = None) -> Path:
    """``token`` (default: a fresh random one, 256 bits, printable) in a new file ``path``, mode
    0600 from the start; never an existing file or a symlink (FileExistsError). For scripts and
    tests that start servers: ``serve --token-file``, ``--peer-token-file``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        f.write(secrets.token_urlsafe(32) if token is None else token)
    return Path(path)


def client_token(token: str | None) -> str | None:
    """``token`` if given, else ``$TENSORWIRE_TOKEN`` when set and non-empty, else ``None``."""
    if token:
        return token
    return os.environ.get(TOKEN_ENV) or None


def tokens_match(expected: str, offered: str | None) -> bool:
    """Whether ``offered`` equals ``expected``, in time independent of where they differ.

    ``None`` never matches, and neither does anything when ``expected`` is empty: an unset secret
    must fail closed rather than admit a client that sends an empty token.
    """
    if offered is None or not expected:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), offered.encode("utf-8"))
