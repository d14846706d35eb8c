"""``bench.tls_bound``: tls://'s ceiling is measured with the AES-256-GCM of the libcrypto the
``ssl`` module runs on (not the ``cryptography`` package's newer bundled one, which tls:// cannot
use), and what it seals is real AES-256-GCM."""

from __future__ import annotations

import ctypes
import os
import ssl

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tensorwire.bench import tls_bound

needs_maps = pytest.mark.skipif(tls_bound.ssl_libcrypto() is None, reason="no /proc/self/maps libcrypto")


@needs_maps
def test_the_libcrypto_found_is_the_one_ssl_reports() -> None:
    path = tls_bound.ssl_libcrypto()
    assert path is not None
    lib = ctypes.CDLL(path)
    lib.OpenSSL_version.restype = ctypes.c_char_p
    assert lib.OpenSSL_version(0).decode() == ssl.OPENSSL_VERSION


@needs_maps
def test_what_it_seals_is_aes_256_gcm() -> None:
    """The ctypes signatures are right: the same key, nonce and bytes seal to what cryptography's
    AES-256-GCM makes of them (ciphertext and tag)."""
    path = tls_bound.ssl_libcrypto()
    assert path is not None
    key, nonce, message = os.urandom(32), os.urandom(12), os.urandom(4096 + 5)
    sealer = tls_bound.Sealer(ctypes.CDLL(path), key)
    try:
        plain = ctypes.create_string_buffer(message, len(message))
        sealed = ctypes.create_string_buffer(len(message))
        tag = ctypes.create_string_buffer(tls_bound.TAG_BYTES)
        sealer.seal(nonce, plain, sealed, tag)
    finally:
        sealer.close()
    assert sealed.raw + tag.raw == AESGCM(key).encrypt(nonce, message, None)


def test_the_report_names_the_library_it_measured() -> None:
    fields = tls_bound.aead(total=4 << 20, passes=1)
    rate = fields["tls_aead_gbps"]
    assert isinstance(rate, float) and rate > 0
    library = fields["tls_aead_library"]
    assert isinstance(library, str)
    if tls_bound.ssl_libcrypto() is not None:
        assert library.startswith(ssl.OPENSSL_VERSION)
    bound = tls_bound.bound(fields, put=4.0, get=4.0, tls_put=1.0, tls_get=2.0)
    assert bound["tls_vs_bound"] == bound["tls_put_vs_bound"]


def test_a_libcrypto_that_cannot_seal_falls_back_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library found but unusable (here: not a libcrypto at all) leaves the bound to the
    cryptography package's rate, labelled as such, rather than failing the benchmark."""
    monkeypatch.setattr(tls_bound, "ssl_libcrypto", lambda: "libc.so.6")
    fields = tls_bound.aead(total=4 << 20, passes=1)
    assert fields["tls_aead_gbps"] == fields["tls_aead_cryptography_gbps"]
    library = fields["tls_aead_library"]
    assert isinstance(library, str)
    assert library.startswith("the cryptography package's (libc.so.6 would not seal")
