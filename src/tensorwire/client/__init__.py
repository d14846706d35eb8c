"""The client side: ``Client`` (blocking.py) and ``AsyncClient`` (async_client.py), gathered with
``connect``/``aconnect`` in core.py; their ``ClientOptions`` (options.py); the one retrying call
they, stripes and scatter use (retry.py); what a put or get carries (batches.py); and what they use
to go fast: striping over several connections (stripe.py), pinned staging for CUDA tensors
(staging.py) and the version-checked cache (cache.py)."""

from tensorwire.client.core import CHECKSUMS, AsyncClient, Client, ClientOptions, aconnect, connect

__all__ = ["CHECKSUMS", "AsyncClient", "Client", "ClientOptions", "aconnect", "connect"]
