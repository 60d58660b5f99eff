# cython: language_level=3
"""The attention mask of a ubatch over the KV cell table (docs/hybrid.md, "The mask").

Reads the table only: per sequence of the ubatch, the position each cell holds
for it, once; then each token's row in one branch-free pass over the cells.
"""

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

from ._kv_table cimport KV_NO_MEMORY, KV_OK, SWA_CHUNKED, SWA_NONE, SWA_STANDARD, SWA_SYMMETRIC


cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    /* On x86-64 with GCC or Clang and glibc the two loops below are compiled twice, for AVX2 and the
       baseline SSE2, and the loader picks the one the CPU runs (an ifunc, which glibc's loader
       resolves): 8 cells an instruction instead of 4. */
    #if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && defined(__GLIBC__)
    #define RC_MASK_CLONES __attribute__((target_clones("avx2", "default")))
    #else
    #define RC_MASK_CLONES
    #endif
    /* The position each of n cells holds for one sequence (bit `bit` of its word in `bits`, `stride`
       words a cell), -1 where the sequence is not in the cell. */
    RC_MASK_CLONES
    static void rc_seen_pos(int32_t* seen_pos, const int32_t* pos, const uint64_t* bits, int32_t stride,
                            int32_t n, uint64_t bit) {
        if (stride == 1) {   /* up to 64 sequences: the words back to back, a loop the compiler vectorises */
            for (int32_t j = 0; j < n; j++)
                seen_pos[j] = bits[j] & bit ? pos[j] : -1;
        } else {
            for (int32_t j = 0; j < n; j++)
                seen_pos[j] = bits[(int64_t)j * stride] & bit ? pos[j] : -1;
        }
    }
    /* One row of the mask: 0 where the cell's position lies in [lo, lo + width], -inf elsewhere. */
    RC_MASK_CLONES
    static void rc_mask_row(float* row, const int32_t* seen_pos, int32_t n, int32_t lo, uint32_t width) {
        for (int32_t j = 0; j < n; j++)
            row[j] = (uint32_t)(seen_pos[j] - lo) <= width ? 0.0f : -INFINITY;
    }
    """
    void rc_seen_pos(int32_t* seen_pos, const int32_t* pos, const uint64_t* bits, int32_t stride, int32_t n,
                     uint64_t bit) noexcept nogil
    void rc_mask_row(float* row, const int32_t* seen_pos, int32_t n, int32_t lo, uint32_t width) noexcept nogil


cdef int kv_mask(const KvTable* t, int32_t n, const int32_t* pos, const int32_t* flat, const int32_t* offsets,
                 float* out, int32_t n_kv, bint sliding) noexcept nogil:
    """Per sequence of the ubatch, the position each cell holds for it (-1: none) once; then per
    token one branch-free pass: visible iff that position lies in the token's window [lo, p]."""
    cdef int32_t* seen_pos = <int32_t*>malloc(<size_t>n_kv * sizeof(int32_t))
    cdef int32_t* next_token = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
    cdef int32_t* first_token = <int32_t*>malloc(<size_t>t.n_seq_max * sizeof(int32_t))
    cdef int32_t token, seq, p, lo, swa_type = t.swa_type if sliding else SWA_NONE
    cdef uint32_t width
    cdef int32_t word_index
    cdef uint64_t bit
    if seen_pos == NULL or next_token == NULL or first_token == NULL:
        free(seen_pos)
        free(next_token)
        free(first_token)
        return KV_NO_MEMORY
    for seq in range(t.n_seq_max):
        first_token[seq] = -1
    for token in range(n - 1, -1, -1):    # each sequence's tokens, chained in order
        seq = flat[offsets[token]]
        next_token[token] = first_token[seq]
        first_token[seq] = token
    for seq in range(t.n_seq_max):
        if first_token[seq] < 0:
            continue
        word_index = seq >> 6
        bit = <uint64_t>1 << (seq & 63)
        rc_seen_pos(seen_pos, t.pos, t.seq_bits + word_index, t.seq_words, n_kv, bit)
        token = first_token[seq]
        while token >= 0:
            p = pos[token]
            lo = 0
            if swa_type == SWA_STANDARD:
                lo = p - t.n_swa + 1 if p >= t.n_swa else 0
            elif swa_type == SWA_CHUNKED:
                lo = (p // t.n_swa) * t.n_swa
            elif swa_type == SWA_SYMMETRIC:
                lo = p - t.n_swa // 2 if p >= t.n_swa // 2 else 0
            width = <uint32_t>(p - lo)
            rc_mask_row(out + <int64_t>token * n_kv, seen_pos, n_kv, lo, width)
            token = next_token[token]
    free(seen_pos)
    free(next_token)
    free(first_token)
    return KV_OK
