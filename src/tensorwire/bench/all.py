"""``tensorwire bench all --out DIR``: every benchmark of ``BENCHMARKS``, then one report.

Each benchmark runs in this process through its ``main(argv)`` with the arguments its table entry
gives for a report (``--quick``: the tiny ones, for a smoke run) plus ``--json``; what it prints
goes to ``DIR/logs/<name>.log``. A benchmark that fails is recorded with its error and the others
still run. Then ``report.write`` puts ``report.json`` (the machine, every benchmark's result and
time), ``report.md`` (one table: path, figure, peer in the same run, ratio) and the sweep's PNG
plots into DIR. With the default settings the whole run takes about 10 minutes on a 2-core machine.

Run: ``tensorwire bench all --out bench-report [--quick] [--only sweep,transfer]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tensorwire.bench import BENCHMARKS, report


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import psutil
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else [float("nan")] * 3,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorwire": _version("tensorwire"),
        "versions": {name: _version(name) for name in ("numpy", "grpcio", "pyarrow", "uvloop", "psutil")},
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_one(name: str, argv: list[str], logs: Path) -> dict[str, Any]:
    """One benchmark through its ``main``: its result, or the error that stopped it."""
    started = time.monotonic()
    entry: dict[str, Any] = {"args": argv, "result": None, "error": None}
    log = logs / f"{name}.log"
    with log.open("w") as out, contextlib.redirect_stdout(out):
        try:
            entry["result"] = importlib.import_module(f"tensorwire.bench.{name}").main(argv)
        except (Exception, SystemExit) as exc:  # one benchmark's failure must not lose the report
            entry["error"] = (
                traceback.format_exc() if not isinstance(exc, SystemExit) else f"exit: {exc.code}"
            )
            print(entry["error"], file=out)
    entry["seconds"] = time.monotonic() - started
    return entry


def _names(text: str | None) -> set[str] | None:
    if text is None:
        return None
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(BENCHMARKS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown benchmarks {sorted(unknown)}; known: {', '.join(BENCHMARKS)}"
        )
    return names


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensorwire bench all", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="directory for the report (created)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of the whole report")
    parser.add_argument("--only", type=_names, default=None, help="comma-separated benchmarks to run")
    parser.add_argument("--json", action="store_true", help="print report.json's content at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    doc: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "quick": args.quick,
        "machine": machine(),
        "benchmarks": {},
    }
    for name, bench in BENCHMARKS.items():
        settings = bench.quick_args if args.quick else bench.report_args
        if (args.only is not None and name not in args.only) or settings is None:
            doc["benchmarks"][name] = {"args": None, "result": None, "error": None, "seconds": 0.0}
            continue
        settings = tuple(a.replace("{out}", str(args.out)) for a in settings)
        print(f"bench all: {name} {' '.join(settings)}", file=sys.stderr, flush=True)
        entry = doc["benchmarks"][name] = run_one(name, [*settings, "--json"], logs)
        verdict = "failed (see logs)" if entry["error"] else "done"
        print(f"bench all: {name} {verdict} in {entry['seconds']:.0f} s", file=sys.stderr, flush=True)
    doc["seconds"] = time.monotonic() - started
    written = report.write(args.out, doc)
    print(json.dumps(doc, default=str) if args.json else (args.out / "report.md").read_text(), end="\n")
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
