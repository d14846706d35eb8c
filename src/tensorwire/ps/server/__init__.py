"""The server side of the parameter server: ``ParamServer`` (``param_server``) and its parts.

``ParamServer`` is the extension ``tensorwire ps serve`` adds to a server. It wires one part per
concern, each depending only on those below it (an import-linter contract holds the order):

* ``lifecycle``: joins, inits, leaves, barriers, ends, rollbacks;
* ``jobs``: the jobs a server holds (``Jobs``) and each one's parts (``JobRun``);
* ``snapshots``: what pulls send from; ``consistency``: gates, pushes, steps (the modes);
* ``state``: a job taken and loaded whole (``checkpoint``: on disk, all or nothing);
* ``membership``: the workers, their sessions and heartbeats; ``gradients``: push buffers;
* ``replica``: role, epoch and failover, one per server (``replication``: primary/backup copies);
* ``relay``: the server side of pulls through the relay; ``metrics``: Prometheus families.

The job itself (``ps/job.py``) and the memory budget (``ps/budget.py``) are shared with the
worker and the exchange, one level up. Import ``ParamServer`` from ``tensorwire.ps``.
"""
