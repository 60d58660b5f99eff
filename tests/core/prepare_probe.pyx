# cython: language_level=3
"""Test-only: hand-built ubatches straight into the compiled engine's prepare and find_slot.

Validation lets no unplaceable ubatch through, so the only way to see what
``split_prepare`` does with one is to fill a ``Split`` by hand, as here.
"""

from libc.stdint cimport int32_t, uint8_t
from libc.stdlib cimport free, malloc

from recurrent_cache._core cimport MemoryCore
from recurrent_cache._core_ops cimport core_apply_ubatch
from recurrent_cache._split cimport SPLIT_OK, Split, split_alloc, split_prepare, split_release


cdef int fill(Split* split, list ubatches, int32_t[::1] flat) except -1:
    """ubatches[u] = (n_seq_tokens, [seq-id list, ...]); group s of a ubatch ends at position s."""
    cdef int32_t u = 0, g = 0, token = 0, offset = 0, s
    cdef int32_t n_tokens = sum(n * len(groups) for n, groups in ubatches)
    if split_alloc(split, n_tokens) != SPLIT_OK:
        raise MemoryError()
    for n, groups in ubatches:
        split.ub_token_start[u] = token
        split.ub_group_start[u] = g
        split.ub_n_seq_tokens[u] = n
        for s, group in enumerate(groups):
            split.group_seq_offset[g] = offset
            split.group_n_seq_id[g] = len(group)
            split.group_last_pos[g] = s
            offset += len(group)
            g += 1
        token += n * len(groups)
        u += 1
    split.ub_token_start[u] = token
    split.ub_group_start[u] = g
    split.n_ubatches = u
    split.n_outputs = 0
    return 0


def prepare(MemoryCore table, list ubatches):
    """split_prepare's code for hand-built ubatches (the cells must come back unchanged)."""
    cdef Split split
    flat = __import__("numpy").array([seq for _, groups in ubatches for group in groups for seq in group],
                                     dtype="int32")
    cdef int32_t[::1] ids = flat
    fill(&split, ubatches, ids)
    try:
        return split_prepare(&split, &table.core.cells, &ids[0])
    finally:
        split_release(&split)


def apply_first(MemoryCore table, list groups):
    """The memory core's apply of one hand-built one-token ubatch: (code, head, copy_src, zero)."""
    cdef Split split
    flat = __import__("numpy").array([seq for group in groups for seq in group], dtype="int32")
    cdef int32_t[::1] ids = flat
    cdef int code
    fill(&split, [(1, groups)], ids)
    try:
        code = core_apply_ubatch(&table.core, &split, 0, &ids[0])
        if code:
            return code, -1, [], []
        return (0, table.core.cells.head, [table.core.plan_copy_src[i] for i in range(table.core.cells.n)],
                [bool(table.core.plan_zero[i]) for i in range(table.core.cells.n)])
    finally:
        split_release(&split)
