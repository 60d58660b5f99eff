# cython: language_level=3
"""The memory core in C: the only code that changes a cache's cells, rows and rollback history.

``_cells`` holds the primitives (the cell table, find_slot, copy plans, the history
slots); this module composes them into the operations of docs/concepts.md §1, §2, §5 and §7 with
their rules in one place: a ubatch applied (placement, copy plan, rows and history moved,
start states filed), the model's step states filed, every sequence operation with its
history rule, rollback, a sequence placed with given rows, and state reads.  The Python
facade (through ``_placement`` and ``_core.MemoryCore``, which owns a ``Core``) and the C API
(``_capi``) both call these functions, so they share one change counter and file step states
at one point: the start of the next changing call, whichever API makes it.  C only, no Python
names.
"""

from libc.stdint cimport INT32_MAX, int32_t, uintptr_t
from libc.string cimport memcpy

from ._cells cimport (cells_check, cells_clear, cells_copy_plan, cells_find_slot, cells_seq_add, cells_seq_cp,
                      cells_seq_div, cells_seq_keep, cells_seq_pos_max, cells_seq_rm, cells_tail_in_range)
from ._codes cimport RC_ERR_BROKEN, RC_ERR_NO_FREE_CELL, RC_ERR_POSITION, RC_ERR_SEQ_HAS_CELL, RC_ERR_SEQ_RANGE, RC_OK
from ._history cimport (history_apply_plan, history_file, history_forget, history_forget_all,
                        history_keep_start_states, history_rollback, history_rollback_min, history_steps)
from ._moves cimport SPACE_CELLS, SPACE_ZERO, mover_cells_written, mover_copy, mover_copy_plan, mover_set_cell
from ._split cimport Split
from ._state_io cimport BLOB_OK, BlobDefect, BlobLayout, BlobSource, check_blob, restore_blob


# -- step states (docs/rollback.md) ---------------------------------------------------------------

cdef int32_t core_steps(const Core* core, int32_t n_seq_tokens) noexcept nogil:
    """m: the states the model writes per group of a ubatch of n_seq_tokens tokens per group."""
    return history_steps(&core.history, n_seq_tokens)


cdef char* core_step_row(const Core* core, Py_ssize_t k, int32_t group, int32_t j) noexcept nogil:
    """Where the model writes tensor k's state after token n_seq_tokens - 1 - m + j of group."""
    return core.step_data[k] + (<Py_ssize_t>group * core.pending_m + j) * core.row_bytes[k]


cdef void core_file_steps(Core* core) noexcept nogil:
    """File the step states of the last applied ubatch (if any) into its cells' histories."""
    cdef int32_t g, j, m = core.pending_m
    if core.pending_n_seqs == 0:
        return
    for g in range(core.pending_n_seqs):
        for j in range(m):   # step row g * m + j: the state after position last_pos - m + j
            history_file(&core.history, core.pending_head + g, core.pending_last_pos[g] - m + j,
                         <Py_ssize_t>g * m + j)
    core.pending_n_seqs = 0


# -- ubatches ----------------------------------------------------------------------------

cdef int core_apply_ubatch(Core* core, const Split* split, int32_t u, const int32_t* seq_ids) noexcept nogil:
    cdef int32_t g0 = split.ub_group_start[u], n_seqs = split.ub_group_start[u + 1] - g0
    cdef int32_t n_seq_tokens = split.ub_n_seq_tokens[u], m = core_steps(core, n_seq_tokens), n
    cdef const int32_t* last_pos = split.group_last_pos + g0
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    core_file_steps(core)
    if <Py_ssize_t>n_seqs * m > core.step_capacity:   # before any change: failing leaves all as it was
        code = core.grow_steps(core, <Py_ssize_t>n_seqs * m)
        if code != RC_OK:
            return code
    core.generation += 1
    code = cells_find_slot(&core.cells, n_seqs, split.ub_token_start[u + 1] - split.ub_token_start[u], seq_ids,
                           split.group_seq_offset + g0, split.group_n_seq_id + g0, last_pos)
    if code != RC_OK:
        return code
    n = core.cells.n
    cells_copy_plan(&core.cells, core.plan_copy_src, core.plan_zero)
    code = apply_plan(core, core.cells.head, n)
    if code != RC_OK:
        return code
    history_keep_start_states(&core.history, core.cells.head, n_seqs, n_seq_tokens, last_pos, core.plan_zero)
    if m > 0:
        core.pending_head = core.cells.head
        core.pending_n_seqs = n_seqs
        core.pending_m = m
        memcpy(core.pending_last_pos, last_pos, <size_t>n_seqs * sizeof(int32_t))
    if core.self_check and cells_check(&core.cells) != 0:
        return RC_ERR_BROKEN
    return RC_OK


cdef int apply_plan(Core* core, int32_t head, int32_t n) noexcept nogil:
    """Move the rows and their histories as the copy plan in the core's scratch says."""
    cdef int code = mover_copy_plan(&core.mover, SPACE_CELLS, 1, head, n, core.plan_copy_src, core.plan_zero)
    if code != RC_OK:
        return code
    return history_apply_plan(&core.history, head, n, core.plan_copy_src, core.plan_zero)


# -- sequence operations with their history rules --------------------------------------------

cdef bint core_seq_rm(Core* core, int32_t seq, int32_t p0, int32_t p1) noexcept nogil:
    """seq_rm; with a history, [p0, inf) inside the sequence rolls it back to the state after p0 - 1."""
    cdef int32_t pos = -1
    cdef bint removed
    core_file_steps(core)
    if core.history.n_rollback and 0 <= seq < core.cells.size:
        pos = cells_seq_pos_max(&core.cells, seq)
    if 0 < p0 <= pos and (p1 < 0 or p1 > pos):
        removed = history_rollback(&core.history, &core.cells, seq, p0 - 1)
    else:
        removed = cells_seq_rm(&core.cells, seq, p0, p1)
    if removed:
        core.generation += 1
    return removed


