"""One origin, many readers: what it costs to bring a model's state_dict to N processes (issue 17).

The topology: an origin namespace running a ``tensorwire serve`` store and N reader namespaces
(``bench/netns.py``), each link shaped to ``--rate`` Gb/s both ways (tc tbf), every reader a
process of its own. The state_dict is ``--size`` bytes in ``--tensors`` tensors laid out like a
transformer's (``layout``: bf16 projections and embedding, an fp32 output head and norms), made
from a seed and published on the origin by a publisher process inside the origin's namespace (on
loopback, by this process) as generation 1 of the prefix ``model`` (``client.publish``).

Each measurement is a *mode*: a function in ``MODES`` that takes the ``Harness`` (the origin's URL,
the reader processes, the origin's byte counter) and returns its keys. The readers are started
once, with the origin, one process per reader namespace; a mode runs a round of them
(``Harness.run_readers(way, count)``) with a *reader way* from ``READERS``, chosen by name in the
round's job: every reader taking part fills preallocated (and touched) tensors between a common
go and its end, then hashes each tensor; the harness compares every reader's hashes with the
published ones and fails the bench on any difference. A new mode is a function in ``MODES`` and,
where its readers do something new (receive from the relay, say), a reader way in ``READERS``
(``broadcast_readers.py``: the state_dict, the publisher and the reader processes;
``broadcast_publishers.py``: running the publishers where the origin is; ``broadcast_harness.py``:
the origin, the readers and their rounds).
The modes measured today:

* ``single``: one reader fetches the whole state_dict from the origin with ``get_many(out=...)``:
  ``single_s``.
* ``star``: N readers at once, each from the origin: ``star_s``, ``star_vs_single`` (~N when the
  origin's link is the bound).
* ``delta``: the next generation is published, in which 1% of the elements of every tensor have
  new values at random positions (bf16 and fp32, seeded); one reader that holds the previous one
  reads it with ``base=`` (deltas per chunk, applied in place): ``delta_s``, ``delta_bytes`` and
  ``delta_bytes_ratio`` (/ model bytes; target <= 0.05), with ``delta_bytes_source`` saying what
  counted them: the origin's link (veth tx bytes, TCP/IP headers included) in namespaces, the
  reader client's ``DeltaStats.wire_bytes`` (answer data, no frame headers) on loopback.
* ``fanout``: N readers at once, each a ``tensorwire.broadcast.Subscriber`` whose relay server
  listens on its namespace's address (the address it reaches the origin from), so the readers feed
  each other along the origin's chains: ``fanout_s``, ``fanout_vs_single`` (target <= 1.3) and
  ``origin_egress_ratio["fanout"]`` (target <= 1.1).
* ``mixed``: a publisher in the origin's namespace publishes a new generation every
  ``--publish-every`` seconds (default: twice the model's time on a link; 0.05 s on loopback),
  every byte of the k-th set from k and k in each tensor's first 8 bytes, while the N readers read
  each new generation through the relay (``wait_and_update``) for ``--mixed-seconds``: ``reads``,
  ``mixed_reads`` (reads whose bytes differ from what was published as the generation the read
  returned, or whose tensors carry two generations' tags; target 0), ``mixed_failed_updates``
  (updates that raised, by error: a generation retired under a slow read, say; their tensors are
  not counted as reads, as the Subscriber documents) and ``mixed_generations``.
* ``killed``: a fanout round in which the last reader stops pulling after its first verified
  chunk (its progress callback says so and blocks: a process frozen mid-relay); the others join
  only then, strung behind it, and once one of them has received a chunk the victim is kill -9'd.
  The others must finish bit-exact: ``killed_reader_ok`` (``killed_error`` when not), and
  ``killed_routed_around`` (RELAY_STATS ``dropped``: readers the origin took out of the chain).
  The killed reader is started again when a later round needs it.

Every mode but ``delta``, ``mixed`` and ``killed`` also gives ``bound_s[mode]`` (the physical
bound: model bytes / link rate, N times that for star, all of it through the origin's link) and,
in namespaces, ``origin_egress_bytes[mode]`` and ``origin_egress_ratio[mode]`` (bytes the origin's
link sent, from its veth counters, / model bytes; TCP/IP headers make 1.0 about 1.05). Modes not
asked for (``--modes``) are listed in ``not_measured``, never given a number.

Where namespaces cannot be made the bench exits 0 with ``skipped`` and the reason. ``--no-netns``
runs the same modes on 127.0.0.1 without shaping (``"network": "loopback"``; every process shares
this machine's cores, so the figures are CPU-bound, and there is no origin link to count).

Run: ``tensorwire bench broadcast [--json] [--readers 8] [--size 256MiB] [--rate 1] [--modes ...]
[--mixed-seconds 30] [--no-netns]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tensorwire.bench.broadcast_harness import Harness, Round, Setup, harness
from tensorwire.bench.broadcast_publishers import publishing
from tensorwire.bench.broadcast_readers import CHANGED_SHARE, STOP_TIMEOUT, Layout, layout, model_bytes
from tensorwire.bench.netns import Unavailable
from tensorwire.bench.report import show, table
from tensorwire.bench.transfer import parse_size

LOOPBACK_EVERY = 0.05  # mixed, on loopback: seconds between publishes (a tiny model's read is ms)


# -- the modes --------------------------------------------------------------------------------------
Mode = Callable[[Harness], dict[str, Any]]


def single(h: Harness) -> dict[str, Any]:
    """One reader fetches the whole state_dict from the origin."""
    r = h.run_readers("origin", 1)
    return {"single_s": r.seconds, **_per_mode(h, "single", r, copies=1)}


def star(h: Harness) -> dict[str, Any]:
    """Every reader at once, each from the origin: the origin's link carries N copies."""
    r = h.run_readers("origin", h.setup.readers)
    return {"star_s": r.seconds, "star_reader_s": r.reader_s, **_per_mode(h, "star", r, h.setup.readers)}


