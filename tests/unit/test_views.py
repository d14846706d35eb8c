"""``byte_view`` compiled (``views_c``: the bytes exported from ``data_ptr()``) against its
pure-Python twin (``views_py``: through numpy): the same bytes, the same memory, the same
refusals, and a view that keeps its tensor alive however the caller drops it."""

from __future__ import annotations

import gc
import importlib
import weakref
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from tensorwire import _extensions
from tensorwire.wire import views_py
from tensorwire.wire.dtypes import SUPPORTED_DTYPES


def _compiled() -> ModuleType:
    try:
        return importlib.import_module("tensorwire.wire.views_c")
    except ImportError:
        if _extensions.disabled():
            pytest.skip("tensorwire.wire.views_c is not built (TENSORWIRE_NO_EXTENSIONS)")
        raise  # `make install` builds it


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8)
    return raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 1, 4)])
def test_both_view_the_same_bytes_of_the_same_memory(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _tensor(dtype, shape)
    compiled, pure = _compiled().byte_view(tensor), views_py.byte_view(tensor)
    assert (compiled.format, compiled.ndim, compiled.readonly) == (pure.format, pure.ndim, pure.readonly)
    assert compiled.nbytes == pure.nbytes == tensor.nbytes and bytes(compiled) == bytes(pure)
    if tensor.nbytes:
        compiled[0] = (compiled[0] + 1) % 256  # writes land in the tensor: the get path fills views
        assert pure[0] == compiled[0]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0)[5:17],  # a storage offset
        lambda: torch.nn.Parameter(torch.rand(4, 3)),
        lambda: torch.rand(6, requires_grad=True),
        lambda: torch.zeros(0, 3),
    ],
    ids=["offset", "parameter", "requires-grad", "empty"],
)
def test_views_of_parameters_offsets_and_empty_tensors_agree(make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    assert bytes(_compiled().byte_view(tensor)) == bytes(views_py.byte_view(tensor))


def _outcome(fn: Callable[[], memoryview]) -> object:
    try:
        return bytes(fn())
    except Exception as exc:
        return type(exc)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.rand(4, 5).t(),  # not contiguous: its bytes are not its values in order
        lambda: torch.rand(3, dtype=torch.complex64).conj(),  # a conjugate view: bytes != values
        lambda: torch.rand(3, dtype=torch.complex64).conj().imag,  # a negative view
        lambda: torch.empty(4, device="meta"),  # no bytes at all
        lambda: torch.rand(4, 4).to_sparse(),
    ],
    ids=["transposed", "conjugate", "negative", "meta", "sparse"],
)
def test_tensors_whose_memory_is_not_their_values_get_the_pure_routes_answer(
    make: Callable[[], torch.Tensor],
) -> None:
    tensor = make()
    assert _outcome(lambda: _compiled().byte_view(tensor)) == _outcome(lambda: views_py.byte_view(tensor))


def test_a_view_keeps_its_tensor_alive_until_the_last_view_is_gone() -> None:
    tensor = torch.arange(1000, dtype=torch.int32)
    expected = bytes(views_py.byte_view(tensor))
    alive = weakref.ref(tensor)
    view = _compiled().byte_view(tensor)
    part = view[8:16]  # a slice of the view holds the export too
    del tensor
    gc.collect()
    assert alive() is not None and bytes(view) == expected and bytes(part) == expected[8:16]
    del view
    gc.collect()
    assert alive() is not None  # the slice still holds it
    del part
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("sizes", [[1024] * 700, [1, 3, 0, 4096, 7], [5]])
def test_both_copy_a_staged_run_out_alike(sizes: list[int]) -> None:
    staged = memoryview(bytes(range(256)) * (sum(sizes) // 256 + 1))[: sum(sizes) + 3]
    results = []
    for module in (views_py, _compiled()):
        run = [memoryview(bytearray(n)) for n in sizes]
        pos = module.copy_out(staged, run, 0, 512, 0)
        pos = module.copy_out(staged, run, 512, 1024, pos)
        results.append((pos, [bytes(v) for v in run]))
    assert results[0] == results[1] and results[0][0] == sum(sizes)
    assert b"".join(results[0][1]) == bytes(staged[: sum(sizes)])


def test_neither_copies_past_the_end_of_the_staging_buffer() -> None:
    for module in (views_py, _compiled()):
        run = [memoryview(bytearray(8)), memoryview(bytearray(8))]
        with pytest.raises(ValueError):
            module.copy_out(memoryview(bytearray(12)), run, 0, 2, 0)
