# cython: language_level=3
"""C-level API of the attention KV cell table (docs/hybrid.md, "KV cells").

Every function is ``noexcept nogil`` and reports a failure as one of the codes
below (``kv_reference.CODES`` has the same numbers; ``kv_reference.kv_error``
words them), with the values involved in ``*a`` / ``*b``.  A failing call has
changed nothing.

A token's sequences are given as ``flat[offsets[t]:offsets[t + 1]]`` (offsets
``[n + 1]``), positions as ``pos[n]``.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from ._kv_seq_pos cimport SeqPositions

cdef enum:
    KV_OK = 0
    KV_SEQ_RANGE = 1
    KV_POSITION = 2
    KV_DUPLICATE_SEQ = 3
    KV_CELL_INDEX = 4
    KV_CELL_TAKEN = 5
    KV_DIVISOR = 6
    KV_SHIFT_POSITION = 7
    KV_CELL_COUNT = 8
    KV_NO_MEMORY = 9
    KV_NO_SLOT = 10           # find_slot: the ubatch fits nowhere (not an error: None in Python)
    KV_SHIFT_RANGE = 11
    KV_TOO_MANY_CELLS = 12    # load: more cells than the table holds

cdef enum:
    SWA_NONE = 0
    SWA_STANDARD = 1
    SWA_CHUNKED = 2
    SWA_SYMMETRIC = 3

cdef enum:                   # bits of KvTable.mark
    MARK_LISTED = 1           # apply: the cell is in the slot already
    MARK_SAVED = 2            # the journal holds the cell's state from before the operation being undone

cdef struct KvJournal:        # cells' states to put back (_kv_journal): prepare and load_seq undo through it
    bint on                   # apply and seq_rm of one sequence save each cell before they first change it
    int32_t n                 # cells saved
    int32_t cap
    int32_t* cell             # [cap] the saved cell  (one block: cell, pos, shift, n_seq)
    int32_t* pos              # [cap] its position, shift and sequence count then
    int32_t* shift            # [cap]
    int32_t* n_seq            # [cap]
    uint64_t* seq_bits        # [cap * seq_words] its sequence set then
    int32_t head              # the table's head, used and top then
    int32_t used
    int32_t top

cdef struct KvTable:
    int32_t size
    int32_t n_seq_max
    int32_t n_swa
    int32_t swa_type
    int32_t head              # where the next slot search starts
    int32_t used              # cells holding a token
    int32_t top               # one past the last used cell (0 when none)
    bint has_shift
    int32_t seq_words         # uint64 words of one cell's sequence set
    int32_t free_words        # uint64 words of free_bits
    int32_t* pos              # [size] position, -1 = empty
    int32_t* shift            # [size] position change since the keys were last rotated
    int32_t* n_seq            # [size] sequences in the cell
    uint64_t* seq_bits        # [size * seq_words] bit s of cell i: sequence s holds cell i
    uint64_t* free_bits       # [free_words] bit i set: cell i is empty
    uint8_t* mark             # [size] scratch marks, all 0 between calls
    int32_t* scratch          # [size] cells collected by an operation
    int32_t* max_rm           # [n_seq_max] apply: the largest position overwritten per sequence
    SeqPositions seqs         # per sequence, its (position, cell) pairs ordered
    KvJournal journal

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

# every invariant: 0, or a CHECK_* with the offending cell or sequence in *where
cdef enum:
    KV_CHECK_EMPTY = 1        # pos, n_seq and the free bit disagree
    KV_CHECK_COUNT = 2        # n_seq is not the size of the sequence set / a bit beyond n_seq_max
    KV_CHECK_SHIFT = 3        # an empty cell with a shift
    KV_CHECK_USED = 4         # used or top is wrong
    KV_CHECK_TREE = 5         # a sequence's ordered pairs disagree with the cells
    KV_CHECK_HEAD = 6         # head outside [0, size]
cdef int kv_check(KvTable* t, int64_t* where) noexcept nogil
