"""The worker side of the parameter server: ``Worker`` (``worker``) and its parts.

* ``worker``: ``Worker`` (pull, push, step, barrier) and ``pull_parameters``;
* ``config``: ``WorkerConfig``, everything a worker resolves once when it is made (environment,
  rendezvous, job, codecs, relay checks);
* ``session``: the worker's membership in its job on every server (join, init, rejoin,
  heartbeats, leave);
* ``slot``: ``ServerSlot``, one record per server (its replicas and connection, this worker's
  clock and pushes there, and the reconnect-and-failover loop every request goes through);
* ``rpc``: ``PsChannel``, each parameter-server request built and decoded in one place;
* ``shards``: ``ModelShards``, the tensors a push sends and a pull lands in (``device``: pinned
  staging for a CUDA model);
* ``rendezvous``: where the servers are, the rank and the world size;
* ``relay_reader``: pulls through the relay (``pull="relay"``).

The gradient exchange's client (``ps/exchange/client.py``) uses these parts too. Import
``Worker`` from ``tensorwire.ps``.
"""
