"""The parameter server layer: parameters sharded over S servers, pulled and pushed by workers.

Here now: ``placement``, which decides where each range of each parameter lives. Next: the server
that holds and updates its shards, the worker that pulls parameters and pushes gradients, and the
consistency rules between them.
"""

from tensorwire.ps.placement import ParamSpec, Placement, Shard, plan

__all__ = ["ParamSpec", "Placement", "Shard", "plan"]
