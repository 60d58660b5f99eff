# cython: language_level=3
"""C-level API of the rollback history (docs/rollback.md).

n_rollback slots per cell; the state after position q of a cell lives in slot
q % n_rollback of its history row, tagged q + 1 (0 = empty).  The history row travels
with the state through every copy plan.  The tags live in host memory and are written
here; the history's rows are moved by the core's row mover (``_moves``), which copies
them at once or records the move for the storage, so no function here knows which.
"""

from libc.stdint cimport int32_t, uint8_t

from ._cells cimport Cells
from ._moves cimport RowMover

cdef struct History:
    int32_t n_rollback          # 0: no history (every function below does nothing)
    int32_t* tags               # [size * n_rollback]
    RowMover* mover             # moves the history's rows (SPACE_HIST) and the cells' (the memory core's)

# the history rows follow a copy plan (a zeroed row has none); RC_OK or RC_ERR_NO_MEMORY
cdef int history_apply_plan(const History* h, int32_t head, int32_t n, const int32_t* copy_src,
                            const uint8_t* zero) noexcept nogil
# before the model overwrites them, the states groups start from join their cells' histories
cdef void history_keep_start_states(const History* h, int32_t head, int32_t n_seqs, int32_t n_seq_tokens,
                                    const int32_t* last_pos, const uint8_t* zero) noexcept nogil
# the model's promise for one applied ubatch: m states per group (after tokens n_seq_tokens - 1 - m
# .. n_seq_tokens - 2); history_file keeps step row `row` as the state after position q of cell
cdef int32_t history_steps(const History* h, int32_t n_seq_tokens) noexcept nogil
cdef void history_file(const History* h, int32_t cell, int32_t q, Py_ssize_t row) noexcept nogil
cdef void history_forget(const History* h, int32_t cell) noexcept nogil       # one cell's
cdef void history_forget_all(const History* h, int32_t size) noexcept nogil
cdef int32_t history_rollback_min(const History* h, const Cells* c, int32_t seq) noexcept nogil
cdef bint history_rollback(const History* h, Cells* c, int32_t seq, int32_t q) noexcept nogil
