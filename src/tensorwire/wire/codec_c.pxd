# C types for codec_py.py, compiled by Cython as tensorwire.wire.codec_c (setup.py). Offsets and
# lengths are C integers, bounded by the block's length; sizes a peer sends (shape, nbytes,
# version) stay Python integers, so no product of them can overflow.
import cython

@cython.locals(metas=list, end=Py_ssize_t, start=Py_ssize_t, code=int, ndim=Py_ssize_t, values=tuple, shape=tuple, itemsize=Py_ssize_t)
cpdef tuple decode_records(bytes buf, Py_ssize_t pos, Py_ssize_t count, Py_ssize_t max_name, Py_ssize_t max_ndim)

@cython.locals(names=list, end=Py_ssize_t)
cpdef tuple decode_names(bytes buf, Py_ssize_t pos, Py_ssize_t count, Py_ssize_t max_name)

@cython.locals(n=Py_ssize_t, start=Py_ssize_t)
cdef tuple _string_at(bytes buf, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_bytes)

@cython.locals(parts=list, ndim=Py_ssize_t)
cpdef bytes pack_records(metas)

cpdef bytes pack_names(names)

@cython.locals(raw=bytes)
cpdef bytes pack_string(str value)
