"""The gradient exchange: an ``allreduce`` of gradients over one or more parameter servers, for
training code that keeps its optimizer local.

* ``server``: ``GradientExchange``, the rounds, served by every parameter server (frame
  ALLREDUCE); ``rpc``: the same over gRPC ``train.GradientService``;
* ``client``: ``ExchangeClient`` (import it from ``tensorwire.ps``), which speaks ALLREDUCE
  through the worker's parts (``ps/worker``).

Nothing is imported here, so that the parameter server, which serves the exchange, does not load
the worker's side with it.
"""
