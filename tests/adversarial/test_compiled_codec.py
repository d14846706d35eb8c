"""The compiled batch codec (``codec_c``, Cython over ``codec_py.py``) reads peer bytes: against
any block, truncated, lying or random, it must do exactly what the pure-Python source does (the
same items and end, or the same error with the same words), and never an ``IndexError``, an
overflow or a crash. Hypothesis drives both with the same blocks."""

from __future__ import annotations

import importlib
import math
import struct
from collections.abc import Callable
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorwire import _extensions
from tensorwire.errors import TensorwireError
from tensorwire.types import TensorMeta
from tensorwire.wire import codec_py
from tensorwire.wire.dtypes import SUPPORTED_DTYPES


def _compiled() -> ModuleType:
    try:
        return importlib.import_module("tensorwire.wire.codec_c")
    except ImportError:
        if _extensions.disabled():  # an install told not to build it: the fallback run
            pytest.skip("tensorwire.wire.codec_c is not built (TENSORWIRE_NO_EXTENSIONS)")
        raise  # `make install` builds it: a missing build here is a failure, not a skip


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
metas = st.builds(
    lambda name, dtype, shape, version: TensorMeta(
        name, dtype, tuple(shape), math.prod(shape) * dtype.itemsize, version
    ),
    names,
    st.sampled_from(SUPPORTED_DTYPES),
    st.lists(st.integers(0, 1 << 12), max_size=4),
    st.integers(0, (1 << 64) - 1),
)


def _outcome(fn: Callable[[], object]) -> object:
    """What a call did: its result, or its error's type and words."""
    try:
        return fn()
    except TensorwireError as exc:
        return type(exc), str(exc)


@given(st.lists(metas, max_size=20))
def test_both_codecs_encode_and_decode_the_same_records(batch: list[TensorMeta]) -> None:
    c = _compiled()
    block = codec_py.pack_records(batch)
    assert c.pack_records(batch) == block
    for module in (codec_py, c):
        assert module.decode_records(block, 0, len(batch), 1 << 16, 255) == (batch, len(block))
    names_block = codec_py.pack_names([m.name for m in batch])
    assert c.pack_names([m.name for m in batch]) == names_block
    assert c.decode_names(names_block, 0, len(batch), 1 << 16) == codec_py.decode_names(
        names_block, 0, len(batch), 1 << 16
    )


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
@given(
    st.lists(metas, min_size=1, max_size=6),
    st.data(),
    st.integers(0, 300),  # the count the block claims
    st.integers(0, 64),  # max_name
    st.integers(0, 255),  # max_ndim
)
def test_a_mutated_block_meets_the_same_answer_from_both(
    batch: list[TensorMeta], data: st.DataObject, count: int, max_name: int, max_ndim: int
) -> None:
    c = _compiled()
    block = bytearray(codec_py.pack_records(batch))
    for _ in range(data.draw(st.integers(0, 4))):  # overwrite bytes: lengths, codes, dims, sizes
        at = data.draw(st.integers(0, len(block) - 1))
        block[at] = data.draw(st.integers(0, 255))
    cut = bytes(block[: data.draw(st.integers(0, len(block)))])
    start = data.draw(st.integers(0, len(cut)))
    py = _outcome(lambda: codec_py.decode_records(cut, start, count, max_name, max_ndim))
    assert _outcome(lambda: c.decode_records(cut, start, count, max_name, max_ndim)) == py
    py = _outcome(lambda: codec_py.decode_names(cut, start, count, max_name))
    assert _outcome(lambda: c.decode_names(cut, start, count, max_name)) == py


@pytest.mark.parametrize("module", ["codec_py", "codec_c"])
def test_sizes_a_peer_chooses_cannot_overflow(module: str) -> None:
    """Dims near 2**63 whose product wraps around in 64 bits must not pass the size check."""
    codec = codec_py if module == "codec_py" else _compiled()
    huge = 1 << 62
    body = struct.pack("<BB2qQQ", 9, 2, huge, 4, 0, 0)  # float32 [2**62, 4]: 2**66 bytes, claims 0
    block = struct.pack("<H", 1) + b"x" + body
    with pytest.raises(TensorwireError, match="needs"):
        codec.decode_records(block, 0, 1, 1024, 255)
    negative = struct.pack("<H", 1) + b"x" + struct.pack("<BB2qQQ", 9, 2, -1, -4, 16, 0)
    with pytest.raises(TensorwireError, match="negative"):
        codec.decode_records(negative, 0, 1, 1024, 255)
