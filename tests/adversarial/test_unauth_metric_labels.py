"""A peer cannot add metric series (issue 13, item 12).

2,000 token-less gRPC calls to made-up method names used to add a ``tensorwire_requests_total``
series (and three more families) per name, for good: 16 MiB of metrics. Labels now come from
fixed sets; a method outside the known table is "unknown". Checked by scraping a real server's
metrics endpoint after hundreds of calls to made-up methods, with and without the token.
"""

from __future__ import annotations

import urllib.request

import grpc

from tensorwire.ps import ParamServer
from tensorwire.server import ServerThread, metrics
from tensorwire.server.options import MetricsOptions, ServerOptions

TOKEN = "metric-label-token"
KNOWN_OPS = {"put", "get", "delete", "stat", "list", "ping", "allreduce", "unknown"}


def call_made_up_methods(target: str, count: int, token: str | None) -> set[grpc.StatusCode]:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    codes = set()
    with grpc.insecure_channel(target) as channel:
        for i in range(count):
            call = channel.unary_unary(f"/evil{i}.Service/Method{i}", None, None)
            try:
                call(b"", timeout=10, metadata=metadata)
            except grpc.RpcError as exc:
                codes.add(exc.code())
    return codes


def test_made_up_grpc_methods_add_no_metric_series() -> None:
    with ServerThread(
        ["grpc://127.0.0.1:0"],
        ServerOptions(token=TOKEN, metrics=MetricsOptions(port=0)),
        extensions=[ParamServer()],
    ) as srv:
        target = srv.url.removeprefix("grpc://")
        assert call_made_up_methods(target, 300, None) == {grpc.StatusCode.UNAUTHENTICATED}
        assert call_made_up_methods(target, 100, TOKEN) == {grpc.StatusCode.UNIMPLEMENTED}
        exporter = srv.server.exporter
        assert exporter is not None
        with urllib.request.urlopen(exporter.url, timeout=10) as answer:
            samples = metrics.parse(answer.read().decode())
    ops = {labels["op"] for name, rows in samples.items() for labels, _ in rows if "op" in labels}
    assert ops <= KNOWN_OPS, f"labels a peer chose: {sorted(ops - KNOWN_OPS)[:5]}"
    requests = samples["tensorwire_requests_total"]
    assert len(requests) <= len(KNOWN_OPS), f"{len(requests)} series of tensorwire_requests_total"
    unknown = sum(v for labels, v in requests if labels["op"] == "unknown")
    assert unknown == 100  # the authenticated calls to methods nobody serves, counted as one row
    refused = {labels["reason"]: v for labels, v in samples["tensorwire_connections_refused_total"]}
    assert refused.get("auth") == 300
