"""The batch codecs (``codec_py``), compiled (``codec_c``) where the install built them: see
``tensorwire._extensions``. Import the functions from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire import _extensions
from tensorwire.wire import codec_py

if TYPE_CHECKING:  # the types are the source's; the extension has the same signatures
    from tensorwire.wire.codec_py import decode_names, decode_records, pack_names, pack_records, pack_string
else:
    _impl = _extensions.load("tensorwire.wire.codec_c", codec_py)
    decode_records = _impl.decode_records
    decode_names = _impl.decode_names
    pack_records = _impl.pack_records
    pack_names = _impl.pack_names
    pack_string = _impl.pack_string

MAX_NDIM = codec_py.MAX_NDIM
__all__ = ["MAX_NDIM", "decode_names", "decode_records", "pack_names", "pack_records", "pack_string"]
