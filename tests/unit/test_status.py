"""`tensorwire status`' pieces that need no server: URL lists, and rows from scraped metrics alone."""

from __future__ import annotations

from rich.console import Console

from tensorwire.cli import status
from tensorwire.server import metrics


def test_urls_are_split_normalised_and_deduplicated() -> None:
    got = status.split_urls(["a:1|tcp://b:2", "a:1,http://x:9/metrics", " grpc://c:3 "])
    assert got == ["tcp://a:1", "tcp://b:2", "http://x:9/metrics", "grpc://c:3"]


def test_a_row_from_metrics_alone_and_a_down_row() -> None:
    page = "\n".join([
        "# TYPE tensorwire_ps_role gauge", 'tensorwire_ps_role{role="backup"} 1',
        "# TYPE tensorwire_ps_epoch gauge", "tensorwire_ps_epoch 3",
        "# TYPE tensorwire_ps_shards gauge", "tensorwire_ps_shards 4",
        "# TYPE tensorwire_ps_primary_silence_seconds gauge", "tensorwire_ps_primary_silence_seconds 0.25",
        "# TYPE tensorwire_store_bytes gauge", "tensorwire_store_bytes 2048",
        "# TYPE tensorwire_server_info gauge", 'tensorwire_server_info{addresses="grpc://h:1",version="0"} 1',
    ]) + "\n"  # fmt: skip
    scraped = status.Node("http://h:9/metrics", samples=metrics.parse(page))
    grpc = status.Node("grpc://h:1", answered=True)
    down = status.Node("tcp://h:2", error="cannot connect")
    nodes = status._merge([grpc, scraped, down])
    assert nodes == [grpc, down] and grpc.metrics_url == "http://h:9/metrics"  # the page is grpc's
    row = status.summary(grpc)
    assert row["role"] == "backup @3" and row["shards"] == 4 and row["stored"] == 2048
    assert row["lag"] == "primary 0.2s ago"
    console = Console(width=200, record=True)
    console.print(status.render(nodes))
    text = console.export_text()
    assert "1 of 2 servers up" in text and "down" in text and "cannot connect" in text and "backup @3" in text


def test_a_slot_led_by_etcd_shows_its_name_and_when_it_is_down() -> None:
    """``ps serve --coordinator``: the row says the slot, and a slot that has no primary and whose
    replica may not take over (STATUS, or the metric alone), or a primary under the failsafe."""

    def ps(**coordinator: object) -> dict[str, object]:
        return {"ps": {"role": "backup", "epoch": 7, "coordinator": {"slot": "slot0", **coordinator}}}

    assert status.summary(status.Node("tcp://a:1", status=ps(down=None)))["role"] == "backup @7 slot slot0"
    down = status.summary(status.Node("tcp://a:1", status=ps(down="not in the in-sync set")))
    assert down["role"] == "backup @7 slot slot0, DOWN: no up-to-date replica"
    failsafe = {"ps": {"role": "primary", "epoch": 9, "coordinator": {"slot": "s", "failsafe": True}}}
    assert status.summary(status.Node("tcp://a:1", status=failsafe))["role"] == "primary @9 slot s, failsafe"
    page = '# TYPE tensorwire_ps_role gauge\ntensorwire_ps_role{role="backup"} 1\n'
    page += "# TYPE tensorwire_ps_slot_down gauge\ntensorwire_ps_slot_down 1\n"
    scraped = status.Node("tcp://b:1", samples=metrics.parse(page))
    assert status.summary(scraped)["role"].endswith("slot, DOWN: no up-to-date replica")
    garbage = {"ps": {"role": "backup", "epoch": 1, "coordinator": {"slot": ["x"], "down": 5}}}
    assert status.summary(status.Node("tcp://c:1", status=garbage))["role"] == "backup @1"
