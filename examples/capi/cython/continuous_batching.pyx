# cython: language_level=3, boundscheck=False, wraparound=False
"""Continuous batching driven from Cython through ``cimport recurrent_cache.capi``.

The same schedule as the C and C++ examples: each step builds a batch in C arrays
(new prompts plus one decode token per running sequence), ``rc_batch_init``
validates, splits and proves it fits, and each ubatch is applied; "the model" adds
the tokens a sequence consumed to column 0 of its s row of layer 0.  No GIL in the
loop.  Build: see setup.py next to this file.
"""

from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, uint32_t
from libc.stdlib cimport free, malloc

from recurrent_cache.capi cimport (RC_ERR_NO_MEMORY, RC_OK, rc_batch, rc_batch_apply, rc_batch_init,
                                   rc_batch_release, rc_ctx, rc_ctx_free, rc_ctx_new, rc_error_message,
                                   rc_n_layer, rc_seq_cp, rc_seq_pos_max, rc_seq_rm, rc_size, rc_tensor,
                                   rc_ubatch)

cdef enum:
    MAX_PROMPT = 8


cdef inline uint32_t next_random(uint32_t* state) noexcept nogil:
    """Numerical Recipes' LCG: the Python twin in the tests draws the same numbers."""
    state[0] = state[0] * 1664525u + 1013904223u
    return state[0] >> 8


cdef int decode_batch(rc_ctx* ctx, int32_t n_tokens, const int32_t* seq_ids, const int32_t* pos,
                      int32_t n_ubatch) noexcept nogil:
    """One batch: init, apply every ubatch (the model step), release."""
    cdef rc_batch* batch
    cdef rc_ubatch ub
    cdef void* s0
    cdef size_t row_bytes
    cdef int32_t g
    cdef float* row
    cdef int code = rc_tensor(ctx, rc_n_layer(ctx), &s0, &row_bytes)   # s of layer 0 (f32)
    if code == RC_OK:
        code = rc_batch_init(ctx, n_tokens, seq_ids, NULL, pos, NULL, n_ubatch, 0, &batch)
    if code != RC_OK:
        return code
    code = rc_batch_apply(batch, &ub)
    while code == 1:
        for g in range(ub.n_seqs):     # group g's state is row head + g
            row = <float*>(<char*>s0 + <size_t>(ub.head + g) * row_bytes)
            row[0] += ub.n_seq_tokens
        code = rc_batch_apply(batch, &ub)
    rc_batch_release(batch)
    return code


cdef int run_schedule(rc_ctx* ctx, int32_t n_seqs, int32_t n_steps, uint32_t seed,
                      int32_t n_ubatch) noexcept nogil:
    cdef int32_t* seq_ids = <int32_t*>malloc(sizeof(int32_t) * n_seqs * MAX_PROMPT)
    cdef int32_t* pos = <int32_t*>malloc(sizeof(int32_t) * n_seqs * MAX_PROMPT)
    cdef int32_t step = 0, seq, k, n_tokens, length, start
    cdef uint32_t rng = seed, roll
    cdef int code = RC_OK
    if seq_ids == NULL or pos == NULL:
        code = RC_ERR_NO_MEMORY
    while code == RC_OK and step < n_steps:
        n_tokens = 0
        for seq in range(n_seqs):
            roll = next_random(&rng) % 16
            start = rc_seq_pos_max(ctx, seq) + 1
            if start > 0 and roll == 0:
                rc_seq_rm(ctx, seq, -1, -1)                  # the client finished
                continue
            if start > 0 and roll == 1:
                rc_seq_cp(ctx, <int32_t>(next_random(&rng) % <uint32_t>n_seqs), seq)   # a fork
                continue
            length = 1 if start > 0 else 1 + <int32_t>(next_random(&rng) % MAX_PROMPT)
            if start == 0 and roll >= 8:
                continue                                     # the slot stays free this step
            for k in range(length):
                seq_ids[n_tokens] = seq
                pos[n_tokens] = start + k
                n_tokens += 1
        if n_tokens:
            code = decode_batch(ctx, n_tokens, seq_ids, pos, n_ubatch)
        step += 1
    free(seq_ids)
    free(pos)
    return code


cdef int run_decode_steps(rc_ctx* ctx, int32_t n_seqs, int32_t n_steps) noexcept nogil:
    """n_steps decode steps of one token for sequences 0..n_seqs-1 (the benchmark kernel)."""
    cdef int32_t* seq_ids = <int32_t*>malloc(sizeof(int32_t) * n_seqs)
    cdef int32_t* pos = <int32_t*>malloc(sizeof(int32_t) * n_seqs)
    cdef rc_batch* batch
    cdef rc_ubatch ub
    cdef int32_t step = 0, seq
    cdef int code = RC_OK
    if seq_ids == NULL or pos == NULL:
        code = RC_ERR_NO_MEMORY
    while code == RC_OK and step < n_steps:
        for seq in range(n_seqs):
            seq_ids[seq] = seq
            pos[seq] = rc_seq_pos_max(ctx, seq) + 1
        code = rc_batch_init(ctx, n_seqs, seq_ids, NULL, pos, NULL, 512, 0, &batch)
        if code == RC_OK:
            while rc_batch_apply(batch, &ub) == 1:
                pass
            rc_batch_release(batch)
        step += 1
    free(seq_ids)
    free(pos)
    return code


cdef int finish(rc_ctx* ctx, int code) except -1:
    """Free the context; raise RuntimeError with the library's message for a failure."""
    cdef char message[512]
    if code < 0:
        rc_error_message(ctx, code, message, sizeof(message))
    rc_ctx_free(ctx)
    if code < 0:
        raise RuntimeError(message.decode("utf-8", "replace"))
    return code


def continuous_batching(cache, int n_seqs, int n_steps, unsigned int seed, int n_ubatch=16):
    """The schedule on ``cache`` (a compiled RecurrentCache) without the GIL; 0 or RuntimeError."""
    cdef rc_ctx* ctx = rc_ctx_new(<PyObject*>cache)
    cdef int code
    cdef int32_t size = rc_size(ctx)
    if not 1 <= n_seqs <= size:
        rc_ctx_free(ctx)
        raise ValueError(f"n_seqs must be in [1, {size}], got {n_seqs}")
    with nogil:
        code = run_schedule(ctx, n_seqs, n_steps, seed, n_ubatch)
    return finish(ctx, code)


def decode_steps(cache, int n_seqs, int n_steps):
    """Benchmark kernel: n_steps decode steps of one token for sequences 0..n_seqs-1."""
    cdef rc_ctx* ctx = rc_ctx_new(<PyObject*>cache)
    cdef int code
    with nogil:
        code = run_decode_steps(ctx, n_seqs, n_steps)
    return finish(ctx, code)
