"""The ceiling of tls:// in ``bench transfer``: what one core's AES-256-GCM can seal, in series with
the plain tcp:// path measured in the same run.

TLS 1.3 seals records of at most 16 KiB; a stream over one connection is sealed on one core, and
that work adds to the plain path's (the copies, the socket calls), so the best a tls:// transfer
can do is the two in series: ``1 / (1 / aead + 1 / plain)``. The AEAD rate is measured here, on
this process's core, with the AES-256-GCM of the very libcrypto Python's ``ssl`` module loaded
(found in ``/proc/self/maps``, called through ctypes: ``EVP_EncryptUpdate`` over 1 MiB per call,
so the interpreter's cost per call is left out and the rate is a ceiling). Not the ``cryptography``
package's: it bundles its own, newer OpenSSL, whose AES-GCM is much faster on this machine (7.4
against 4.3 GB/s) and which tls:// cannot use; its rate is reported beside
(``tls_aead_cryptography_gbps``), and it is the bound only where the ``ssl`` module's libcrypto
cannot be found (``tls_aead_library`` says which one was measured). ``tls_put_vs_bound`` and
``tls_get_vs_bound`` say how close tls:// comes, ``tls_vs_bound`` the lower of the two.
"""

from __future__ import annotations

import ctypes
import os
import ssl
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tensorwire.types import MiB

RECORD_BYTES = 16 * 1024  # TLS's largest record
TAG_BYTES = 16
CALL_BYTES = 1 * MiB  # per EVP call through ctypes: the call's own cost stays out of the rate
SEALED_BYTES = 64 * MiB  # per timed pass: long enough to be a rate, short enough for a smoke run
PASSES = 3  # the best of: a shared host only ever makes a pass slower
_GCM_GET_TAG = 0x10  # EVP_CTRL_GCM_GET_TAG


def ssl_libcrypto() -> str | None:
    """The path of the libcrypto this process's ``ssl`` module runs on, or None where it cannot be
    told (no ``/proc``, or OpenSSL linked into ``_ssl`` itself)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcrypto."):
            return fields[5]
    return None


def aead(total: int = SEALED_BYTES, passes: int = PASSES) -> dict[str, float | str | None]:
    """The report's AEAD fields: the rate of the ``ssl`` module's AES-256-GCM (``tls_aead_gbps``,
    the bound's), which library that is, and the ``cryptography`` package's rate beside it."""
    fallback = cryptography_gbps(total, passes)
    path = ssl_libcrypto()
    why = "the ssl module's libcrypto was not found"
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            lib.OpenSSL_version.restype = ctypes.c_char_p
            version = lib.OpenSSL_version(0).decode()
            return {
                "tls_aead_gbps": libcrypto_gbps(lib, total, passes),
                "tls_aead_cryptography_gbps": fallback,
                "tls_aead_library": f"{version} ({path}; ssl reports {ssl.OPENSSL_VERSION})",
            }
        except (OSError, AttributeError, RuntimeError) as exc:  # no such symbol, or it would not seal
            why = f"{path} would not seal: {exc}"
    return {
        "tls_aead_gbps": fallback,
        "tls_aead_cryptography_gbps": fallback,
        "tls_aead_library": f"the cryptography package's ({why})",
    }


class Sealer:
    """AES-256-GCM through a libcrypto's EVP interface (ctypes), one key; ``seal`` one message."""

    def __init__(self, lib: ctypes.CDLL, key: bytes) -> None:
        vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        lib.EVP_CIPHER_CTX_new.restype = vp
        lib.EVP_aes_256_gcm.restype = vp
        lib.EVP_EncryptInit_ex.argtypes = [vp, vp, vp, vp, vp]
        lib.EVP_EncryptUpdate.argtypes = [vp, vp, ip, vp, ctypes.c_int]
        lib.EVP_EncryptFinal_ex.argtypes = [vp, vp, ip]
        lib.EVP_CIPHER_CTX_ctrl.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
        lib.EVP_CIPHER_CTX_free.argtypes = [vp]
        self._lib = lib
        self._ctx = lib.EVP_CIPHER_CTX_new()
        if not self._ctx:
            raise RuntimeError("EVP_CIPHER_CTX_new failed")
        self._nonce, self._written = ctypes.create_string_buffer(12), ctypes.c_int()
        if lib.EVP_EncryptInit_ex(self._ctx, lib.EVP_aes_256_gcm(), None, key, self._nonce) != 1:
            self.close()
            raise RuntimeError("EVP_EncryptInit_ex refused AES-256-GCM")

    def seal(self, nonce: bytes, plain: ctypes.Array[ctypes.c_char], sealed: ctypes.Array[ctypes.c_char],
             tag: ctypes.Array[ctypes.c_char]) -> None:  # fmt: skip
        """``plain`` sealed into ``sealed`` (as long) under a 12-byte ``nonce``, its tag into ``tag``."""
        lib, ctx, written = self._lib, self._ctx, ctypes.byref(self._written)
        ctypes.memmove(self._nonce, nonce, 12)
        ok = lib.EVP_EncryptInit_ex(ctx, None, None, None, self._nonce)
        ok &= lib.EVP_EncryptUpdate(ctx, sealed, written, plain, len(plain))
        ok &= lib.EVP_EncryptFinal_ex(ctx, sealed, written)
        ok &= lib.EVP_CIPHER_CTX_ctrl(ctx, _GCM_GET_TAG, len(tag), tag)
        if ok != 1:
            raise RuntimeError("libcrypto failed to seal a message")

    def close(self) -> None:
        self._lib.EVP_CIPHER_CTX_free(self._ctx)


def libcrypto_gbps(lib: ctypes.CDLL, total: int = SEALED_BYTES, passes: int = PASSES) -> float:
    """One core's AES-256-GCM rate through ``lib``'s EVP interface, ``CALL_BYTES`` per sealed
    message, a fresh nonce each (the best pass)."""
    sealer = Sealer(lib, os.urandom(32))
    try:
        plain, sealed = ctypes.create_string_buffer(CALL_BYTES), ctypes.create_string_buffer(CALL_BYTES)
        tag = ctypes.create_string_buffer(TAG_BYTES)
        count = max(1, total // CALL_BYTES)
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            for i in range(count):
                sealer.seal(i.to_bytes(12, "little"), plain, sealed, tag)  # never one nonce twice under a key
            best = min(best, time.perf_counter() - start)
        return count * CALL_BYTES / best / 1e9
    finally:
        sealer.close()


def cryptography_gbps(total: int = SEALED_BYTES, passes: int = PASSES) -> float:
    """The ``cryptography`` package's AES-256-GCM rate sealing ``total`` bytes of 16 KiB records
    (the best pass)."""
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


def bound(
    aead: dict[str, float | str | None], put: float, get: float, tls_put: float, tls_get: float
) -> dict[str, float | str | None]:
    """The report's fields: ``aead``'s (see ``aead``), the bounds of tls:// put and get, and how
    close each came."""
    rate = aead["tls_aead_gbps"]
    assert isinstance(rate, float)
    put_bound, get_bound = in_series(rate, put), in_series(rate, get)
    put_vs = tls_put / put_bound if put_bound else None
    get_vs = tls_get / get_bound if get_bound else None
    return {
        **aead,
        "tls_bound_put_gbps": put_bound,
        "tls_bound_get_gbps": get_bound,
        "tls_put_vs_bound": put_vs,
        "tls_get_vs_bound": get_vs,
        "tls_vs_bound": None if put_vs is None or get_vs is None else min(put_vs, get_vs),
    }
