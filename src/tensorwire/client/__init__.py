"""The client side: ``Client`` and ``AsyncClient`` (core.py) and what they use to go fast: striping
over several connections (stripe.py), pinned staging for CUDA tensors (staging.py) and the
version-checked cache (cache.py)."""

from tensorwire.client.core import CHECKSUMS, AsyncClient, Client, ClientOptions, aconnect, connect

__all__ = ["CHECKSUMS", "AsyncClient", "Client", "ClientOptions", "aconnect", "connect"]
