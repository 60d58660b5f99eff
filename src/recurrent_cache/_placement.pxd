# cython: language_level=3
"""C-level API of the compiled engine's placement of one batch (``_placement.Placement``).

Besides what the facade calls from Python, a placement hands the tokens of its ubatches to other
compiled code as C arrays: a hybrid memory places the same ubatches in its KV table
(``_hybrid_step``) without building a Python object per ubatch.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint8_t

from ._core cimport MemoryCore
from ._split cimport Split


@cython.final
cdef class Placement:
    cdef MemoryCore core
    cdef Split split
    cdef const int32_t[::1] seq_id_flat   # [n_entries] the batch's seq ids (kept alive here)
    cdef const int32_t[::1] positions     # [n_tokens] the batch's positions (kept alive here)
    cdef readonly int32_t head            # first row of the last applied ubatch
    cdef readonly int32_t n_kv            # cells from head its plan covers
    cdef int32_t* copy_src_buf            # [capacity] the last plan, copied out of the table's
    cdef uint8_t* zero_buf                # [capacity] scratch (another placement reuses that)
    cdef int32_t capacity

    cdef int keep_plan(self, int32_t head, int32_t n) noexcept nogil
    cdef int _check(self, int32_t u) except -1

    # Every ubatch's tokens as an attention KV table takes them (each token listing its group's seq ids):
    # token_entries() is the length of flat; token_arrays fills bounds[n_ubatches + 1] (ubatch u's tokens
    # are [bounds[u], bounds[u + 1])), pos[n_tokens], offsets[n_tokens + 1] (token t's seq ids are
    # flat[offsets[t]:offsets[t + 1]]) and flat, tokens in ubatch order.
    cdef int64_t token_entries(self) noexcept nogil
    cdef void token_arrays(self, int32_t* bounds, int32_t* pos, int32_t* offsets, int32_t* flat) noexcept nogil
