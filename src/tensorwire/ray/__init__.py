"""tensorwire on a Ray cluster (the ``[ray]`` extra): parameter servers as actors, training
functions as tasks.

::

    import ray
    from tensorwire.ray import run_workers, start_servers

    ray.init(address="auto")                      # a cluster started with `ray start`
    with start_servers(num=2, replicas=1) as servers:
        accuracies = run_workers(train, num=4, servers=servers)

* ``servers``: ``start_servers`` / ``start_stores`` and ``Servers`` (the URLs, the actors, ``stop``):
  each server a ``tensorwire serve`` process owned by one actor (``actor``), spread over the nodes
  by a placement group. Killing an actor kills its server: a standby takes over. The actors are
  the driver's: when it exits, Ray ends them, and their servers with them.
* ``workers``: ``run_workers``, each rank a task with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` and ``TENSORWIRE_SERVERS`` set, which ``ps.Worker`` reads.
* ``cluster``: placement groups and Ray's errors (as ``errors.ClusterError``), for the two above.
* ``transport``: Ray Direct Transport through tensorwire, ``@ray.method(tensor_transport="tensorwire")``
  after ``transport.register()``: an actor's returned tensors go through a store in its own process
  (shm:// on its node, tcp:// across nodes), read by the receiving actor or the driver. Its parts:
  ``rdt_metadata`` (what Ray carries to readers, and the checks a reader makes of it) and
  ``rdt_store`` (the sender's store, read-only to the network).

``import tensorwire`` does not import Ray; ``import tensorwire.ray`` does.
"""

from tensorwire.ray.servers import Replica, Servers, start_servers, start_stores
from tensorwire.ray.workers import run_workers

__all__ = ["Replica", "Servers", "run_workers", "start_servers", "start_stores"]
