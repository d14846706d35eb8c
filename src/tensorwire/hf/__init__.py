"""Hugging Face ``transformers`` models to and from tensorwire generations (``pip install
tensorwire[hf]``).

A model's weights travel as one generation of a prefix, by the names ``save_pretrained`` writes
(``model.layers.0.self_attn.q_proj.weight``; a tied ``lm_head.weight`` once, as the weight it is
tied to), so a generation, a ``save_pretrained`` folder and ``from_pretrained`` agree on every name::

    import tensorwire.hf

    tensorwire.hf.publish(model, "tcp://store:7070", "policy")          # one generation
    number = tensorwire.hf.load_into(other, "tcp://store:7070", "policy")  # in place, checked first
    tensorwire.hf.publish_checkpoint("path/to/checkpoint", "tcp://store:7070", "base")

``tensorwire put --generation PREFIX path/to/checkpoint`` does the last from the command line.
Nothing here imports transformers: a model is any ``torch.nn.Module``; transformers' conventions
(``_tied_weights_keys``, ``_keys_to_ignore_on_save``) are read off it when present. ``names.py``
says which names a model saves, ``checkpoint.py`` how a checkpoint folder is read and what it
refuses, ``weights.py`` how a generation is checked against a model before it is read into it.
"""

from __future__ import annotations

from tensorwire.hf.checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, open_checkpoint
from tensorwire.hf.names import SavedNames, saved_names
from tensorwire.hf.weights import load_into, publish, publish_checkpoint

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SavedNames",
    "load_into",
    "open_checkpoint",
    "publish",
    "publish_checkpoint",
    "saved_names",
]
