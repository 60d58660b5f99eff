# cython: language_level=3
"""C-level API of the cell table: cells, find_slot, sequence operations, copy plan.

Every function here is ``noexcept nogil``: failures are reported as the
negative codes of ``_codes`` and turned into exceptions in one place
(``recurrent_cache.errors.engine_error``).

Cell membership is an intrusive doubly linked list per cell (``first`` /
``next`` / ``prev``, indexed by seq id), so joining, leaving and counting are
O(1) and a sequence never needs a scan of the cell table.  Free cells are a
bitset scanned a 64-bit word at a time.  Writes go through ``set32`` /
``set64`` so that ``prepare`` can journal them and roll a simulation back in
O(changes) instead of copying every cell.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from ._codes cimport (RC_OK, RC_ERR_SEQ_RANGE, RC_ERR_DUPLICATE_SEQ, RC_ERR_NO_FREE_CELL, RC_ERR_NO_MEMORY,
                      RC_ERR_PLACEMENT, RC_ERR_POSITION, RC_ERR_ARGUMENT, RC_ERR_SEQ_HAS_CELL, RC_ERR_BROKEN)

cdef struct JournalEntry:
    int32_t* addr32           # exactly one of addr32 / addr64 is set
    uint64_t* addr64
    int64_t old

cdef struct Cells:
    int32_t size
    int32_t head              # where the next free-cell search starts / first cell of the ubatch
    int32_t used              # non-empty cells, maintained
    int32_t n                 # cells from head touched by the last find_slot
    int32_t* pos              # [size] last position in the state, -1 when empty
    int32_t* src              # [size] row holding the cell's data, -1 = start from zeros
    int32_t* tail             # [size] by seq id: the cell holding the sequence, or -1
    int32_t* n_seq            # [size] number of sequences in the cell
    int32_t* first            # [size] first member seq of the cell, or -1
    int32_t* next             # [size] by seq id: next member of the same cell, or -1
    int32_t* prev             # [size] by seq id: previous member, or -1
    int32_t* stamp            # [size] by seq id: stamp[seq] == stamp_epoch marks seq as seen
    int32_t* scratch          # [size] by seq id: a value per seq, valid where marked
    int32_t stamp_epoch
    uint64_t* free_bits       # [n_words] bit c set = cell c is free
    int32_t n_words
    bint journaling
    JournalEntry* journal
    Py_ssize_t journal_len
    Py_ssize_t journal_cap
    int journal_failed

# lifecycle
cdef int cells_init(Cells* c, int32_t size) noexcept nogil
cdef void cells_release(Cells* c) noexcept nogil
cdef void cells_clear(Cells* c) noexcept nogil

# sequence operations (positions already normalised by the caller: p1 < 0 means +inf)
cdef bint cells_seq_rm(Cells* c, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
cdef void cells_seq_cp(Cells* c, int32_t seq_src, int32_t seq_dst) noexcept nogil
cdef int cells_seq_keep(Cells* c, int32_t seq) noexcept nogil  # RC_ERR_SEQ_RANGE: nothing changed
cdef int32_t cells_tail_in_range(const Cells* c, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
# seq_add / seq_div move the pos of seq's cell when it lies in [p0, p1); RC_OK, RC_ERR_SEQ_RANGE,
# RC_ERR_POSITION or RC_ERR_ARGUMENT (nothing changed then)
cdef int cells_seq_add(Cells* c, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
cdef int cells_seq_div(Cells* c, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil
cdef int32_t cells_seq_pos_min(const Cells* c, int32_t seq) noexcept nogil
cdef int32_t cells_seq_pos_max(const Cells* c, int32_t seq) noexcept nogil
cdef int32_t cells_next_free(const Cells* c, int32_t start) noexcept nogil
# seq (in [0, size) and in no cell) joins cell, which stops being free: for state_read
cdef void cells_join(Cells* c, int32_t cell, int32_t seq) noexcept nogil
# seq leaves its cell: the cell if that emptied it (now free), else -1
cdef int32_t cells_leave(Cells* c, int32_t seq) noexcept nogil
cdef void cells_new_epoch(Cells* c) noexcept nogil  # forget every stamp in O(1)

# placement of one ubatch: n_seqs groups; group s lists seq ids
# seq_ids[seq_offset[s]:seq_offset[s] + n_seq_id[s]] (owner first) and ends at last_pos[s].
# seq_offset and n_seq_id may be NULL when every group is one sequence: group s is seq_ids[s].
# Seq ids are checked (range, each once per ubatch); positions are not: validate them first
# (split_batch does) or find_slot places whatever it is given.
cdef int cells_find_slot(Cells* c, int32_t n_seqs, int32_t n_tokens,
                         const int32_t* seq_ids, const int32_t* seq_offset,
                         const int32_t* n_seq_id, const int32_t* last_pos) noexcept nogil

# copy plan for cells [head, head + n): copy_src[i], zero[i]; then src = own index
cdef void cells_copy_plan(Cells* c, int32_t* copy_src, uint8_t* zero) noexcept nogil

# every invariant of docs/concepts.md §1: 0, or the CHECK_* it breaks, with the offending cell in *where
cdef enum:
    CHECK_SEQ_RANGE = 1
    CHECK_TAIL = 2
    CHECK_LIST = 3
    CHECK_COUNT = 4
    CHECK_FREE_BIT = 5
    CHECK_EMPTY = 6
    CHECK_DANGLING = 7
    CHECK_USED = 8
cdef int cells_check(const Cells* c, int32_t* where=*) noexcept nogil
cdef str cells_check_message(const Cells* c, int broken, int32_t at)   # the sentence for a CHECK_* at `at`

# prepare support: journal every write, then undo them all
cdef void cells_journal_begin(Cells* c) noexcept nogil
cdef int cells_journal_rollback(Cells* c, int32_t head, int32_t used, int32_t n) noexcept nogil
