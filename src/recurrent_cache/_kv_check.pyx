# cython: language_level=3
"""Every invariant of the KV cell table, checked cell by cell (``KVCells.check``; the codes: ``_kv_check.pxd``).

Reads the table only; O(size + pairs), for tests and debugging.
"""

from libc.stdint cimport INT32_MAX, int32_t, uint64_t

from ._kv_seq_pos cimport sp_check, sp_collect


cdef int kv_check(KvTable* t, int64_t* where) noexcept nogil:
    cdef int32_t cell, w, s, k, n, used = 0, top = 0, bits
    cdef int64_t members = 0, total
    cdef uint64_t word
    cdef bint empty
    for cell in range(t.size):
        where[0] = cell
        empty = (t.free_bits[cell >> 6] >> (cell & 63)) & 1
        if (t.pos[cell] < 0) != empty or (t.pos[cell] < 0) != (t.n_seq[cell] == 0) or t.pos[cell] < -1:
            return KV_CHECK_EMPTY
        bits = 0
        for w in range(t.seq_words):
            word = t.seq_bits[<int64_t>cell * t.seq_words + w]
            if w == t.seq_words - 1 and (t.n_seq_max & 63) and word >> (t.n_seq_max & 63):
                return KV_CHECK_COUNT
            while word:
                word &= word - 1
                bits += 1
        if bits != t.n_seq[cell]:
            return KV_CHECK_COUNT
        if empty and t.shift[cell] != 0:
            return KV_CHECK_SHIFT
        if not empty:
            used += 1
            top = cell + 1
        members += bits
    total = members
    where[0] = -1
    if used != t.used or top != t.top:
        return KV_CHECK_USED
    if t.head < 0 or t.head > t.size:
        return KV_CHECK_HEAD
    for s in range(t.n_seq_max):
        where[0] = s
        if sp_check(&t.seqs, s, t.pos, t.size):
            return KV_CHECK_TREE
        n = sp_collect(&t.seqs, s, 0, INT32_MAX, t.scratch)
        for k in range(n):
            if not (t.seq_bits[<int64_t>t.scratch[k] * t.seq_words + (s >> 6)] >> (s & 63)) & 1:
                return KV_CHECK_TREE
        members -= n
    where[0] = -1
    if members != 0 or t.seqs.nodes_live != total:
        return KV_CHECK_TREE
    if t.journal.on or t.journal.n:
        return KV_CHECK_JOURNAL
    for cell in range(t.size):
        where[0] = cell
        if t.mark[cell]:
            return KV_CHECK_JOURNAL
    return 0
