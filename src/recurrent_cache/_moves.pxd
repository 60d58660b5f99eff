# cython: language_level=3
"""The row mover: every move of state rows the core makes, in one place.

Each move site of the core (a copy plan, a zeroed row, a start state or step state filed into
the history, a rollback) makes one call here; whether the rows move now or later is decided
here only.  A storage with host memory (``Storage.host_access``) has its rows moved at once,
in C.  A cache whose rows live where C cannot reach them (a GPU) still has its moves decided by
the core, but the mover records them in a log that resolves chains as it goes (a row copied
from a row written earlier in the same call reads that row's own source), so that at the end
of the call every pending move reads the rows as they were when the call began.  The facade
then executes the whole log at once: one gather and one scatter per state kind for each
(destination, source) pair of spaces (``_core``'s flush).
"""

from libc.stdint cimport int8_t, int32_t, uint8_t

from ._codes cimport RC_ERR_NO_MEMORY, RC_OK

cdef enum:
    SPACE_NONE = -1    # no move pending for this row
    SPACE_CELLS = 0    # the cache's rows: row c of cell c
    SPACE_HIST = 1     # the rollback history: slot c * n_rollback + q % n_rollback
    SPACE_STEPS = 2    # the step-state scratch the model writes
    SPACE_STAGE = 3    # host rows a state read or a restore wrote (the facade's staging buffers)
    SPACE_ZERO = 4     # a source: zeros
    N_DEST_SPACES = 2  # moves write cells and history slots only
    N_ROW_SPACES = 4   # spaces whose rows have addresses (all but SPACE_ZERO)

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
# the recorded moves carried out by `storage` (``recurrent_cache.storage``): spaces holds the
# tensors (one per kind) of cells, history, step scratch and the host staging arrays; every row
# taken first, then written; one take / put / zero per kind and (destination, source) pair
cdef int log_carry_out(const RowLog* log, object storage, tuple spaces, tuple dtypes) except -1
cdef void log_copy_plan(RowLog* log, int space, Py_ssize_t unit, int32_t head, int32_t n,
                        const int32_t* copy_src, const uint8_t* zero) noexcept nogil


# rows: apply a copy plan to one block whose row c starts at data + c * row_stride (row_bytes
# of state each): row head+i <- row copy_src[i], all reads first; then zero rows.  RC_OK or
# RC_ERR_NO_MEMORY (the rows unchanged).  Also for host-only blocks (the history's tags).
cdef int rows_apply_plan(char* data, Py_ssize_t row_stride, Py_ssize_t row_bytes, int32_t head,
                         int32_t n, const int32_t* copy_src, const uint8_t* zero) noexcept nogil


cdef struct RowMover:
    bint logged                            # True: moves recorded in log (rows the core cannot address)
    RowLog log
    Py_ssize_t n_tensors
    const Py_ssize_t* row_bytes            # [n_tensors] bytes of one row of tensor k, in every space
    char** rows[N_ROW_SPACES]              # host: [n_tensors] base of tensor k's rows in each space

# host: the mover reads and writes through rows[space][k]; logged: a move log for n_cells cells
# and n_slots history slots (False: out of memory)
cdef bint mover_init(RowMover* m, bint logged, Py_ssize_t n_tensors, const Py_ssize_t* row_bytes,
                     Py_ssize_t n_cells, Py_ssize_t n_slots) noexcept nogil
cdef void mover_release(RowMover* m) noexcept nogil
# rows dst .. dst+count-1 of dst_space take the values rows src .. of src_space hold now
# (SPACE_ZERO: zeros); the ranges do not overlap
cdef void mover_copy(RowMover* m, int dst_space, Py_ssize_t dst, int src_space, Py_ssize_t src,
                     Py_ssize_t count) noexcept nogil
# a copy plan over cells head .. head+n-1, `unit` rows of `space` per cell: every read before any
# write; RC_OK or RC_ERR_NO_MEMORY
cdef int mover_copy_plan(RowMover* m, int space, Py_ssize_t unit, int32_t head, int32_t n,
                         const int32_t* copy_src, const uint8_t* zero) noexcept nogil
# row `cell` of the cells takes rows[k] of every tensor k; a logged mover takes none (rows NULL:
# the facade puts the storage's own rows after the call)
cdef void mover_set_cell(RowMover* m, Py_ssize_t cell, const char* const* rows) noexcept nogil
# cells first .. first+count-1 were written through the host pointers the state reader was given
# (a logged mover's are the staging rows: it records their move to the cells)
cdef void mover_cells_written(RowMover* m, Py_ssize_t first, Py_ssize_t count) noexcept nogil
