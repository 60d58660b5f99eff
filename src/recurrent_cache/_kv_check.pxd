# cython: language_level=3
"""C-level API of the KV table's invariants' check."""

from libc.stdint cimport int64_t

from ._kv_table cimport KvTable

# every invariant: 0, or a KV_CHECK_* with the offending cell or sequence in *where (-1: the table)
cdef enum:
    KV_CHECK_EMPTY = 1        # pos, n_seq and the free bit disagree
    KV_CHECK_COUNT = 2        # n_seq is not the size of the sequence set / a bit beyond n_seq_max
    KV_CHECK_SHIFT = 3        # an empty cell with a shift
    KV_CHECK_USED = 4         # used or top is wrong
    KV_CHECK_TREE = 5         # a sequence's ordered pairs disagree with the cells
    KV_CHECK_HEAD = 6         # head outside [0, size]
    KV_CHECK_JOURNAL = 7      # between calls: the journal on or holding cells, or a cell marked
cdef int kv_check(KvTable* t, int64_t* where) noexcept nogil