cdef void core_seq_cp(Core* core, int32_t seq_src, int32_t seq_dst) noexcept nogil:
    core_file_steps(core)
    cells_seq_cp(&core.cells, seq_src, seq_dst)
    core.generation += 1


cdef int core_seq_keep(Core* core, int32_t seq) noexcept nogil:
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    core_file_steps(core)
    code = cells_seq_keep(&core.cells, seq)
    if code == RC_OK:
        core.generation += 1
    return code


cdef int core_seq_add(Core* core, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil:
    """seq_add; the history of the cell it moves is forgotten (its positions no longer match)."""
    cdef int32_t cell
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    core_file_steps(core)
    cell = cells_tail_in_range(&core.cells, seq, p0, p1) if 0 <= seq < core.cells.size else -1
    code = cells_seq_add(&core.cells, seq, p0, p1, shift)
    if code == RC_OK:
        if shift != 0:
            history_forget(&core.history, cell)
        core.generation += 1
    return code


cdef int core_seq_div(Core* core, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil:
    """seq_div; the history of the cell it moves is forgotten."""
    cdef int32_t cell
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    core_file_steps(core)
    cell = cells_tail_in_range(&core.cells, seq, p0, p1) if 0 <= seq < core.cells.size else -1
    code = cells_seq_div(&core.cells, seq, p0, p1, d)
    if code == RC_OK:
        if d != 1:
            history_forget(&core.history, cell)
        core.generation += 1
    return code


cdef void core_clear(Core* core) noexcept nogil:
    """Empty every cell, zero every row, forget every history."""
    core.pending_n_seqs = 0   # the rows it would file into are gone
    cells_clear(&core.cells)
    mover_copy(&core.mover, SPACE_CELLS, 0, SPACE_ZERO, 0, core.cells.size)
    history_forget_all(&core.history, core.cells.size)
    core.generation += 1


cdef int32_t core_rollback_min(Core* core, int32_t seq) noexcept nogil:
    """The smallest q whose state a rollback of seq reaches, or -1 (files pending steps first)."""
    core_file_steps(core)
    return history_rollback_min(&core.history, &core.cells, seq)


# -- placing a sequence with given rows, and state reads ------------------------------------

cdef int32_t core_restore(Core* core, int32_t seq, int32_t pos, const char* const* rows) noexcept nogil:
    cdef int32_t seq_offset = 0, n_seq_id = 1, cell
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    if not 0 <= seq < core.cells.size:
        return RC_ERR_SEQ_RANGE
    if core.cells.tail[seq] >= 0:
        return RC_ERR_SEQ_HAS_CELL
    if pos < 0 or pos == INT32_MAX:
        return RC_ERR_POSITION
    if core.cells.used >= core.cells.size:   # (cannot be: seq, < size, holds no cell) checked, not assumed
        return RC_ERR_NO_FREE_CELL
    core_file_steps(core)
    core.generation += 1
    code = cells_find_slot(&core.cells, 1, 1, &seq, &seq_offset, &n_seq_id, &pos)
    if code != RC_OK:   # cannot happen after the checks above (a bug: reported, not hidden)
        return code
    cell = core.cells.head
    core.cells.src[cell] = cell
    mover_set_cell(&core.mover, cell, rows)
    history_forget(&core.history, cell)   # another sequence's past is not this one's
    return cell


cdef int core_state_read(Core* core, int32_t seq_id, const unsigned char* data, Py_ssize_t length,
                         BlobDefect* defect) noexcept nogil:
    cdef BlobLayout layout
    cdef int code
    if core.broken:
        return RC_ERR_BROKEN
    code = check_blob(&core.cells, seq_id, data, length, core.n_layer, core.n_tensors, core.type_ids,
                      core.row_bytes, &layout, defect)
    if code != BLOB_OK:
        return code
    core_file_steps(core)
    core.generation += 1
    code = restore_blob(&core.cells, data, &layout, seq_id, core.n_tensors, core.tensor_data, core.row_bytes)
    if code != RC_OK:
        return code
    if seq_id < 0:   # the blob's rows, then zeros (the rest of the cache is cleared)
        mover_cells_written(&core.mover, 0, core.cells.size)
    elif layout.cell_count:
        mover_cells_written(&core.mover, core.cells.head, 1)
    # the blob carries no history (llama.cpp's bytes)
    if seq_id < 0:
        history_forget_all(&core.history, core.cells.size)
    else:
        history_forget(&core.history, core.cells.tail[seq_id])
    return RC_OK




cdef bint shares_rows(const Core* core, const void* p, size_t n) noexcept nogil:
    """Whether bytes [p, p + n) overlap a state tensor (a blob or target made of the cache's rows,
    which a restore or a write would read while writing)."""
    cdef Py_ssize_t k
    cdef uintptr_t begin = <uintptr_t>p, base
    for k in range(core.n_tensors):
        base = <uintptr_t>core.tensor_data[k]
        if n > 0 and begin < base + <uintptr_t>(core.cells.size * core.row_bytes[k]) and base < begin + n:
            return True
    return False


cdef BlobSource blob_source(const Core* core) noexcept nogil:
    """What ``state_write`` composes a blob from: the core's cells and rows (a logged core's: the staging copies)."""
    cdef BlobSource src
    src.cells = &core.cells
    src.n_layer = core.n_layer
    src.n_tensors = core.n_tensors
    src.tensor_data = core.tensor_data
    src.row_bytes = core.row_bytes
    src.type_ids = core.type_ids
    return src
