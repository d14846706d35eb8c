"""``tensorwire dashboard``: a live web page of a cluster, from its servers' STATUS and metrics.

``collect`` asks the servers (also what ``tensorwire status`` prints), ``view`` turns two
snapshots into what the page shows (rates, a timeline of failovers, drops and checksum failures),
``app`` serves the page (aiohttp, the ``dashboard`` extra: imported only by ``app``). Nothing here
imports aiohttp at import time, so ``tensorwire status`` needs no extra.
"""
