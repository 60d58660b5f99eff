# cython: language_level=3
"""The rollback history (see ``_history.pxd``): slots, tags, and the rules that move them."""

from libc.stdint cimport int32_t, uint8_t
from libc.string cimport memcpy, memset

from ._cells cimport cells_join, cells_leave, cells_next_free
from ._codes cimport RC_OK
from ._moves cimport SPACE_CELLS, SPACE_HIST, SPACE_STEPS, mover_copy, mover_copy_plan, rows_apply_plan


cdef inline Py_ssize_t slot_of(const History* h, int32_t cell, int32_t q) noexcept nogil:
    return <Py_ssize_t>cell * h.n_rollback + q % h.n_rollback


cdef int history_apply_plan(const History* h, int32_t head, int32_t n, const int32_t* copy_src,
                            const uint8_t* zero) noexcept nogil:
    cdef Py_ssize_t row
    cdef int code
    if not h.n_rollback:
        return RC_OK
    code = mover_copy_plan(h.mover, SPACE_HIST, h.n_rollback, head, n, copy_src, zero)
    if code != RC_OK:
        return code
    row = h.n_rollback * sizeof(int32_t)
    return rows_apply_plan(<char*>h.tags, row, row, head, n, copy_src, zero)


cdef void history_keep_start_states(const History* h, int32_t head, int32_t n_seqs, int32_t n_seq_tokens,
                                    const int32_t* last_pos, const uint8_t* zero) noexcept nogil:
    cdef int32_t g, cell, q
    cdef Py_ssize_t slot
    if not h.n_rollback:
        return
    for g in range(n_seqs):
        cell = head + g
        q = last_pos[g] - n_seq_tokens            # the group continues the state after q
        if zero[g] or q < 0 or q < last_pos[g] - h.n_rollback:
            continue                              # no state yet, or outside the window
        slot = slot_of(h, cell, q)
        mover_copy(h.mover, SPACE_HIST, slot, SPACE_CELLS, cell, 1)
        h.tags[slot] = q + 1


cdef int32_t history_steps(const History* h, int32_t n_seq_tokens) noexcept nogil:
    """m: the states the model writes per group, after tokens n_seq_tokens - 1 - m .. n_seq_tokens - 2."""
    return min(h.n_rollback, n_seq_tokens - 1) if h.n_rollback else 0


cdef void history_file(const History* h, int32_t cell, int32_t q, Py_ssize_t row) noexcept nogil:
    """Keep row `row` of the step scratch as the state after position q of cell (a step state the model wrote)."""
    cdef Py_ssize_t slot = slot_of(h, cell, q)
    mover_copy(h.mover, SPACE_HIST, slot, SPACE_STEPS, row, 1)
    h.tags[slot] = q + 1


cdef void history_forget(const History* h, int32_t cell) noexcept nogil:
    if h.n_rollback and cell >= 0:
        memset(h.tags + <Py_ssize_t>cell * h.n_rollback, 0, h.n_rollback * sizeof(int32_t))


cdef void history_forget_all(const History* h, int32_t size) noexcept nogil:
    if h.n_rollback:
        memset(h.tags, 0, <size_t>size * h.n_rollback * sizeof(int32_t))


cdef int32_t history_rollback_min(const History* h, const Cells* c, int32_t seq) noexcept nogil:
    cdef int32_t cell, pos, j, q, best = -1
    if not h.n_rollback or not 0 <= seq < c.size or c.tail[seq] < 0:
        return -1
    cell = c.tail[seq]
    pos = c.pos[cell]
    for j in range(h.n_rollback):
        q = h.tags[<Py_ssize_t>cell * h.n_rollback + j] - 1
        if q >= 0 and pos - h.n_rollback <= q < pos and (best < 0 or q < best):
            best = q
    return best


cdef bint history_rollback(const History* h, Cells* c, int32_t seq, int32_t q) noexcept nogil:
    cdef int32_t cell, target, j
    cdef Py_ssize_t n = h.n_rollback, slot
    if not n or not 0 <= seq < c.size or c.tail[seq] < 0:
        return False
    cell = c.tail[seq]
    if not (c.pos[cell] - n <= q < c.pos[cell]) or q < 0:
        return False
    slot = slot_of(h, cell, q)
    if h.tags[slot] != q + 1:
        return False
    target = cell
    if c.n_seq[cell] > 1:   # copy on write: the others keep the shared cell
        target = cells_next_free(c, c.head)
        if target < 0:
            return False
        cells_leave(c, seq)
        cells_join(c, target, seq)
        c.src[target] = target
        mover_copy(h.mover, SPACE_HIST, target * n, SPACE_HIST, cell * n, n)   # the branch keeps the history it had
        memcpy(h.tags + target * n, h.tags + cell * n, n * sizeof(int32_t))
    mover_copy(h.mover, SPACE_CELLS, target, SPACE_HIST, slot, 1)
    c.pos[target] = q
    for j in range(n):   # states after q and later are gone
        if h.tags[target * n + j] > q:
            h.tags[target * n + j] = 0
    return True
