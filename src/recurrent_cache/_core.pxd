# cython: language_level=3
"""The memory core's Python-facing handle (``_core.pyx``): ``MemoryCore`` owns one ``Core``
(``_core_ops``), whose ``core_*`` functions the facade's calls and the C API's make every change through."""

from libc.stdint cimport int32_t

from ._core_ops cimport Core
from ._split cimport Split
from ._state_io cimport BlobDefect

cdef class MemoryCore:
    cdef Core core
    cdef readonly object storage     # where the tensors below live (``recurrent_cache.storage``)
    cdef readonly tuple dtypes       # the StateType of r and of s
    cdef readonly tuple kinds        # the cells' tensors: r [n_state, size, n_embd_r], s [.., n_embd_s]
    cdef readonly tuple layers       # the layers with state, sorted
    cdef tuple history_kinds         # the same per kind for the history: [n_state, size * n_rollback, n_embd]
    cdef object tags                 # [size, n_rollback] int32: the history's tags (host memory)
    cdef tuple step_kinds            # the step scratch per kind: [n_state, capacity, n_embd] (views stay valid)
    cdef list stage                  # logged: host copies of the cells' tensors per kind, for state I/O
    cdef dict host_views             # space -> the numpy views the C code addresses, kept alive
    cdef object broken_by            # the storage's exception that broke the core (core.broken)
    cdef int usable(self, str what) except -1
    cdef int break_on(self, object failure) except -1
    cdef int reserve_steps(self, Py_ssize_t rows) except -1
    cdef int flush(self) except -1
    cdef int finish(self) except -1
    cdef int apply_ubatch(self, const Split* split, int32_t u, const int32_t* seq_ids) except 1
    cdef int flush_log(self) except -1
    cdef list staged(self)
    cdef stage_cells(self, int32_t seq_id)
    cdef const unsigned char[::1] host_row(self, object given, Py_ssize_t k)
    cdef object as_storage_rows(self, list rows, Py_ssize_t kind)
    cdef list host_of(self, tuple tensors)
    cdef address(self, str space, list host, char** pointers)
    cdef Py_ssize_t write(self, unsigned char* out, Py_ssize_t capacity, int32_t seq_id) except -1
    cdef object blob_error(self, int code, const BlobDefect* d, Py_ssize_t length)
