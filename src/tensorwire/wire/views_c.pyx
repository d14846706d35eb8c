# cython: language_level=3
"""The compiled twin of ``views_py``: ``byte_view`` without numpy, ``copy_out`` with memcpy.

A ``TensorBytes`` holds the tensor and exports its bytes from ``data_ptr()``; the memoryview holds
the ``TensorBytes``, so the tensor lives as long as any view of it. Only plain contiguous CPU
tensors of a strided layout, whose bytes are their values (no conjugate or negative bit), take
this route; every other tensor goes to ``views_py.byte_view``, which views or refuses it exactly
as without this module (tests/unit/test_views.py runs one against the other).
"""

from cpython.buffer cimport (
    PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_FillInfo, PyBuffer_Release, PyObject_GetBuffer,
)
from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

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


cpdef Py_ssize_t copy_out(object staged, list run, Py_ssize_t first, Py_ssize_t last, Py_ssize_t pos) except -1:
    """As ``views_py.copy_out``: one memcpy per view, bounds checked against ``staged``."""
    cdef Py_buffer source
    cdef Py_buffer dest
    cdef Py_ssize_t i
    PyObject_GetBuffer(staged, &source, PyBUF_SIMPLE)
    try:
        for i in range(first, min(last, len(run))):
            PyObject_GetBuffer(run[i], &dest, PyBUF_WRITABLE)
            try:
                if pos < 0 or dest.len > source.len - pos:
                    raise ValueError("the staging buffer is shorter than the views it fills")
                memcpy(dest.buf, <char*>source.buf + pos, dest.len)
                pos += dest.len
            finally:
                PyBuffer_Release(&dest)
    finally:
        PyBuffer_Release(&source)
    return pos
