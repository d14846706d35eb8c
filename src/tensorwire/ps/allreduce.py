"""The gradient exchange's client under its first name (``ps.allreduce.ExchangeClient``): it lives
in ``exchange_client``, next to ``exchange_server``; ``tensorwire.ps.ExchangeClient`` is the same."""

from tensorwire.ps.exchange_client import ExchangeClient

__all__ = ["ExchangeClient"]
