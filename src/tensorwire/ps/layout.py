"""Which host serves each slot's primary and backups: replicas of one slot apart, primaries spread.

A slot (one server of the job, ``ps/placement.py``) is a primary and ``replicas`` backups, each a
server process. A backup exists to survive its primary's failure; one on the same host (or, less
badly, in the same rack) fails with it. ``assign`` places the processes of S slots on the given
hosts so that:

* no two replicas of a slot share a host, and, where racks are known, not a rack either, as far as
  the hosts allow (a host first: it is the likelier failure);
* primaries are spread over the hosts (round robin), and backups go to the least-loaded host
  among the best-separated ones, so every host carries about as many processes;
* the same input gives the same layout (ties go to the host after the primary's, in the order
  given).

Where a slot's replicas cannot be kept apart (one host; fewer hosts than replicas), the layout
still places them, and ``Layout.warnings`` says which slot's backup shares what with what, and
what a failure there loses. Nothing here opens a connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorwire.topology import Location, check_label


@dataclass(frozen=True)
class SlotHosts:
    """Where one slot's replicas run: its primary's host, then each backup's."""

    slot: int
    primary: Location
    backups: tuple[Location, ...]


@dataclass
class Layout:
    """Every slot's hosts, and a warning for each backup that shares a host or a rack."""

    slots: list[SlotHosts]
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line per slot (``slot 0: primary h1, backups h2``), then the warnings."""
        lines = []
        for s in self.slots:
            backups = ", ".join(b.describe() for b in s.backups) or "none"
            lines.append(f"slot {s.slot}: primary {s.primary.describe()}, backups {backups}")
        return "\n".join(lines + [f"warning: {w}" for w in self.warnings])

    def as_dict(self) -> dict[str, object]:
        slots = [{"slot": s.slot, "primary": _loc(s.primary), "backups": [_loc(b) for b in s.backups]}
                 for s in self.slots]  # fmt: skip
        return {"slots": slots, "warnings": list(self.warnings)}


def assign(hosts: Sequence[Location], slots: int, replicas: int) -> Layout:
    """Place ``slots`` slots of ``1 + replicas`` processes each on ``hosts`` (each may run any number;
    a host listed twice counts once): see the module doc."""
    unique = list(dict.fromkeys(hosts))
    if not unique:
        raise ValueError("placing servers needs at least one host")
    if slots < 1 or replicas < 0:
        raise ValueError(f"need at least one slot and no negative replicas, not {slots} and {replicas}")
    load = dict.fromkeys(unique, 0)
    layout = Layout([])
    for slot in range(slots):
        first = slot % len(unique)
        chosen = [unique[first]]
        load[unique[first]] += 1
        for _ in range(replicas):
            host = min(unique, key=lambda h: _cost(h, chosen, load, (unique.index(h) - first) % len(unique)))
            chosen.append(host)
            load[host] += 1
        layout.slots.append(SlotHosts(slot, chosen[0], tuple(chosen[1:])))
        layout.warnings.extend(_warnings(slot, chosen))
    return layout


def _cost(
    host: Location, chosen: Sequence[Location], load: dict[Location, int], after: int
) -> tuple[int, ...]:
    """How bad ``host`` is for the next replica of a slot whose replicas are ``chosen``: sharing a
    host, then sharing a known rack, then the host's load, then its distance after the primary's."""
    same_host = sum(host.host == c.host for c in chosen)
    same_rack = sum(_same_rack(host, c) for c in chosen)
    return same_host, same_rack, load[host], after


def _same_rack(a: Location, b: Location) -> bool:
    return a.rack is not None and a.rack == b.rack


def _warnings(slot: int, chosen: Sequence[Location]) -> list[str]:
    """What each backup of a slot shares with a replica placed before it (the first such one)."""
    out = []
    for i, backup in enumerate(chosen[1:], start=1):
        name = "backup" if len(chosen) == 2 else f"backup {i}"
        for j, earlier in enumerate(chosen[:i]):
            whom = "its primary" if j == 0 else f"backup {j}"
            if backup.host == earlier.host:
                out.append(f"slot {slot}'s {name} is on the same host as {whom} (host {backup.host}): "
                           "a host failure loses both")  # fmt: skip
                break
            if _same_rack(backup, earlier):
                out.append(f"slot {slot}'s {name} is in the same rack as {whom} (rack {backup.rack}): "
                           "a rack failure loses both")  # fmt: skip
                break
    return out


def parse_hosts(hosts: str, racks: str | None = None) -> list[Location]:
    """``h1,h2,h3`` (and ``r1,r1,r2``, one rack per host) as Locations; ValueError if malformed."""
    names = [check_label(h.strip(), "a host") for h in hosts.split(",")]
    if racks is None:
        return [Location(n) for n in names]
    labels = [check_label(r.strip(), "a rack") for r in racks.split(",")]
    if len(labels) != len(names):
        raise ValueError(f"{len(names)} hosts but {len(labels)} racks: give one rack per host")
    return [Location(n, r) for n, r in zip(names, labels, strict=True)]


def _loc(where: Location) -> dict[str, str | None]:
    return {"host": where.host, "rack": where.rack}


__all__ = ["Layout", "SlotHosts", "assign", "parse_hosts"]
