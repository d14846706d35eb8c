"""The parameter server layer: parameters sharded over S servers, pulled and pushed by workers.

Three subpackages, and what they share at this level:

* ``server/``: ``ParamServer``, the extension ``tensorwire ps serve`` adds to a server: several
  jobs at once (each named by an id), each with its shards, their optimizer, and the ``sync`` /
  ``async`` / ``ssp:<s>`` consistency modes. It wires one part per concern: ``jobs`` (the jobs
  and each one's parts), ``lifecycle`` (joins, leaves, barriers, ends), ``membership`` (the
  workers), ``consistency`` (gates, pushes, steps), ``snapshots`` (pulls), ``gradients`` (push
  buffers), ``state`` (a job taken and loaded whole; ``checkpoint``: on disk, all or nothing),
  ``replica`` (role, epoch, failover: one per server; ``replication``: primary/backup
  replication with fencing), ``relay`` (pulls through the relay), ``metrics`` (Prometheus).
* ``worker/``: ``Worker``, which wraps a module for a training loop (pull, push, step, barrier),
  with its parts: ``config`` (``WorkerConfig``), ``session`` (joins, heartbeats, leaving),
  ``rpc``, ``slot``, ``shards``, ``device``, ``rendezvous``, ``relay_reader`` (the typed PS
  requests, one record per server slot, the model's tensors, where the servers are, relay pulls).
* ``exchange/``: the gradient exchange (an ``allreduce`` of gradients over one or more servers,
  by TCP or by gRPC ``train.GradientService``) for code that keeps its optimizer local:
  ``server`` (``GradientExchange``) and ``client`` (``ExchangeClient``).
* Shared: ``placement`` (which server holds which range of which parameter: ``plan``), ``job``
  (``Mode``, ``JobConfig``, ``CheckpointPolicy``: what every worker of a job agrees on),
  ``optim`` (the optimizer specs ``SGD``, ``Adam``, ``AdamW``), ``budget`` (a server's memory for
  its jobs and the exchange), ``layout`` (which host serves each slot's replicas).
* ``launch``: a local cluster of server and worker processes (``tensorwire ps launch``);
  ``digits``: the demo's training script (``make demo``, ``tensorwire demo``).

``ps.allreduce.ExchangeClient`` is a deprecated name of ``ExchangeClient``.
"""

from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.ps.job import CheckpointPolicy, JobConfig, Mode
from tensorwire.ps.optim import SGD, Adam, AdamW, OptimizerSpec
from tensorwire.ps.placement import ParamSpec, Placement, Shard, plan
from tensorwire.ps.server.leadership import Coordination
from tensorwire.ps.server.param_server import ParamServer
from tensorwire.ps.worker.worker import PushResult, Worker, pull_parameters

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "CheckpointPolicy",
    "Coordination",
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
