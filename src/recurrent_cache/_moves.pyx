# cython: language_level=3
"""The row mover (see ``_moves.pxd``): host rows moved in C, or moves recorded with their chains
resolved and carried out by the storage."""

cimport cython
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

import numpy as np


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


@cython.boundscheck(True)   # Python objects only here: a wrong index must raise, never read astray
@cython.wraparound(True)
cdef int log_carry_out(const RowLog* log, object storage, tuple spaces, tuple dtypes) except -1:
    cdef Py_ssize_t d, i, n, row
    cdef int source
    cdef list groups = []
    cdef int8_t[::1] sources_view
    cdef int64_t[::1] dst_view, src_view
    if not log_pending(log):
        return 0
    for d in range(N_DEST_SPACES):
        n = log.n_touched[d]
        sources = np.empty(n, dtype=np.int8)
        dst = np.empty(n, dtype=np.int64)
        src = np.empty(n, dtype=np.int64)
        sources_view, dst_view, src_view = sources, dst, src
        for i in range(n):
            row = log.touched[d][i]
            dst_view[i] = row
            sources_view[i] = log.from_space[d][row]
            src_view[i] = log.from_row[d][row]
        for source in (SPACE_CELLS, SPACE_HIST, SPACE_STEPS, SPACE_STAGE, SPACE_ZERO):
            chosen = sources == source
            if source == d:
                chosen &= src != dst   # a row that ends as it began
            if chosen.any():
                groups.append((d, source, dst[chosen], src[chosen]))
    taken = []
    for d, source, rows, from_rows in groups:
        if source == SPACE_STAGE:
            taken.append([storage.from_host(stage[:, from_rows], dtype)
                          for stage, dtype in zip(spaces[SPACE_STAGE], dtypes)])
        elif source != SPACE_ZERO:
            taken.append([storage.take(t, from_rows) for t in spaces[source]])
        else:
            taken.append(None)
    for (d, source, rows, _), values in zip(groups, taken):
        for kind in range(len(spaces[d])):
            if values is None:
                storage.zero(spaces[d][kind], rows)
            else:
                storage.put(spaces[d][kind], rows, values[kind])
    return 0


# -- moving host rows ------------------------------------------------------------------------

cdef int rows_apply_plan(char* data, Py_ssize_t row_stride, Py_ssize_t row_bytes, int32_t head,
                         int32_t n, const int32_t* copy_src, const uint8_t* zero) noexcept nogil:
    cdef int32_t i, n_moves = 0, k
    cdef char* staging
    for i in range(n):
        if copy_src[i] != head + i:
            n_moves += 1
    if n_moves == 1:
        for i in range(n):
            if copy_src[i] != head + i:
                memcpy(data + (head + i) * row_stride, data + copy_src[i] * row_stride, row_bytes)
    elif n_moves > 1 and row_bytes:   # rows of no bytes (a tensor 0 values wide) move nothing: no malloc(0)
        # every read happens before any write: a source may also be a destination
        staging = <char*>malloc(n_moves * row_bytes)
        if staging == NULL:
            return RC_ERR_NO_MEMORY
        k = 0
        for i in range(n):
            if copy_src[i] != head + i:
                memcpy(staging + k * row_bytes, data + copy_src[i] * row_stride, row_bytes)
                k += 1
        k = 0
        for i in range(n):
            if copy_src[i] != head + i:
                memcpy(data + (head + i) * row_stride, staging + k * row_bytes, row_bytes)
                k += 1
        free(staging)
    for i in range(n):
        if zero[i]:
            memset(data + (head + i) * row_stride, 0, row_bytes)
    return RC_OK


# -- the mover: the one place that decides between moving now and recording ------------------

cdef bint mover_init(RowMover* m, bint logged, Py_ssize_t n_tensors, const Py_ssize_t* row_bytes,
                     Py_ssize_t n_cells, Py_ssize_t n_slots) noexcept nogil:
    memset(m, 0, sizeof(RowMover))
    m.logged = logged
    m.n_tensors = n_tensors
    m.row_bytes = row_bytes
    return log_init(&m.log, n_cells, n_slots) if logged else True


cdef void mover_release(RowMover* m) noexcept nogil:
    log_release(&m.log)


cdef void mover_copy(RowMover* m, int dst_space, Py_ssize_t dst, int src_space, Py_ssize_t src,
                     Py_ssize_t count) noexcept nogil:
    cdef Py_ssize_t k, j, rb
    if m.logged:
        for j in range(count):
            log_copy(&m.log, dst_space, dst + j, src_space, src if src_space == SPACE_ZERO else src + j)
        return
    for k in range(m.n_tensors):
        rb = m.row_bytes[k]
        if src_space == SPACE_ZERO:
            memset(m.rows[dst_space][k] + dst * rb, 0, count * rb)
        else:
            memcpy(m.rows[dst_space][k] + dst * rb, m.rows[src_space][k] + src * rb, count * rb)


cdef int mover_copy_plan(RowMover* m, int space, Py_ssize_t unit, int32_t head, int32_t n,
                         const int32_t* copy_src, const uint8_t* zero) noexcept nogil:
    cdef Py_ssize_t k, stride
    cdef int code
    if m.logged:
        log_copy_plan(&m.log, space, unit, head, n, copy_src, zero)
        return RC_OK
    for k in range(m.n_tensors):
        stride = unit * m.row_bytes[k]
        code = rows_apply_plan(m.rows[space][k], stride, stride, head, n, copy_src, zero)
        if code != RC_OK:
            return code
    return RC_OK


cdef void mover_set_cell(RowMover* m, Py_ssize_t cell, const char* const* rows) noexcept nogil:
    cdef Py_ssize_t k
    if m.logged:
        return
    for k in range(m.n_tensors):
        memcpy(m.rows[SPACE_CELLS][k] + cell * m.row_bytes[k], rows[k], m.row_bytes[k])


cdef void mover_cells_written(RowMover* m, Py_ssize_t first, Py_ssize_t count) noexcept nogil:
    if m.logged:
        mover_copy(m, SPACE_CELLS, first, SPACE_STAGE, first, count)