def delta(h: Harness) -> dict[str, Any]:
    """The next generation (1% of every tensor's elements changed) read by one reader that holds
    the previous one, as per-chunk deltas: the bytes that moved, / the model's."""
    base = h.generation
    at = h.next_generation()
    r = h.run_readers("delta", 1, at=at, base=base)
    info = r.info[0]
    moved, source = (
        info["wire_bytes"],
        "client DeltaStats.wire_bytes (answer data bytes; no frame or TCP headers)",
    )
    if r.egress is not None:
        moved, source = (
            r.egress,
            "origin egress (veth tx bytes of the origin's link, TCP/IP headers included)",
        )
    return {
        "delta_s": r.seconds,
        "delta_bytes": moved,
        "delta_bytes_ratio": moved / h.model_bytes,
        "delta_bytes_source": source,
        "delta_changed_share": CHANGED_SHARE,
        "delta_chunks": {k: info[k] for k in ("delta_chunks", "full_chunks", "refetched")},
    }


def fanout(h: Harness) -> dict[str, Any]:
    """Every reader at once through the relay (``Subscriber.update``): the origin sends the model
    about once, the readers forward it along their chains."""
    r = h.run_readers("relay", h.setup.readers)
    return {
        "fanout_s": r.seconds,
        "fanout_reader_s": r.reader_s,
        # with the span, what the readers asked of this machine's cores (not the origin's, nor the kernel's)
        "fanout_reader_cpu_s": r.cpu_s,
        **_per_mode(h, "fanout", r, copies=1),
    }


def mixed(h: Harness) -> dict[str, Any]:
    """A publisher publishing generation after generation (each tensor's bytes tagged with the
    generation, ``broadcast_readers.fill``) while every reader reads each new one through the relay
    for ``mixed_seconds``: a read is mixed if its bytes differ from what was published as the
    generation it returned, or its tensors carry two generations' tags."""
    log = h.folder / f"published-loop-{h.rounds + 1}.jsonl"
    every = h.setup.publish_every
    if every is None:  # a read that takes up to twice the link time is never retired under it
        every = 2 * h.model_bytes * 8 / (h.setup.rate_gbit * 1e9) if h.setup.netns else LOOPBACK_EVERY
    with publishing(h.origin_wrapper, h.spec, log, every, h.setup.timeout):
        r = h.run_readers("mixed", h.setup.readers, check=False, mixed_seconds=h.setup.mixed_seconds)
    published = {p["generation"]: p for p in map(json.loads, log.read_text().splitlines())}
    last = published[max(published)]
    h.generation, h.expected = last["generation"], last["digests"]  # the newest, for the modes after
    reads = [read for info in r.info for read in info["reads"]]
    return {
        "mixed_reads": len(mixed_reads(published, reads)),
        "reads": len(reads),
        "mixed_failed_updates": _kinds(f for info in r.info for f in info["failed"]),
        "mixed_generations": len(published),
        "mixed_s": r.seconds,
    }


