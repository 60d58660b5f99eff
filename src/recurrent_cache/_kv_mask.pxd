# cython: language_level=3
"""C-level API of the KV table's mask (docs/hybrid.md, "The mask")."""

from libc.stdint cimport int32_t

from ._kv_table cimport KvTable

# the mask [n, n_kv] float32 (0 visible, -inf not) of n checked tokens; `sliding` applies the window
cdef int kv_mask(const KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat, const int32_t* offsets,
                 float* out, int32_t n_kv, bint sliding) noexcept nogil
