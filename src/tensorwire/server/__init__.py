"""The server side: ``Server`` and ``ServerThread`` with their ``Extension`` seam (core.py), the gRPC
face (rpc.py), shared memory (shm.py), Prometheus metrics (metrics.py) and server processes for
scripts and tests (process.py)."""

from tensorwire.server.core import Extension, Handler, Request, Server, ServerThread

__all__ = ["Extension", "Handler", "Request", "Server", "ServerThread"]
