"""tensorwire: move and keep PyTorch tensors across the processes and machines of a training job.

>>> import torch, tensorwire
>>> with tensorwire.ServerThread() as server, tensorwire.connect(server.url) as client:
...     version = client.put("model/w", torch.ones(3))
...     client.get("model/w")
tensor([1., 1., 1.])
"""

from tensorwire import errors
from tensorwire.broadcast import HostReader, Subscriber
from tensorwire.client.core import AsyncClient, Client, ClientOptions, aconnect, connect
from tensorwire.security import Security, TlsFiles
from tensorwire.server.core import Server, ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.types import Address, Generation, GenerationManifest, Limits, TensorMeta

__version__ = "0.2.0"  # the one place it is said (pyproject reads it); CHANGELOG.md names it

__all__ = [
    "Address",
    "AsyncClient",
    "Client",
    "ClientOptions",
    "Generation",
    "GenerationManifest",
    "HostReader",
    "Limits",
    "Security",
    "Server",
    "ServerOptions",
    "ServerThread",
    "Subscriber",
    "TensorMeta",
    "TensorStore",
    "TlsFiles",
    "__version__",
    "aconnect",
    "connect",
    "errors",
]
