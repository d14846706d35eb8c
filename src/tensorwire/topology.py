"""Where a process runs: its host, its rack, and whether another process can share its memory.

``here()`` reads the labels when it is called (never at import): the host from ``TENSORWIRE_HOST``
(Kubernetes sets it to the node name through the downward API) else the machine's hostname; the
rack from ``TENSORWIRE_RACK`` (or ``--rack``), unknown when unset. ``host_identity(shm_dir)`` is a
number that differs between processes that cannot share memory segments: two containers on one
node with private ``/dev/shm`` mounts get different ones, since the directory's device and inode
are part of it. Equal identities are a reason to *try* ``shm://`` (which still proves it with
SHM_ATTACH), never a proof.

Labels a peer sends are checked like every other peer field (``check_label``): at most
``MAX_LABEL_BYTES`` of printable ASCII without spaces.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

HOST_ENV = "TENSORWIRE_HOST"  # this process's host label (default: the hostname)
RACK_ENV = "TENSORWIRE_RACK"  # its rack label (default: unknown)
# Replaces the computed host identity: processes with the same value are taken to be able to share
# memory (shm:// still proves it). For setups the computation gets wrong, and for tests.
HOST_ID_ENV = "TENSORWIRE_HOST_ID"
MAX_LABEL_BYTES = 255  # a Kubernetes node name is at most 253
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True, slots=True)
class Location:
    """Where a process runs: its host label and, when known, its rack."""

    host: str
    rack: str | None = None

    def describe(self) -> str:
        """``host`` or ``host (rack r1)``, for messages."""
        return self.host if self.rack is None else f"{self.host} (rack {self.rack})"


def check_label(value: str, what: str) -> str:
    """``value`` if it is a usable host or rack label; else ValueError naming ``what``."""
    if not value or len(value) > MAX_LABEL_BYTES:
        raise ValueError(f"{what} must be 1 to {MAX_LABEL_BYTES} characters, not {len(value)}")
    if not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise ValueError(f"{what} must be printable ASCII without spaces: {value[:64]!r}")
    return value


def here(rack: str | None = None) -> Location:
    """This process's location, read now: ``rack`` (a ``--rack`` option) wins over the variable."""
    host = os.environ.get(HOST_ENV) or socket.gethostname() or "localhost"
    rack = rack or os.environ.get(RACK_ENV) or None
    return Location(check_label(host, HOST_ENV), check_label(rack, RACK_ENV) if rack else None)


def host_identity(shm_dir: Path) -> int:
    """A non-zero number equal for processes that may share segments in ``shm_dir`` (see the module
    doc): a digest of the host label, the kernel's boot id and the directory's device and inode."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return _digest(override.encode())
    try:
        boot = _BOOT_ID.read_bytes().strip()
    except OSError:  # not Linux, or no /proc: the hostname alone must do
        boot = b""
    try:
        st = os.stat(shm_dir)
        where = f"{st.st_dev}:{st.st_ino}".encode()
    except OSError:  # no such directory: nothing to share there anyway
        where = b"-"
    host = (os.environ.get(HOST_ENV) or socket.gethostname()).encode()
    return _digest(b"\0".join((host, boot, where)))


def _digest(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") or 1


__all__ = [
    "HOST_ENV",
    "HOST_ID_ENV",
    "MAX_LABEL_BYTES",
    "RACK_ENV",
    "Location",
    "check_label",
    "here",
    "host_identity",
]
