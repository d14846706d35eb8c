"""The server side: ``Server`` and ``ServerThread`` (core.py), configured by ``ServerOptions``
(options.py), with their ``Extension`` seam
(request.py), a connection's frame loop (session.py), the store's operations (store_ops.py), the
gRPC face (rpc.py), shared memory (shm.py, an extension), Prometheus metrics (metrics.py) and
server processes for scripts and tests (process.py)."""

from tensorwire.server.core import Server, ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.server.request import Extension, Handler, Request

__all__ = ["Extension", "Handler", "Request", "Server", "ServerOptions", "ServerThread"]
