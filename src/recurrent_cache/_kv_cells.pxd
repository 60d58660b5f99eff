# cython: language_level=3
"""The KV cell table's Python class (``_kv_cells.KVCells``) for ``cimport``: its table, and its C-level
entry points for the compiled hybrid step.  The table's own functions are ``_kv_ops``'."""

from libc.stdint cimport int32_t

from ._kv_table cimport KvTable


cdef class KVCells:
    cdef KvTable t
    cdef readonly str swa_type

    cdef int32_t checked_seq(self, seq) except -2
    cdef tuple tokens(self, pos, seq_ids)
    cdef tuple bounds(self, p0, p1)
    # The C-level entry points of prepare and apply, for a memory that holds its ubatches' tokens as C arrays
    # (the hybrid step): the token checks, then kv_prepare / kv_apply; a refused call raises the table's
    # error and changes nothing.  prepare_tokens returns 1, or 0 when the ubatches fit nowhere.
    cdef int prepare_tokens(self, int32_t n_ubatch, const int32_t* bounds, const int32_t* pos, const int32_t* flat,
                            const int32_t* offsets, int32_t* slots) except -1
    cdef int apply_tokens(self, int32_t n, const int32_t* cells, const int32_t* pos, const int32_t* flat,
                          const int32_t* offsets) except -1
    # the cells a ubatch attends to: [0, top) rounded up to a multiple of pad (>= 1), at most size
    cdef int32_t padded_n_kv(self, int32_t pad) noexcept nogil
