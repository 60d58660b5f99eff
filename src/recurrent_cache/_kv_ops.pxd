# cython: language_level=3
"""C-level API of the attention KV cell table (docs/hybrid.md, "KV cells"); ``_kv_cells.KVCells`` is
its Python class.

The table, its failure codes and its journal are declared in ``_kv_table.pxd``.
Every function is ``noexcept nogil`` and reports a failure as one of those codes
(``kv_reference.CODES`` has the same numbers; ``kv_reference.kv_error``
words them), with the values involved in ``*a`` / ``*b``.  A failing call has
changed nothing.

A token's sequences are given as ``flat[offsets[t]:offsets[t + 1]]`` (offsets
``[n + 1]``), positions as ``pos[n]``.
"""

from libc.stdint cimport int32_t, int64_t

from ._kv_table cimport (KV_CELL_COUNT, KV_CELL_INDEX, KV_CELL_TAKEN, KV_DIVISOR, KV_DUPLICATE_SEQ, KV_NO_MEMORY,
                        KV_NO_SLOT, KV_OK, KV_POSITION, KV_SEQ_RANGE, KV_SHIFT_POSITION, KV_SHIFT_RANGE,
                        KV_TOO_MANY_CELLS, MARK_LISTED, MARK_SAVED, SWA_CHUNKED, SWA_NONE, SWA_STANDARD,
                        SWA_SYMMETRIC, KvJournal, KvTable)

cdef enum:
    POS_END = 2147483647      # INT32_MAX: positions lie in [0, POS_END); a range to POS_END runs to the end

cdef int kv_init(KvTable* t, int32_t size, int32_t n_seq_max, int32_t n_swa, int32_t swa_type) noexcept nogil
cdef void kv_release(KvTable* t) noexcept nogil
cdef void kv_clear(KvTable* t) noexcept nogil

# token checks shared by find_slot, apply and the mask: seq ids in range and once per token, 0 <= pos < 2**31 - 1
cdef int kv_check_tokens(const KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat,
                         const int32_t* offsets, int64_t* a, int64_t* b) noexcept nogil
# the cells of n tokens into slot[n] (KV_OK), or KV_NO_SLOT; tokens must have passed kv_check_tokens
cdef int kv_find_slot(const KvTable* t, int32_t n, bint cont, int32_t* slot) noexcept nogil
cdef int kv_apply(KvTable* t, int32_t n, const int32_t* slot, const int32_t* pos, const int32_t* flat,
                  const int32_t* offsets, int64_t* a, int64_t* b) noexcept nogil

# sequence operations; p0 / p1 already normalised (p1 = 2**31 - 1 for "to the end"); seq checked
cdef int kv_seq_rm(KvTable* t, int32_t seq, int32_t p0, int32_t p1) noexcept nogil   # seq -1: every sequence
cdef int kv_seq_cp(KvTable* t, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil
cdef int kv_seq_keep(KvTable* t, int32_t seq) noexcept nogil
cdef int kv_seq_add(KvTable* t, int32_t seq, int32_t p0, int32_t p1, int32_t delta, int64_t* a,
                    int64_t* b) noexcept nogil
cdef int kv_seq_div(KvTable* t, int32_t seq, int32_t p0, int32_t p1, int32_t d, int64_t* a,
                    int64_t* b) noexcept nogil
cdef int32_t kv_seq_pos_min(const KvTable* t, int32_t seq) noexcept nogil
cdef int32_t kv_seq_pos_max(const KvTable* t, int32_t seq) noexcept nogil
cdef bint kv_seq_has(const KvTable* t, int32_t cell, int32_t seq) noexcept nogil
cdef void kv_reset_shift(KvTable* t) noexcept nogil
# the cells a ubatch attends to: [0, top) rounded up to a multiple of pad (>= 1), at most size
cdef int32_t kv_padded_n_kv(const KvTable* t, int32_t pad) noexcept nogil

# the slots of several ubatches, each placed tentatively for the next to see, then the table put back as it
# was: slots[bounds[u]:bounds[u + 1]] for ubatch u (tokens [bounds[u], bounds[u + 1]) of pos / offsets)
cdef int kv_prepare(KvTable* t, int32_t n_ubatch, const int32_t* bounds, const int32_t* pos, const int32_t* flat,
                    const int32_t* offsets, int32_t* slots, int64_t* a, int64_t* b) noexcept nogil
# every cell replaced: cells [0, n) take the n checked tokens, the rest empty, head 0, no shift
cdef int kv_load(KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat, const int32_t* offsets) noexcept nogil
# seq's cells replaced by n checked tokens of seq alone (flat / offsets list seq once per token), at slot[n];
# KV_NO_SLOT (nothing changed) when they fit nowhere
cdef int kv_load_seq(KvTable* t, int32_t seq, int32_t n, const int32_t* pos, const int32_t* flat,
                     const int32_t* offsets, int32_t* slot, int64_t* a, int64_t* b) noexcept nogil

