# cython: language_level=3, boundscheck=False, wraparound=False
"""Continuous batching driven entirely from C through recurrent_cache's C-level API.

A server loop without the interpreter: every step builds a batch in C arrays
(new prompts plus one decode token per running sequence), validates and splits
it, proves it fits, and places each ubatch — the same calls, in the same
order, as ``RecurrentCache.init_batch`` / ``MemoryState.apply``.

Build it like any Cython extension; ``recurrent_cache.get_include()`` is the
include path for ``cimport recurrent_cache.core`` (see build.py here).
"""

from libc.stdint cimport int32_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc

from recurrent_cache.core cimport (RC_OK, SPLIT_OK, CellTable, Split, SplitDetail, cells_copy_plan,
                                   cells_find_slot, cells_seq_cp, cells_seq_pos_max, cells_seq_rm,
                                   split_batch, split_prepare, split_release)

cdef enum:
    MAX_PROMPT = 8


cdef inline uint32_t next_random(uint32_t* state) noexcept nogil:
    """Numerical Recipes' LCG: the Python twin in the tests draws the same numbers."""
    state[0] = state[0] * 1664525u + 1013904223u
    return state[0] >> 8


cdef int decode_batch(CellTable table, int32_t n_tokens, int32_t* seq_ids, int32_t* offsets,
                      int32_t* pos, int32_t n_ubatch, int32_t* copy_src, uint8_t* zero) noexcept nogil:
    """init_batch + apply of every ubatch; returns RC_OK or the first error code."""
    cdef Split split
    cdef SplitDetail detail
    cdef int32_t u, g0
    cdef int code = split_batch(&split, &table.cells, n_tokens, seq_ids, offsets, pos,
                                NULL, False, n_ubatch, False, &detail)
    if code != SPLIT_OK:
        return code
    code = split_prepare(&split, &table.cells, seq_ids)
    u = 0
    while code == RC_OK and u < split.n_ubatches:
        g0 = split.ub_group_start[u]
        code = cells_find_slot(&table.cells, split.ub_group_start[u + 1] - g0,
                               split.ub_token_start[u + 1] - split.ub_token_start[u], seq_ids,
                               split.group_seq_offset + g0, split.group_n_seq_id + g0,
                               split.group_last_pos + g0)
        if code == RC_OK:
            cells_copy_plan(&table.cells, copy_src, zero)
            code = table.apply_plan_rows(table.cells.head, table.cells.n, copy_src, zero)
        u += 1
    split_release(&split)
    return code


cdef int run_schedule(CellTable table, int32_t n_seqs, int32_t n_steps, uint32_t seed,
                      int32_t n_ubatch) noexcept nogil:
    cdef int32_t size = table.cells.size
    cdef int32_t max_tokens = n_seqs * MAX_PROMPT
    cdef int32_t* seq_ids = <int32_t*>malloc(max_tokens * sizeof(int32_t))
    cdef int32_t* offsets = <int32_t*>malloc((max_tokens + 1) * sizeof(int32_t))
    cdef int32_t* pos = <int32_t*>malloc(max_tokens * sizeof(int32_t))
    cdef int32_t* copy_src = <int32_t*>malloc(size * sizeof(int32_t))
    cdef uint8_t* zero = <uint8_t*>malloc(size)
    cdef int32_t step, seq, k, n_tokens, length, start, donor
    cdef uint32_t rng = seed, roll
    cdef int code = RC_OK
    if seq_ids == NULL or offsets == NULL or pos == NULL or copy_src == NULL or zero == NULL:
        code = -1000
    step = 0
    while code == RC_OK and step < n_steps:
        n_tokens = 0
        for seq in range(n_seqs):
            roll = next_random(&rng) % 16
            start = cells_seq_pos_max(&table.cells, seq) + 1
            if start > 0 and roll == 0:
                cells_seq_rm(&table.cells, seq, -1, -1)     # the client finished
                continue
            if start > 0 and roll == 1:
                donor = <int32_t>(next_random(&rng) % <uint32_t>n_seqs)
                cells_seq_cp(&table.cells, donor, seq)      # fork another client's state
                continue
            length = 1 if start > 0 else 1 + <int32_t>(next_random(&rng) % MAX_PROMPT)
            if start == 0 and roll >= 8:
                continue                                    # slot stays free this step
            for k in range(length):
                seq_ids[n_tokens] = seq
                offsets[n_tokens] = n_tokens
                pos[n_tokens] = start + k
                n_tokens += 1
        offsets[n_tokens] = n_tokens
        if n_tokens:
            code = decode_batch(table, n_tokens, seq_ids, offsets, pos, n_ubatch, copy_src, zero)
        step += 1
    free(seq_ids)
    free(offsets)
    free(pos)
    free(copy_src)
    free(zero)
    return code


def continuous_batching(CellTable table, int n_seqs, int n_steps, unsigned int seed, int n_ubatch=16):
    """Run the schedule on ``cache.cell_table`` without the GIL; returns the step error code (0)."""
    cdef int code
    if n_seqs > table.cells.size:
        raise ValueError(f"{n_seqs} sequences do not fit in {table.cells.size} cells")
    with nogil:
        code = run_schedule(table, n_seqs, n_steps, seed, n_ubatch)
    return code


def decode_steps(CellTable table, int n_seqs, int n_steps):
    """Benchmark kernel: n_steps decode steps of one token for sequences 0..n_seqs-1."""
    cdef int32_t* seq_ids = <int32_t*>malloc(n_seqs * sizeof(int32_t))
    cdef int32_t* offsets = <int32_t*>malloc((n_seqs + 1) * sizeof(int32_t))
    cdef int32_t* pos = <int32_t*>malloc(n_seqs * sizeof(int32_t))
    cdef int32_t* copy_src = <int32_t*>malloc(table.cells.size * sizeof(int32_t))
    cdef uint8_t* zero = <uint8_t*>malloc(table.cells.size)
    cdef int32_t step, seq
    cdef int code = RC_OK
    if seq_ids == NULL or offsets == NULL or pos == NULL or copy_src == NULL or zero == NULL:
        code = -1000
    with nogil:
        step = 0
        while code == RC_OK and step < n_steps:
            for seq in range(n_seqs):
                seq_ids[seq] = seq
                offsets[seq] = seq
                pos[seq] = cells_seq_pos_max(&table.cells, seq) + 1
            offsets[n_seqs] = n_seqs
            code = decode_batch(table, n_seqs, seq_ids, offsets, pos, 512, copy_src, zero)
            step += 1
    free(seq_ids)
    free(offsets)
    free(pos)
    free(copy_src)
    free(zero)
    return code
