"""The parameter server layer: parameters sharded over S servers, pulled and pushed by workers.

* ``placement``: which server holds which range of which parameter (``plan``).
* ``job``: ``Mode``, ``JobConfig``, ``CheckpointPolicy``: what every worker of a job agrees on.
* ``server``: ``ParamServer``, the extension ``tensorwire ps serve`` adds to a server: several
  jobs at once (each named by an id), each with its shards, their optimizer, and the ``sync`` /
  ``async`` / ``ssp:<s>`` consistency modes. It wires one part per concern: ``jobs`` (the jobs
  and each one's parts), ``lifecycle`` (joins, leaves, barriers, ends), ``membership`` (the
  workers), ``consistency`` (gates, pushes, steps), ``snapshots`` (pulls), ``gradients`` (push
  buffers), ``state`` (a job taken and loaded whole), ``replica`` (role, epoch, failover: one per
  server), ``budget`` (memory), ``metrics`` (Prometheus).
* ``worker``: ``Worker``, which wraps a module for a training loop (pull, push, step, barrier).
* ``exchange_server`` / ``exchange_client``: the gradient exchange (an ``allreduce`` of gradients
  over one or more servers, by TCP or by gRPC ``train.GradientService``) for code that keeps its
  optimizer local; ``ExchangeClient`` (also ``ps.allreduce.ExchangeClient``, its older name).
* ``rpc``, ``slot``, ``shards``, ``rendezvous``: the worker's parts (the typed PS requests, one
  record per server slot, the model's tensors, where the servers are).
* ``optim``: the optimizer specs (``SGD``, ``Adam``, ``AdamW``).
* ``launch``: a local cluster of server and worker processes (``tensorwire ps launch``).
* ``checkpoint``: a server's whole job on disk, all or nothing; ``replication``: primary/backup
  replication with failover and fencing.
"""

from tensorwire.ps.exchange_client import ExchangeClient
from tensorwire.ps.job import CheckpointPolicy, JobConfig, Mode
from tensorwire.ps.optim import SGD, Adam, AdamW, OptimizerSpec
from tensorwire.ps.placement import ParamSpec, Placement, Shard, plan
from tensorwire.ps.server import ParamServer
from tensorwire.ps.worker import PushResult, Worker, pull_parameters

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CheckpointPolicy",
    "ExchangeClient",
    "JobConfig",
    "Mode",
    "OptimizerSpec",
    "ParamServer",
    "ParamSpec",
    "Placement",
    "PushResult",
    "Shard",
    "Worker",
    "plan",
    "pull_parameters",
]
