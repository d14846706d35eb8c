"""Which host serves each slot's primary and backups (``ps/layout.py``): replicas of a slot on
different hosts (and racks, when known), primaries spread, the same layout for the same input, and
a warning for every slot whose replicas the hosts cannot keep apart."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from tensorwire import cli, topology
from tensorwire.ps.layout import assign, parse_hosts
from tensorwire.ps.server.replication import Backups
from tensorwire.security import Security
from tensorwire.topology import Location
from tensorwire.wire import meta as wm

H1, H2, H3 = Location("h1"), Location("h2"), Location("h3")


def test_two_hosts_keep_every_slots_primary_and_backup_apart() -> None:
    layout = assign([H1, H2], slots=3, replicas=1)
    assert not layout.warnings
    for s in layout.slots:
        assert s.backups[0].host != s.primary.host
    primaries = [s.primary.host for s in layout.slots]
    assert primaries == ["h1", "h2", "h1"]  # spread, round robin
    per_host = [h for s in layout.slots for h in (s.primary.host, s.backups[0].host)]
    assert per_host.count("h1") == per_host.count("h2") == 3  # balanced


def test_backups_go_to_another_rack_when_there_is_one() -> None:
    hosts = parse_hosts("h1,h2,h3", "r1,r1,r2")
    layout = assign(hosts, slots=3, replicas=1)
    assert not layout.warnings
    for s in layout.slots:
        assert s.backups[0].rack != s.primary.rack
        assert s.backups[0].host != s.primary.host


def test_a_rack_shared_only_when_no_other_rack_is_left() -> None:
    hosts = parse_hosts("h1,h2,h3", "r1,r1,r2")
    layout = assign(hosts, slots=1, replicas=2)  # 3 replicas, 2 racks: one pair must share
    s = layout.slots[0]
    assert len({s.primary.host, *(b.host for b in s.backups)}) == 3
    assert layout.warnings == ["slot 0's backup 2 is in the same rack as its primary (rack r1): "
                               "a rack failure loses both"]  # fmt: skip


def test_one_host_warns_for_every_slot() -> None:
    layout = assign([H1], slots=3, replicas=1)
    assert layout.warnings == [
        f"slot {i}'s backup is on the same host as its primary (host h1): a host failure loses both"
        for i in range(3)
    ]
    assert all(s.primary == s.backups[0] == H1 for s in layout.slots)


def test_the_same_input_gives_the_same_layout() -> None:
    hosts = parse_hosts("a,b,c,d", "x,y,x,y")
    assert assign(hosts, 5, 2) == assign(list(hosts), 5, 2)
    assert assign([H1, H2, H1], 2, 1) == assign([H1, H2], 2, 1)  # a host listed twice counts once


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="one rack per host"):
        parse_hosts("h1,h2", "r1")
    with pytest.raises(ValueError, match="printable ASCII"):
        parse_hosts("h 1")
    with pytest.raises(ValueError, match="at least one host"):
        assign([], 1, 1)


def test_ps_plan_shows_the_hosts_and_the_warning(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(model))
    base = ["ps", "plan", str(model), "--servers", "2"]
    plain = CliRunner().invoke(cli.main, base)
    assert plain.exit_code == 0 and "slot 0" not in plain.output  # the model's placement, as before
    spread = CliRunner().invoke(cli.main, [*base, "--replicas", "1", "--hosts", "h1,h2"])
    assert spread.exit_code == 0, spread.output
    assert "slot 0: primary h1, backups h2" in spread.output and "warning" not in spread.output
    one = CliRunner().invoke(cli.main, [*base, "--replicas", "1", "--hosts", "h1", "--json"])
    doc = json.loads(one.output)
    assert doc["format"] == "tensorwire.placement"
    assert doc["hosts"]["slots"][1] == {"slot": 1, "primary": {"host": "h1", "rack": None},
                                        "backups": [{"host": "h1", "rack": None}]}  # fmt: skip
    assert len(doc["hosts"]["warnings"]) == 2


def test_a_backup_on_the_primarys_host_is_warned_once_and_shown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(topology.HOST_ENV, "h1")
    backups = Backups(["tcp://b:1"], Security(None, "peer-secret"))
    backup = backups.backups["tcp://b:1"]
    elsewhere = topology.host_identity(Path("/nonexistent")) + 1
    backups._check_host(backup, wm.Whereabouts("h2", "", elsewhere, ""))
    assert backup.same_host is None
    caplog.set_level(logging.WARNING, "tensorwire.ps.replication")
    for _ in range(2):
        backups._check_host(backup, wm.Whereabouts("h1", "", elsewhere, ""))
    assert backup.same_host == "h1"
    assert caplog.text.count("backup on the primary's host") == 1
    backups._check_host(backup, None)  # a backup from before HELLO's location: not judged
    assert backup.same_host is None
