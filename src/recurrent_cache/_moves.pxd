# cython: language_level=3
"""Row moves for a storage the core cannot address (device memory): recorded, then handed over.

A cache whose rows live where C cannot reach them (a GPU) still has its moves decided by
the core; instead of copying bytes, the core records each move here, in a log that resolves
chains as it goes (a row copied from a row written earlier in the same call reads that row's
own source), so that at the end of the call every pending move reads the rows as they were
when the call began.  The facade then executes the whole log at once: one gather and one
scatter per state kind for each (destination, source) pair of spaces (``_core``'s flush).
"""

from libc.stdint cimport int8_t, int32_t, uint8_t

cdef enum:
    SPACE_NONE = -1    # no move pending for this row
    SPACE_CELLS = 0    # the cache's rows: row c of cell c
    SPACE_HIST = 1     # the rollback history: slot c * n_rollback + q % n_rollback
    SPACE_STEPS = 2    # the step-state scratch the model writes
    SPACE_STAGE = 3    # host rows a state read or a restore wrote (the facade's staging buffers)
    SPACE_ZERO = 4     # a source: zeros
    N_DEST_SPACES = 2  # moves write cells and history slots only

cdef struct RowLog:
    Py_ssize_t n_rows[N_DEST_SPACES]       # rows of each destination space
    int8_t* from_space[N_DEST_SPACES]      # [n_rows] where each row's pending value comes from
    Py_ssize_t* from_row[N_DEST_SPACES]
    Py_ssize_t* touched[N_DEST_SPACES]     # the rows with a pending move, in the order first written
    Py_ssize_t n_touched[N_DEST_SPACES]
    int8_t* batch_space                    # scratch of a simultaneous batch (a copy plan)
    Py_ssize_t* batch_row
    Py_ssize_t batch_capacity

cdef bint log_init(RowLog* log, Py_ssize_t n_cells, Py_ssize_t n_slots) noexcept nogil   # False: out of memory
cdef void log_release(RowLog* log) noexcept nogil
cdef void log_reset(RowLog* log) noexcept nogil
cdef bint log_pending(const RowLog* log) noexcept nogil
# row dst of dst_space takes the value row src of src_space has now (SPACE_ZERO: zeros)
cdef void log_copy(RowLog* log, int dst_space, Py_ssize_t dst, int src_space, Py_ssize_t src) noexcept nogil
# a copy plan over cells head .. head+n-1 of `space`, `unit` rows per cell: every read before any write
cdef void log_copy_plan(RowLog* log, int space, Py_ssize_t unit, int32_t head, int32_t n,
                        const int32_t* copy_src, const uint8_t* zero) noexcept nogil
