"""Benchmarks of tensorwire against plain-socket and plain-asyncio baselines.

``python -m tensorwire.bench.transfer --json`` measures bulk put/get throughput, small round-trip
latency and many-small-tensor rates, each next to the baseline it should be judged against.
"""
