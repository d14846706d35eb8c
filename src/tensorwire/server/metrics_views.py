"""Who sees which label values on a server's metrics page (server/metrics.py serves it).

Labels outside ``SERVER_LABELS`` (a job id, a generation prefix) carry values a
client chose; they are shown only to whom the server trusts with them:

* A server that asks nobody for anything (no token, no client CA) and has no metrics token is
  open (its STATUS answers anyone), and so is its page.
* Otherwise (a token, client certificates, or ``--metrics-token-file``) the page is served in full
  only to a scrape that bears the metrics token (``Authorization: Bearer METRICS_TOKEN``, what
  Prometheus's ``authorization: {credentials_file: ...}`` sends): a read-only secret of its own,
  never the clients' token, which would cross the network in the clear (the endpoint is plain
  HTTP) and let whoever saw it write and delete tensors. A scrape that bears another bearer (the
  clients' token, say) is refused (401, counted as ``reason="metrics_auth"`` and logged); one
  without gets the same families and series, each client-chosen value replaced by its
  ``pseudonym``: ``anon-`` and 16 hex digits of HMAC-SHA256 under the server's pseudonym key.
* The key (``pseudonym_key``) is derived from the clients' token, else from the metrics token, so
  pseudonyms are stable across restarts (charts keep their series); a server with neither (client
  certificates only) draws a random one per process. It is not guessable without those secrets,
  and STATUS (an authenticated request) carries it as ``metrics_key``, so ``tensorwire status``
  and the dashboard put back the pseudonyms of the values STATUS names (``unmask``) without
  sending any secret to the metrics port. Pseudonyms are as many as the values (no new series).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets as random_secrets
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from tensorwire.security import tokens_match

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("tensorwire.server.metrics")

# Labels whose values the server chose (fixed sets, its own configuration): shown to any scrape.
# Every other label's values may come from clients and are pseudonyms to a scrape without the token.
SERVER_LABELS = frozenset({"op", "transport", "reason", "role", "kind", "le", "quantile", "backup", "version",
                           "addresses"})  # fmt: skip
PSEUDONYM_PREFIX = "anon-"
PSEUDONYM_CONTEXT = b"tensorwire metrics pseudonyms v1"  # what the key is derived over


def pseudonym_key(*secrets: str | None) -> str:
    """The key of a server's pseudonyms (hex): HMAC-SHA256 of a fixed context under the first of
    ``secrets`` given (the clients' token, then the metrics token), so the same across restarts and
    never the secret itself (STATUS carries it); with none, a random key for this process."""
    for secret in secrets:
        if secret:
            return hmac.new(secret.encode(), PSEUDONYM_CONTEXT, hashlib.sha256).hexdigest()
    return random_secrets.token_hex(32)


def pseudonym(key: str, value: str) -> str:
    """What a scrape without the metrics token sees in place of the client-chosen label ``value``."""
    digest = hmac.new(key.encode(), value.encode(), hashlib.sha256).hexdigest()
    return PSEUDONYM_PREFIX + digest[:16]


class _Pseudonymized:
    """The families of ``registry``, every label outside ``SERVER_LABELS`` a pseudonym."""

    def __init__(self, registry: CollectorRegistry, key: str) -> None:
        self._registry, self._key = registry, key

    def collect(self) -> Iterator[Any]:
        from prometheus_client.metrics_core import Metric

        for family in self._registry.collect():
            masked = Metric(family.name, family.documentation, family.type, family.unit)
            masked.samples = [sample._replace(labels=self._mask(sample.labels)) for sample in family.samples]
            yield masked

    def _mask(self, labels: dict[str, str]) -> dict[str, str]:
        return {k: v if k in SERVER_LABELS else pseudonym(self._key, v) for k, v in labels.items()}


def bearer(environ: dict[str, Any]) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, or None."""
    scheme, _, credentials = str(environ.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
    return (credentials.strip() or None) if scheme.lower() == "bearer" else None


class Views:
    """The WSGI app of a private page: in full to a scrape bearing ``scrape_token``, 401 to one
    bearing anything else (counted in ``refused``, logged the 1st, 2nd, 4th, ... time), the
    pseudonymous ``public`` app to one bearing nothing."""

    def __init__(self, full: Any, public: Any, scrape_token: str | None) -> None:
        self.full, self.public, self.scrape_token = full, public, scrape_token
        self.refused = 0
        self._lock = threading.Lock()  # one thread per scrape

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        offered = bearer(environ)
        if offered is None:
            return self.public(environ, start_response)
        if self.scrape_token is not None and tokens_match(self.scrape_token, offered):
            return self.full(environ, start_response)
        return self._refuse(environ, start_response)

    def _refuse(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self._lock:
            self.refused += 1
            refused = self.refused
        if refused & (refused - 1) == 0:
            log.warning("metrics endpoint refused a scrape from %s: its bearer is not the metrics token "
                        "(--metrics-token-file; the clients' token is never accepted here); %d refused so "
                        "far", environ.get("REMOTE_ADDR", "?"), refused)  # fmt: skip
        why = (
            b"the bearer is not this server's metrics token (--metrics-token-file); the clients' token "
            b"is not accepted here. Scrape without a bearer to see job ids and prefixes as pseudonyms.\n"
        )
        start_response(
            "401 Unauthorized", [("Content-Type", "text/plain"), ("Content-Length", str(len(why)))]
        )
        return [why]


def metrics_app(registry: CollectorRegistry, scrape_token: str | None = None, key: str | None = None) -> Any:
    """The WSGI app of the metrics page (the module doc): with no ``key`` everything to anyone (an
    open server); else in full only to a scrape bearing ``scrape_token`` and with client-chosen
    label values as pseudonyms under ``key`` to a scrape with no bearer."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    full = make_wsgi_app(registry)
    if key is None:
        return full
    public = CollectorRegistry(auto_describe=False)
    public.register(_Pseudonymized(registry, key))
    return Views(full, make_wsgi_app(public), scrape_token)


def unmask(samples: dict[str, list[tuple[dict[str, str], float]]], key: str | None,
           values: Iterable[str]) -> dict[str, list[tuple[dict[str, str], float]]]:  # fmt: skip
    """``samples`` of a page scraped without the metrics token, each pseudonym of one of ``values``
    (the job ids and prefixes STATUS names) put back under ``key`` (STATUS's ``metrics_key``)."""
    if not key:
        return samples
    known = {pseudonym(key, v): v for v in values}
    if not known:
        return samples
    return {
        name: [({k: known.get(v, v) for k, v in labels.items()}, value) for labels, value in rows]
        for name, rows in samples.items()
    }


__all__ = [
    "PSEUDONYM_PREFIX",
    "SERVER_LABELS",
    "Views",
    "bearer",
    "metrics_app",
    "pseudonym",
    "pseudonym_key",
    "unmask",
]
