"""Lossy compression of gradients (pushes) and weights (pulls), with error feedback.

* ``codecs``: ``Codec`` (``encode(tensor) -> payload``, ``decode(payload, out)``, a wire name),
  ``fp32``/``fp16``/``bf16`` casts, ``int8`` per-chunk quantisation, ``topk:<ratio>``, ``sign``,
  and ``topk:<ratio>+<codec>``; ``codec_for(name)`` builds one from its wire name.
* ``feedback``: ``ErrorFeedback``, the worker's residuals that carry what a codec dropped into
  the next step.

The parameter server uses them through ``Worker(..., push_codec=..., pull_codec=...)`` and
``ExchangeClient(..., codec=...)``; docs/protocol.md §13.6 has the wire format.
(Lossless transport compression, lz4/zstd, is a separate thing and lives with the transports.)

The helpers the parameter server uses (``resolve``, ``from_wire``, ``decode_all``,
``payload_total``, ``top_indices``) live in ``codecs`` and are not part of this package's surface;
imported from here they still work for one release and warn.
"""

from typing import TYPE_CHECKING

from tensorwire._deprecated import moved
from tensorwire.compression.codecs import Cast, Codec, Int8, Sign, TopK, codec_for
from tensorwire.compression.feedback import ErrorFeedback

_CODECS = "tensorwire.compression.codecs"
# Hidden from type checkers: to them a module __getattr__ would make every name of the package
# exist, a typo included; the deprecated names are for old code at run time only.
if not TYPE_CHECKING:
    __getattr__ = moved(
        "tensorwire.compression",
        dict.fromkeys(["decode_all", "from_wire", "payload_total", "resolve", "top_indices"], _CODECS),
    )

__all__ = [
    "Cast",
    "Codec",
    "ErrorFeedback",
    "Int8",
    "Sign",
    "TopK",
    "codec_for",
]
