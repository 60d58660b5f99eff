# cython: language_level=3
"""The KV table's journal: the cells an operation changed, put back in O(cells changed).

``prepare`` places each ubatch for the next to see and must then leave the
table exactly as it was; ``load_seq`` must leave it as it was when no slot
exists.  Copying the table would cost O(size) per call; the journal instead
saves each cell the first time ``apply`` or ``seq_rm`` changes it (position,
shift, sequence set), and ``kj_undo`` restores those cells, their sequences'
(position, cell) pairs, and the table's head, used and top.
"""

from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from ._kv_seq_pos cimport sp_erase, sp_insert

cdef extern from "rc_bits.h":
    int rc_ctz64(uint64_t x) noexcept nogil


cdef void list_cell(KvTable* t, int32_t cell, bint listed) noexcept nogil:
    """Put the cell's pairs into its sequences' trees (``listed``) or take them out (before its
    position changes or it empties)."""
    cdef int32_t w, s
    cdef uint64_t word
    for w in range(t.seq_words):
        word = t.seq_bits[<int64_t>cell * t.seq_words + w]
        while word:
            s = w * 64 + rc_ctz64(word)
            word &= word - 1
            if listed:
                sp_insert(&t.seqs, s, t.pos[cell], cell)
            else:
                sp_erase(&t.seqs, s, t.pos[cell], cell)


cdef bint kj_reserve(KvTable* t, int64_t extra) noexcept nogil:
    """Each cell is saved at most once, so the journal never needs more than ``size`` entries."""
    cdef KvJournal* j = &t.journal
    cdef int64_t need = min(<int64_t>j.n + extra, <int64_t>t.size)
    cdef int64_t cap = j.cap
    cdef int32_t* block
    cdef uint64_t* bits
    if need <= cap:
        return True
    while cap < need:
        cap = cap * 2 if cap else 64
    cap = min(cap, <int64_t>t.size)
    block = <int32_t*>malloc(<size_t>4 * <size_t>cap * sizeof(int32_t))
    bits = <uint64_t*>malloc(<size_t>cap * <size_t>t.seq_words * sizeof(uint64_t))
    if block == NULL or bits == NULL:
        free(block)
        free(bits)
        return False
    memcpy(block, j.cell, <size_t>j.n * sizeof(int32_t))
    memcpy(block + cap, j.pos, <size_t>j.n * sizeof(int32_t))
    memcpy(block + 2 * cap, j.shift, <size_t>j.n * sizeof(int32_t))
    memcpy(block + 3 * cap, j.n_seq, <size_t>j.n * sizeof(int32_t))
    memcpy(bits, j.seq_bits, <size_t>j.n * <size_t>t.seq_words * sizeof(uint64_t))
    free(j.cell)
    free(j.seq_bits)
    j.cell, j.pos, j.shift, j.n_seq = block, block + cap, block + 2 * cap, block + 3 * cap
    j.seq_bits = bits
    j.cap = <int32_t>cap
    return True


cdef void kj_begin(KvTable* t) noexcept nogil:
    t.journal.on = True
    t.journal.n = 0
    t.journal.head, t.journal.used, t.journal.top = t.head, t.used, t.top


cdef void kj_save(KvTable* t, int32_t cell) noexcept nogil:
    cdef KvJournal* j = &t.journal
    j.cell[j.n] = cell
    j.pos[j.n] = t.pos[cell]
    j.shift[j.n] = t.shift[cell]
    j.n_seq[j.n] = t.n_seq[cell]
    memcpy(&j.seq_bits[<int64_t>j.n * t.seq_words], &t.seq_bits[<int64_t>cell * t.seq_words],
           <size_t>t.seq_words * sizeof(uint64_t))
    j.n += 1
    t.mark[cell] |= MARK_SAVED


cdef void kj_undo(KvTable* t) noexcept nogil:
    """Every saved cell back as it was.  All their current pairs leave the trees before the saved ones
    return, so the node pool never holds more pairs than it held before the operation."""
    cdef KvJournal* j = &t.journal
    cdef int32_t k, cell
    for k in range(j.n):
        if t.pos[j.cell[k]] >= 0:
            list_cell(t, j.cell[k], False)
    for k in range(j.n):
        cell = j.cell[k]
        t.pos[cell] = j.pos[k]
        t.shift[cell] = j.shift[k]
        t.n_seq[cell] = j.n_seq[k]
        memcpy(&t.seq_bits[<int64_t>cell * t.seq_words], &j.seq_bits[<int64_t>k * t.seq_words],
               <size_t>t.seq_words * sizeof(uint64_t))
        if t.pos[cell] >= 0:
            t.free_bits[cell >> 6] &= ~(<uint64_t>1 << (cell & 63))
            list_cell(t, cell, True)
        else:
            t.free_bits[cell >> 6] |= <uint64_t>1 << (cell & 63)
    t.head, t.used, t.top = j.head, j.used, j.top
    kj_commit(t)


cdef void kj_commit(KvTable* t) noexcept nogil:
    cdef KvJournal* j = &t.journal
    cdef int32_t k
    for k in range(j.n):
        t.mark[j.cell[k]] &= <uint8_t>~MARK_SAVED
    j.n = 0
    j.on = False


cdef void kj_release(KvTable* t) noexcept nogil:
    free(t.journal.cell)
    free(t.journal.seq_bits)
    t.journal.cell = NULL
    t.journal.seq_bits = NULL
    t.journal.cap = 0
    t.journal.n = 0
    t.journal.on = False
