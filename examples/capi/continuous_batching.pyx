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
    NO_MEMORY = -1000


cdef struct Scratch:
    int32_t* seq_ids      # [max_tokens] one seq id per token
    int32_t* offsets      # [max_tokens + 1] token t's seq ids: seq_ids[offsets[t]:offsets[t + 1]]
    int32_t* pos          # [max_tokens]
    int32_t* copy_src     # [size] copy plan
    uint8_t* zero         # [size]


cdef bint scratch_alloc(Scratch* scratch, int32_t max_tokens, int32_t size) noexcept nogil:
    scratch.seq_ids = <int32_t*>malloc(max_tokens * sizeof(int32_t))
    scratch.offsets = <int32_t*>malloc((max_tokens + 1) * sizeof(int32_t))
    scratch.pos = <int32_t*>malloc(max_tokens * sizeof(int32_t))
    scratch.copy_src = <int32_t*>malloc(size * sizeof(int32_t))
    scratch.zero = <uint8_t*>malloc(size)
    return (scratch.seq_ids != NULL and scratch.offsets != NULL and scratch.pos != NULL
            and scratch.copy_src != NULL and scratch.zero != NULL)


cdef void scratch_free(Scratch* scratch) noexcept nogil:
    free(scratch.seq_ids)
    free(scratch.offsets)
    free(scratch.pos)
    free(scratch.copy_src)
    free(scratch.zero)


cdef inline uint32_t next_random(uint32_t* state) noexcept nogil:
    """Numerical Recipes' LCG: the Python twin in the tests draws the same numbers."""
    state[0] = state[0] * 1664525u + 1013904223u
    return state[0] >> 8


cdef int decode_batch(CellTable table, int32_t n_tokens, Scratch* scratch, int32_t n_ubatch) noexcept nogil:
    """init_batch + apply of every ubatch; returns RC_OK or the first error code."""
    cdef int32_t* seq_ids = scratch.seq_ids
    cdef Split split
    cdef SplitDetail detail
    cdef int32_t u, g0
    cdef int code = split_batch(&split, &table.cells, n_tokens, seq_ids, scratch.offsets, scratch.pos,
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
            cells_copy_plan(&table.cells, scratch.copy_src, scratch.zero)
            code = table.apply_plan_rows(table.cells.head, table.cells.n, scratch.copy_src, scratch.zero)
        u += 1
    split_release(&split)
    return code


cdef int run_schedule(CellTable table, int32_t n_seqs, int32_t n_steps, uint32_t seed,
                      int32_t n_ubatch) noexcept nogil:
    cdef Scratch scratch
    cdef int32_t step, seq, k, n_tokens, length, start, donor
    cdef uint32_t rng = seed, roll
    cdef int code = RC_OK
    if not scratch_alloc(&scratch, n_seqs * MAX_PROMPT, table.cells.size):
        code = NO_MEMORY
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
                scratch.seq_ids[n_tokens] = seq
                scratch.offsets[n_tokens] = n_tokens
                scratch.pos[n_tokens] = start + k
                n_tokens += 1
        scratch.offsets[n_tokens] = n_tokens
        if n_tokens:
            code = decode_batch(table, n_tokens, &scratch, n_ubatch)
        step += 1
    scratch_free(&scratch)
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
    cdef Scratch scratch
    cdef int32_t step, seq
    cdef int code = RC_OK
    with nogil:
        if not scratch_alloc(&scratch, n_seqs, table.cells.size):
            code = NO_MEMORY
        step = 0
        while code == RC_OK and step < n_steps:
            for seq in range(n_seqs):
                scratch.seq_ids[seq] = seq
                scratch.offsets[seq] = seq
                scratch.pos[seq] = cells_seq_pos_max(&table.cells, seq) + 1
            scratch.offsets[n_seqs] = n_seqs
            code = decode_batch(table, n_seqs, &scratch, 512)
            step += 1
        scratch_free(&scratch)
    return code
