# cython: language_level=3
"""The compiled route to ``views_py.byte_view`` (see there): the same views, without numpy.

A ``TensorBytes`` holds the tensor and exports its bytes from ``data_ptr()``; the memoryview holds
the ``TensorBytes``, so the tensor lives as long as any view of it. Only plain contiguous CPU
tensors of a strided layout, whose bytes are their values (no conjugate or negative bit), take
this route; every other tensor goes to ``views_py.byte_view``, which views or refuses it exactly
as without this module (tests/unit/test_views.py runs one against the other).
"""

from cpython.buffer cimport PyBuffer_FillInfo
from libc.stdint cimport uintptr_t

import torch

from tensorwire.wire import views_py

cdef object _Tensor = torch.Tensor
cdef object _Parameter = torch.nn.Parameter
cdef object _strided = torch.strided


cdef class TensorBytes:
    """A tensor's bytes, for ``memoryview`` (writable, format ``B``)."""

    cdef object tensor
    cdef char* data
    cdef Py_ssize_t size

    def __getbuffer__(self, Py_buffer* view, int flags):
        PyBuffer_FillInfo(view, self, self.data, self.size, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass


cpdef object byte_view(object tensor):
    """As ``views_py.byte_view``."""
    cdef object kind = type(tensor)
    cdef TensorBytes exported
    if (
        (kind is _Tensor or kind is _Parameter)
        and tensor.is_cpu
        and tensor.layout is _strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel()
    ):
        exported = TensorBytes.__new__(TensorBytes)
        exported.tensor = tensor
        exported.data = <char*><uintptr_t>tensor.data_ptr()
        exported.size = tensor.nbytes
        return memoryview(exported)
    return views_py.byte_view(tensor)
