"""The ceiling of tls:// in ``bench transfer``: what one core's AES-256-GCM can seal, in series with
the plain tcp:// path measured in the same run.

TLS 1.3 seals records of at most 16 KiB; a stream over one connection is sealed on one core, and
that work adds to the plain path's (the copies, the socket calls), so the best a tls:// transfer
can do is the two in series: ``1 / (1 / aead + 1 / plain)``. The AEAD rate is measured here, on
this process's core, with the ``cryptography`` package's AES-256-GCM (OpenSSL's, as Python's ``ssl``
uses) on 16 KiB records sealed into one reused buffer; ``tls_put_vs_bound`` and
``tls_get_vs_bound`` say how close tls:// comes, ``tls_vs_bound`` the lower of the two.
"""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tensorwire.types import MiB

RECORD_BYTES = 16 * 1024  # TLS's largest record
TAG_BYTES = 16
SEALED_BYTES = 64 * MiB  # per timed pass: long enough to be a rate, short enough for a smoke run
PASSES = 3  # the best of: a shared host only ever makes a pass slower


def aead_gbps(total: int = SEALED_BYTES, passes: int = PASSES) -> float:
    """One core's AES-256-GCM rate sealing ``total`` bytes of 16 KiB records (the best pass)."""
    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    record = bytes(RECORD_BYTES)
    sealed = bytearray(RECORD_BYTES + TAG_BYTES)
    count = max(1, total // RECORD_BYTES)
    seal_into = getattr(aead, "encrypt_into", None)  # cryptography >= 45: no new bytes per record
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for i in range(count):
            nonce = i.to_bytes(12, "little")  # never one nonce twice under a key
            if seal_into is not None:
                seal_into(nonce, record, None, sealed)
            else:
                aead.encrypt(nonce, record, None)
        best = min(best, time.perf_counter() - start)
    return count * RECORD_BYTES / best / 1e9


def in_series(*gbps: float) -> float | None:
    """The rate of stages each byte goes through one after the other on one core."""
    if any(rate <= 0 for rate in gbps):
        return None
    return 1 / sum(1 / rate for rate in gbps)


def bound(aead: float, put: float, get: float, tls_put: float, tls_get: float) -> dict[str, float | None]:
    """The report's fields: the bounds of tls:// put and get, and how close each came."""
    put_bound, get_bound = in_series(aead, put), in_series(aead, get)
    put_vs = tls_put / put_bound if put_bound else None
    get_vs = tls_get / get_bound if get_bound else None
    return {
        "tls_aead_gbps": aead,
        "tls_bound_put_gbps": put_bound,
        "tls_bound_get_gbps": get_bound,
        "tls_put_vs_bound": put_vs,
        "tls_get_vs_bound": get_vs,
        "tls_vs_bound": None if put_vs is None or get_vs is None else min(put_vs, get_vs),
    }
