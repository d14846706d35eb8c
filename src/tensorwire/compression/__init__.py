"""Lossy compression of gradients (pushes) and weights (pulls), with error feedback.

* ``codecs``: ``Codec`` (``encode(tensor) -> payload``, ``decode(payload, out)``, a wire name),
  ``fp32``/``fp16``/``bf16`` casts, ``int8`` per-chunk quantisation, ``topk:<ratio>``, ``sign``,
  and ``topk:<ratio>+<codec>``; ``codec_for(name)`` builds one from its wire name.
* ``feedback``: ``ErrorFeedback``, the worker's residuals that carry what a codec dropped into
  the next step.

The parameter server uses them through ``Worker(..., push_codec=..., pull_codec=...)`` and
``ExchangeClient(..., codec=...)``; docs/protocol.md §13.6 has the wire format.
(Lossless transport compression, lz4/zstd, is a separate thing and lives with the transports.)
"""

from tensorwire.compression.codecs import (
    Cast,
    Codec,
    Int8,
    Sign,
    TopK,
    codec_for,
    decode_all,
    from_wire,
    payload_total,
    resolve,
    top_indices,
)
from tensorwire.compression.feedback import ErrorFeedback

__all__ = [
    "Cast",
    "Codec",
    "ErrorFeedback",
    "Int8",
    "Sign",
    "TopK",
    "codec_for",
    "decode_all",
    "from_wire",
    "payload_total",
    "resolve",
    "top_indices",
]
