# cython: language_level=3
"""The row-move log (see ``_moves.pxd``): moves recorded with their chains resolved."""

from libc.stdint cimport int8_t, int32_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset


cdef bint log_init(RowLog* log, Py_ssize_t n_cells, Py_ssize_t n_slots) noexcept nogil:
    cdef Py_ssize_t d, n
    memset(log, 0, sizeof(RowLog))
    log.n_rows[SPACE_CELLS] = n_cells
    log.n_rows[SPACE_HIST] = n_slots
    for d in range(N_DEST_SPACES):
        n = max(1, log.n_rows[d])
        log.from_space[d] = <int8_t*>malloc(n * sizeof(int8_t))
        log.from_row[d] = <Py_ssize_t*>calloc(n, sizeof(Py_ssize_t))
        log.touched[d] = <Py_ssize_t*>calloc(n, sizeof(Py_ssize_t))
        if log.from_space[d] == NULL or log.from_row[d] == NULL or log.touched[d] == NULL:
            return False
        memset(log.from_space[d], SPACE_NONE, n * sizeof(int8_t))
    log.batch_capacity = max(1, n_cells, n_slots)
    log.batch_space = <int8_t*>malloc(log.batch_capacity * sizeof(int8_t))
    log.batch_row = <Py_ssize_t*>malloc(log.batch_capacity * sizeof(Py_ssize_t))
    if log.batch_space == NULL or log.batch_row == NULL:
        return False
    return True


cdef void log_release(RowLog* log) noexcept nogil:
    cdef Py_ssize_t d
    for d in range(N_DEST_SPACES):
        free(log.from_space[d])
        free(log.from_row[d])
        free(log.touched[d])
    free(log.batch_space)
    free(log.batch_row)
    memset(log, 0, sizeof(RowLog))


cdef void log_reset(RowLog* log) noexcept nogil:
    cdef Py_ssize_t d, i
    for d in range(N_DEST_SPACES):
        for i in range(log.n_touched[d]):
            log.from_space[d][log.touched[d][i]] = SPACE_NONE
        log.n_touched[d] = 0


cdef bint log_pending(const RowLog* log) noexcept nogil:
    return log.n_touched[SPACE_CELLS] > 0 or log.n_touched[SPACE_HIST] > 0


cdef inline void resolve(const RowLog* log, int* space, Py_ssize_t* row) noexcept nogil:
    """Where the value row *row of *space holds now comes from, as of the start of the call."""
    cdef int8_t pending
    if space[0] < N_DEST_SPACES:
        pending = log.from_space[space[0]][row[0]]
        if pending != SPACE_NONE:
            row[0] = log.from_row[space[0]][row[0]]
            space[0] = pending


cdef inline void commit(RowLog* log, int dst_space, Py_ssize_t dst, int src_space, Py_ssize_t src) noexcept nogil:
    if log.from_space[dst_space][dst] == SPACE_NONE:
        log.touched[dst_space][log.n_touched[dst_space]] = dst
        log.n_touched[dst_space] += 1
    log.from_space[dst_space][dst] = <int8_t>src_space
    log.from_row[dst_space][dst] = src


cdef void log_copy(RowLog* log, int dst_space, Py_ssize_t dst, int src_space, Py_ssize_t src) noexcept nogil:
    resolve(log, &src_space, &src)
    commit(log, dst_space, dst, src_space, src)


cdef void log_copy_plan(RowLog* log, int space, Py_ssize_t unit, int32_t head, int32_t n,
                        const int32_t* copy_src, const uint8_t* zero) noexcept nogil:
    cdef int32_t i
    cdef Py_ssize_t j, b = 0
    cdef int src_space
    cdef Py_ssize_t src
    for i in range(n):   # resolve every source first: a source may also be a destination
        if copy_src[i] != head + i and not zero[i]:
            for j in range(unit):
                src_space, src = space, <Py_ssize_t>copy_src[i] * unit + j
                resolve(log, &src_space, &src)
                log.batch_space[b], log.batch_row[b] = <int8_t>src_space, src
                b += 1
    b = 0
    for i in range(n):
        if zero[i]:
            for j in range(unit):
                commit(log, space, (<Py_ssize_t>head + i) * unit + j, SPACE_ZERO, 0)
        elif copy_src[i] != head + i:
            for j in range(unit):
                commit(log, space, (<Py_ssize_t>head + i) * unit + j, log.batch_space[b], log.batch_row[b])
                b += 1
