"""What the coordinator stores, and the strict reading of it back.

Anything under the prefix may have been written by someone else (an operator with ``etcdctl``,
another program, an attacker with write access to the prefix): every value is read as untrusted.
A value that is not exactly what ``encode_leader`` writes reads as "no valid leader" (``None``,
with a warning naming the key and why), never as an exception, and never as a free slot: a
campaign only creates a key that does not exist.
"""

from __future__ import annotations

import json
import logging
import re

from tensorwire.coordinator.base import InSync, Leader
from tensorwire.logs import event

log = logging.getLogger("tensorwire.coordinator")

FORMAT_VERSION = 1
MAX_VALUE = 4096  # bytes of a leader value: two short strings, and room to spare
MAX_FIELD = 1024  # characters of member or address
MAX_SLOT = 128
MAX_MEMBERS = 16  # members of one in-sync set: a slot's replicas
MAX_INT64 = 2**63 - 2  # int64's top, less one: a watch starts at a revision read plus one
MAX_U64 = 2**64 - 1
_SLOT = re.compile(r"[A-Za-z0-9._-]+")


class BadValue(ValueError):
    """A stored value or field that is not what this module writes; the message says why."""


def check_slot(slot: str) -> str:
    """``slot`` if it is a usable slot name (one key component), else ``ValueError``."""
    if not isinstance(slot, str) or len(slot) > MAX_SLOT or not _SLOT.fullmatch(slot) or slot in {".", ".."}:
        raise ValueError(f"slot name {str(slot)[:64]!r}: 1-{MAX_SLOT} characters of [A-Za-z0-9._-]")
    return slot


def leader_key(prefix: str, slot: str) -> bytes:
    return f"{prefix}/slots/{check_slot(slot)}/leader".encode()


def in_sync_key(prefix: str, slot: str) -> bytes:
    return f"{prefix}/slots/{check_slot(slot)}/in_sync".encode()


def encode_in_sync(members: list[str] | tuple[str, ...]) -> bytes:
    """The in-sync key's value; ``ValueError`` for members ``decode_in_sync`` would refuse."""
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise ValueError(f"an in-sync set has 1-{MAX_MEMBERS} members, not {len(members)}")
    for member in members:
        _check_field("member", member, ValueError)
    doc = {"v": FORMAT_VERSION, "members": list(members)}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def decode_in_sync(key: bytes, value: bytes, mod_revision: int) -> InSync:
    """The in-sync set a stored key holds; one that is not what ``encode_in_sync`` writes reads as
    an empty set (nobody may rely on it to take over), with a warning naming the key and why."""
    revision = check_revision(mod_revision, "mod revision")
    try:
        doc = _json_object(value, ("v", "members"))
        members = doc["members"]
        if not isinstance(members, list) or not 1 <= len(members) <= MAX_MEMBERS:
            raise BadValue(f"members is not a list of 1-{MAX_MEMBERS}")
        for member in members:
            _check_field("member", member, BadValue)
    except BadValue as exc:
        event(
            log, logging.WARNING, "coordinator key holds no valid in-sync set", key=_show(key), why=str(exc)
        )
        return InSync((), revision)
    return InSync(tuple(str(m) for m in members), revision)


def _json_object(value: bytes, fields: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, object]:
    """A stored value as the JSON object of exactly ``fields`` (and our format version), and any
    of ``optional``."""
    if len(value) > MAX_VALUE:
        raise BadValue(f"value is {len(value)} bytes, over {MAX_VALUE}")
    try:
        doc = json.loads(value.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError are ValueErrors
        raise BadValue(f"value is not JSON ({type(exc).__name__})") from exc
    if not isinstance(doc, dict) or not set(fields) <= set(doc) <= {*fields, *optional}:
        also = f" (and {', '.join(optional)})" if optional else ""
        raise BadValue(f"value is not an object of exactly {', '.join(fields)}{also}")
    if type(doc["v"]) is not int or doc["v"] != FORMAT_VERSION:
        raise BadValue(f"value's format version is not {FORMAT_VERSION}")
    return doc


def encode_leader(member: str, address: str, incarnation: int = 0) -> bytes:
    """The leader key's value; ``ValueError`` for fields that ``decode_leader`` would refuse.
    ``incarnation``: the leader's process (its server's random store id; 0: not said)."""
    for name, value in (("member", member), ("address", address)):
        _check_field(name, value, ValueError)
    if not 0 <= incarnation <= MAX_U64:
        raise ValueError(f"incarnation {incarnation} is not a u64")
    doc: dict[str, object] = {"v": FORMAT_VERSION, "member": member, "address": address}
    if incarnation:
        doc["incarnation"] = incarnation
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def decode_leader(value: bytes, create_revision: int, lease: int) -> Leader:
    """The leader a stored key names; ``BadValue`` saying why when it is not one we wrote."""
    epoch = check_revision(create_revision, "create revision")
    if check_int64(lease, "lease") == 0:
        raise BadValue("the key is held by no lease (it would never expire)")
    doc = _json_object(value, ("v", "member", "address"), ("incarnation",))
    for name in ("member", "address"):
        _check_field(name, doc[name], BadValue)
    incarnation = doc.get("incarnation", 0)
    lowest = 1 if "incarnation" in doc else 0  # said: a store id, never 0
    if type(incarnation) is not int or not lowest <= incarnation <= MAX_U64:
        raise BadValue("incarnation is not an integer in 1..2**64-1")
    # member and address: strings, checked just above
    return Leader(str(doc["member"]), str(doc["address"]), epoch, lease, incarnation)


def decode_or_warn(key: bytes, value: bytes, create_revision: int, lease: int) -> Leader | None:
    """``decode_leader``, with a value that is not a leader logged and read as ``None``."""
    try:
        return decode_leader(value, create_revision, lease)
    except BadValue as exc:
        event(log, logging.WARNING, "coordinator key holds no valid leader", key=_show(key), why=str(exc))
        return None


def check_int64(value: object, what: str) -> int:
    """``value`` if it is an int in 0..2**63-2 (what etcd's int64 fields may hold for us)."""
    if type(value) is not int or not 0 <= value <= MAX_INT64:
        raise BadValue(f"{what} {str(value)[:32]} is not an integer in 0..2**63-2")
    return value


def check_revision(value: object, what: str) -> int:
    """``value`` if it is a positive int64 (a revision, a lease id)."""
    number = check_int64(value, what)
    if number == 0:
        raise BadValue(f"{what} is 0")
    return number


def _check_field(name: str, value: object, error: type[ValueError]) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_FIELD or not value.isprintable():
        raise error(f"{name} is not a printable string of 1-{MAX_FIELD} characters")


def _show(key: bytes) -> str:
    return key[:200].decode("utf-8", "replace")