def killed(h: Harness) -> dict[str, Any]:
    """A fanout round in which the last reader is kill -9'd mid-relay: once it has verified a chunk
    (it stops pulling there, as a process frozen mid-relay) and one of the others, strung behind
    it, has received a chunk (from it: ``broadcast_readers.through_relay``). The others must finish
    bit-exact; their times include waiting for the victim's first chunk."""
    n = h.setup.readers
    victim = n - 1
    started = h.start_round("relay", n, victim=victim)
    try:
        h.wait(started.folder, "progress", [victim], h.setup.timeout, f"reader {victim} to receive a chunk")
        if victim:
            label = f"a reader behind reader {victim} to receive a chunk"
            h.wait(started.folder, "progress", range(victim), h.setup.timeout, label, least=1)
        h.procs[victim].kill()
        h.procs[victim].wait(STOP_TIMEOUT)
        r = h.finish_round(started, range(victim))
    except (RuntimeError, TimeoutError) as exc:  # a survivor failed, differed or hung
        return {"killed_reader_ok": False, "killed_error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        (started.folder / "over").touch()
        h.killed.add(victim)  # started again by the next round that needs it
    return {
        "killed_reader_ok": True,
        "killed_s": r.seconds,
        "killed_reader_s": r.reader_s,
        "killed_routed_around": max(info["dropped"] for info in r.info),  # readers dropped from chains
    }


MODES: dict[str, Mode] = {
    "single": single, "star": star, "delta": delta, "fanout": fanout, "mixed": mixed, "killed": killed,
}  # fmt: skip


def mixed_reads(published: dict[int, dict[str, Any]], reads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reads whose tensors carry more than one generation's tag, or whose bytes differ from
    what was published as the generation the read returned (or that was never published)."""

    def wrong(read: dict[str, Any]) -> bool:
        was = published.get(read["generation"])
        return len(read["tags"]) > 1 or was is None or was["digests"] != read["digests"]

    return [read for read in reads if wrong(read)]


def _kinds(failures: Iterable[str]) -> dict[str, int]:
    """Failed updates by error, with an example each: ``{"GenerationRetired: ...": count}``."""
    out: dict[str, int] = {}
    for failure in failures:
        kind = failure.split(":", 1)[0]
        key = next((k for k in out if k.split(":", 1)[0] == kind), failure[:200])
        out[key] = out.get(key, 0) + 1
    return out


def _per_mode(h: Harness, mode: str, r: Round, copies: int) -> dict[str, Any]:
    """The keys every mode has, as ``{key: {mode: value}}``: the physical bound (``copies`` model
    copies through the origin's link) and, in namespaces, what the origin's link sent."""
    if not h.setup.netns:
        return {}
    link = h.setup.rate_gbit * 1e9 / 8  # bytes/s
    out: dict[str, Any] = {"bound_s": {mode: copies * h.model_bytes / link}}
    if r.egress is not None:
        out["origin_egress_bytes"] = {mode: r.egress}
        out["origin_egress_ratio"] = {mode: r.egress / h.model_bytes}
        out["origin_link_use"] = {mode: r.egress / r.seconds / link}  # well under 1: not link-bound
    return out


def run(setup: Setup) -> dict[str, Any]:
    lay = layout(setup.size, setup.tensors)
    size = model_bytes(lay)
    result: dict[str, Any] = {
        "network": "netns" if setup.netns else "loopback (127.0.0.1, unshaped: all processes share the CPUs)",
        "readers": setup.readers,
        "model_bytes": size,
        "tensors": len(lay),
        "bytes_by_dtype": _bytes_by_dtype(lay),
        "modes": list(setup.modes),
    }
    if setup.netns:
        result.update(rate_gbit=setup.rate_gbit, link_s=size * 8 / (setup.rate_gbit * 1e9))
    started = time.monotonic()
    try:
        with harness(setup, lay) as h:
            for mode in setup.modes:
                for key, value in MODES[mode](h).items():
                    if isinstance(value, dict):  # a {mode: value} key that several modes add to
                        result.setdefault(key, {}).update(value)
                    else:
                        result[key] = value
    except Unavailable as exc:
        result["skipped"] = f"network namespaces are not available here: {exc}"
        return result
    for way in ("star", "fanout"):
        if "single_s" in result and f"{way}_s" in result:
            result[f"{way}_vs_single"] = result[f"{way}_s"] / result["single_s"]
    # fanout's origin link idles while the chain's tail catches up: it says nothing about the CPUs
    use = {m: u for m, u in result.get("origin_link_use", {}).items() if m != "fanout"}
    if use:
        result["rate_note"] = _rate_note(use)
    result["not_measured"] = _not_measured(setup)
    result["seconds"] = time.monotonic() - started
    return result


def _rate_note(use: dict[str, float]) -> str:
    """Whether the links or this machine's CPUs bounded the run: a link busy less than 80% of a
    mode's time means the processes could not keep up with it (then lower ``--rate``)."""
    low = min(use, key=use.__getitem__)
    if use[low] < 0.8:
        return (f"the origin's link was only {use[low]:.0%} busy in {low}: the CPUs, not the link, "
                "bounded it; measure at a lower --rate")  # fmt: skip
    return f"the origin's link was at least {use[low]:.0%} busy in every mode: the link bounded them"


def _bytes_by_dtype(lay: Layout) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, dtype, shape in lay:
        key = str(dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + math.prod(shape) * dtype.itemsize
    return out


def _not_measured(setup: Setup) -> dict[str, str]:
    out = {mode: "not asked for (--modes)" for mode in MODES if mode not in setup.modes}
    if not setup.netns:
        out["origin_egress"] = "loopback: the origin has no link of its own whose bytes could be counted"
        out["bound_s"] = "loopback: no link rate to bound the transfer"
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench broadcast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--readers", type=int, default=d.readers, help="reader processes (star)")
    parser.add_argument("--size", type=parse_size, default=d.size, help="the state_dict's bytes, about")
    parser.add_argument("--tensors", type=int, default=d.tensors, help="how many tensors, about")
    parser.add_argument("--rate", type=float, default=d.rate_gbit, help="namespaces: link speed in Gb/s")
    parser.add_argument("--modes", default=",".join(d.modes), help=f"of {', '.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for each mode's readers")
    parser.add_argument("--mixed-seconds", type=float, default=d.mixed_seconds,
                        help="mixed: how long the readers read while the publisher publishes")  # fmt: skip
    parser.add_argument("--publish-every", type=float, default=None,
                        help="mixed: seconds between publishes (default: 2 x the link time)")  # fmt: skip
    parser.add_argument("--no-netns", dest="netns", action="store_false",
                        help="on 127.0.0.1, unshaped (labelled loopback in the result)")  # fmt: skip
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; measured today: {', '.join(MODES)}")
    if args.readers < 1 or args.tensors < 1:
        parser.error("--readers and --tensors must be at least 1")
    setup = Setup(args.readers, args.size, args.rate, args.tensors, timeout=args.timeout,
                  netns=args.netns, modes=modes, mixed_seconds=args.mixed_seconds,
                  publish_every=args.publish_every)  # fmt: skip
    return show(run(setup), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    links = f", {r['rate_gbit']} Gb/s links" if "rate_gbit" in r else ""
    head = (f"broadcast: {r['model_bytes'] / 1e6:.0f} MB in {r['tensors']} tensors to {r['readers']} "
            f"readers, {r['network']}{links}")  # fmt: skip
    if "skipped" in r:
        return table(head, [("skipped", "", r["skipped"])], 8)
    rows = []
    for mode in r["modes"]:
        bound = r.get("bound_s", {}).get(mode)
        ratio = r.get("origin_egress_ratio", {}).get(mode)
        note = (f"bound {bound:.2f} s" if bound else "") + (
            f", origin sent {ratio:.2f} x the model" if ratio else ""
        )
        if mode == "delta":
            note = f"{r['delta_bytes_ratio']:.4f} x the model's bytes (target <= 0.05)"
        if mode == "mixed":
            note = f"{r['mixed_reads']} of {r['reads']} reads mixed (target 0)"
        if mode == "killed":
            note = f"killed_reader_ok {r['killed_reader_ok']} (target true)"
        took = r.get(f"{mode}_s")
        rows.append((mode, f"{took:.2f} s" if took is not None else "-", note))
    for way in ("star", "fanout"):
        if f"{way}_vs_single" in r:
            rows.append((f"{way} / single", f"{r[f'{way}_vs_single']:.2f}", ""))
    rows += [(mode, "not measured", why) for mode, why in r.get("not_measured", {}).items()]
    return table(head, rows, 8)


if __name__ == "__main__":
    main()
