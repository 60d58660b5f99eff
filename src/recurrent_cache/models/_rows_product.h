/* A few rows times a weight kept as [in, out] rows (models/_scan.pyx's rows_product, through _ssm.linear):
 *
 *     y[i, o] = sum over the blocks b, in order, of (sum over block b's inputs k, in order, of x[i, k] * wt[k, o])
 *
 * for each of the m rows of x: a weight of fewer than RC_PRODUCT_WIDE outputs splits its inputs into
 * RC_PRODUCT_BLOCKS consecutive blocks (RC_PRODUCT_BLOCK_INPUTS each, the last ones shorter or empty), a wider
 * one has one block, all its inputs in order.  The weight is streamed once for every 8 rows: a block's
 * outputs in chunks, each chunk taking 12 inputs a pass (6 where the weight's rows are a multiple of 4 KiB
 * apart); the threads each take one contiguous share of all blocks' outputs laid end to end (so at two
 * threads each streams half the weight's rows, not half of every row), then add the blocks.  The order of
 * every sum is fixed by the weight's shape alone, so its bits do not depend on m, the chunking, the inputs a
 * pass, the thread count or the CPU's vector width (products are not fused into FMAs: the build passes
 * -ffp-contract=off).  Decoding one token is such a product per projection; BLAS's GEMV / GEMM for these
 * shapes stream the weight more slowly (measured in docs/models.md). */
#ifndef RC_ROWS_PRODUCT_H
#define RC_ROWS_PRODUCT_H

#include <stddef.h>
#include <stdlib.h>

#include "_parallel.h"
#include "_vector_clones.h"

/* Weight rows a pass over a chunk of outputs: 12 streams at once read faster here than 8, whose rows' equal
 * offsets meet in the same cache sets (the 49 products of a Mamba-2 token, one thread: 19.4 against 20.9 ms);
 * but rows a multiple of 4 KiB apart (Mamba-1's 3,072-wide in-projection) put every stream in the same sets,
 * and there 6 do better.  How many rows a pass takes does not change a sum's order: the same bits. */
#define RC_PRODUCT_STEP 12
#define RC_PRODUCT_STEP_ALIASED 6
#define RC_ALIASED_ROWS(out, real) ((out) * (ptrdiff_t)sizeof(real) % 4096 == 0)

/* Outputs a chunk: one row's chunk of 16384 stays in L2 while the weight rows stream past it; with several rows
 * of x, 2048 keeps their chunks and the weight segments each of them reads in L2. */
#define RC_PRODUCT_CHUNK(m) ((m) == 1 ? 16384 : 2048)

/* Where a chunk's segment of a weight row is short (at most this many bytes: a 768-wide row is 3 KB), a pass
 * first asks for the first lines of the next pass's segments: each is a new stream to the hardware prefetcher,
 * which would otherwise learn it only after its first misses (Mamba-2's 24 out-projections of one row, A/B in
 * one process: 5.56 -> 4.79 ms at one thread, 3.15 -> 2.71 at two).  A hint only: the sums are the same. */
#define RC_PREFETCH_SEGMENT_BYTES 8192
#define RC_PREFETCH_LINES 2
#if defined(__GNUC__)
#define RC_PREFETCH(address) __builtin_prefetch((address), 0, 0)
#else
#define RC_PREFETCH(address) ((void)(address))
#endif

/* Rows one pass over the weight serves: any more are taken in groups of 8 (their chunks and the weight
 * segments they read stay in L2), each output summed alike whatever the group */
#define RC_PRODUCT_GROUP 8

/* A weight narrower than this many outputs sums each output over its inputs in RC_PRODUCT_BLOCKS consecutive
 * blocks, each in order, and adds the blocks' sums in order: the threads can then each stream a contiguous part
 * of the weight, where with shares of the outputs each would read a short segment of every row (Mamba-2's
 * 768-wide out-projections at two threads: 3.99 -> 3.09 ms for the 24 of a token).  A wider weight (a head) has
 * long segments either way, and one block: no partial sums of 50,000 outputs to add. */
#define RC_PRODUCT_WIDE 16384
#define RC_PRODUCT_BLOCKS 4
#define RC_PRODUCT_BLOCKS_OF(out) ((out) < RC_PRODUCT_WIDE ? RC_PRODUCT_BLOCKS : 1)
/* a block's inputs: a multiple of 16 (the 4 blocks of 768 inputs are 192 each); the last may be shorter or empty */
#define RC_PRODUCT_BLOCK_INPUTS(in, blocks) ((((in) + (blocks) - 1) / (blocks) + 15) / 16 * 16)

/* y[i, o0..o1-1] = sum over k < k_count, in order, of x[i * ldx + k] * wt[k * out + o] for each of m rows */
#define RC_DEFINE_PRODUCT_SPAN(NAME, real, STEP)                                                         \
    RC_VECTOR_CLONES                                                                                     \
    static void NAME(const real *restrict wt, const real *restrict x, ptrdiff_t ldx, real *restrict y,   \
                     ptrdiff_t m, ptrdiff_t out, ptrdiff_t k_count, ptrdiff_t o0, ptrdiff_t o1) {        \
        const ptrdiff_t chunk = RC_PRODUCT_CHUNK(m);                                                     \
        for (ptrdiff_t c0 = o0; c0 < o1; c0 += chunk) {                                                  \
            const ptrdiff_t n = o1 - c0 < chunk ? o1 - c0 : chunk;                                       \
            for (ptrdiff_t i = 0; i < m; i++)                                                            \
                for (ptrdiff_t j = 0; j < n; j++) y[i * out + c0 + j] = 0;                               \
            ptrdiff_t k = 0;                                                                             \
            const int hint = n * (ptrdiff_t)sizeof(real) <= RC_PREFETCH_SEGMENT_BYTES;                   \
            for (; k + STEP <= k_count; k += STEP) {                                                     \
                const real *a = wt + k * out + c0;                                                       \
                if (hint && k + 2 * STEP <= k_count)                                                     \
                    for (int q = 0; q < STEP; q++)                                                       \
                        for (int line = 0; line < RC_PREFETCH_LINES; line++)                             \
                            RC_PREFETCH(a + (STEP + q) * out + line * (64 / (ptrdiff_t)sizeof(real)));   \
                for (ptrdiff_t i = 0; i < m; i++) {                                                      \
                    real xs[STEP];                                                                       \
                    for (int q = 0; q < STEP; q++) xs[q] = x[i * ldx + k + q];                           \
                    real *yi = y + i * out + c0;                                                         \
                    _Pragma("omp simd")                                                                  \
                    for (ptrdiff_t j = 0; j < n; j++) {                                                  \
                        real s = yi[j];                                                                  \
                        for (int q = 0; q < STEP; q++) s += xs[q] * a[j + q * out];                      \
                        yi[j] = s;                                                                       \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (; k < k_count; k++) {                                                                   \
                const real *a = wt + k * out + c0;                                                       \
                for (ptrdiff_t i = 0; i < m; i++) {                                                      \
                    const real xk = x[i * ldx + k];                                                      \
                    real *yi = y + i * out + c0;                                                         \
                    _Pragma("omp simd")                                                                  \
                    for (ptrdiff_t j = 0; j < n; j++) yi[j] += xk * a[j];                                \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#define RC_DEFINE_ROWS_PRODUCT(NAME, real)                                                               \
    RC_DEFINE_PRODUCT_SPAN(NAME##_span, real, RC_PRODUCT_STEP)                                           \
    RC_DEFINE_PRODUCT_SPAN(NAME##_span_aliased, real, RC_PRODUCT_STEP_ALIASED)                           \
                                                                                                         \
    /* block b's sums (inputs k0 .. k0+k_count-1) over outputs o0 .. o1-1 into y, the rows RC_PRODUCT_GROUP  \
     * at a time */                                                                                      \
    static void NAME##_groups(const real *wt, const real *x, real *y, ptrdiff_t m, ptrdiff_t out,        \
                              ptrdiff_t in, ptrdiff_t k0, ptrdiff_t k_count, ptrdiff_t o0, ptrdiff_t o1) { \
        for (ptrdiff_t i0 = 0; i0 < m; i0 += RC_PRODUCT_GROUP) {                                         \
            const ptrdiff_t rows = m - i0 < RC_PRODUCT_GROUP ? m - i0 : RC_PRODUCT_GROUP;                \
            if (RC_ALIASED_ROWS(out, real))                                                              \
                NAME##_span_aliased(wt + k0 * out, x + i0 * in + k0, in, y + i0 * out, rows, out,        \
                                    k_count, o0, o1);                                                    \
            else                                                                                         \
                NAME##_span(wt + k0 * out, x + i0 * in + k0, in, y + i0 * out, rows, out, k_count, o0,   \
                            o1);                                                                         \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* the part u0 .. u1-1 of all blocks' outputs laid end to end (block b's outputs are b * out ..        \
     * b * out + out-1): block 0's sums go to y, block b's to partial + (b-1) * m * out */                 \
    static void NAME##_units(const real *wt, const real *x, real *y, real *partial, ptrdiff_t m,         \
                             ptrdiff_t out, ptrdiff_t in, ptrdiff_t block_inputs, ptrdiff_t u0,          \
                             ptrdiff_t u1) {                                                             \
        for (ptrdiff_t b = u0 / out; b * out < u1; b++) {                                                \
            const ptrdiff_t o0 = u0 > b * out ? u0 - b * out : 0;                                        \
            const ptrdiff_t o1 = u1 < (b + 1) * out ? u1 - b * out : out;                                \
            const ptrdiff_t k0 = b * block_inputs;                                                       \
            const ptrdiff_t k_count = in - k0 < block_inputs ? in - k0 : block_inputs;                   \
            NAME##_groups(wt, x, b ? partial + (b - 1) * m * out : y, m, out, in, k0, k_count, o0, o1);  \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* y[i, o0..o1-1] += the later blocks' sums, in block order */                                      \
    static void NAME##_add_blocks(real *y, const real *partial, ptrdiff_t m, ptrdiff_t out,              \
                                  ptrdiff_t blocks, ptrdiff_t o0, ptrdiff_t o1) {                        \
        for (ptrdiff_t i = 0; i < m; i++)                                                                \
            for (ptrdiff_t b = 1; b < blocks; b++) {                                                     \
                const real *p = partial + (b - 1) * m * out + i * out;                                   \
                real *yi = y + i * out;                                                                  \
                _Pragma("omp simd")                                                                      \
                for (ptrdiff_t o = o0; o < o1; o++) yi[o] += p[o];                                       \
            }                                                                                            \
    }                                                                                                    \
                                                                                                         \
    /* 0, or -1 where the partial sums' memory could not be had (nothing written) */                    \
    static int NAME(const real *wt, const real *x, real *y, ptrdiff_t m, ptrdiff_t out, ptrdiff_t in,    \
                    int threads) {                                                                       \
        const ptrdiff_t most = RC_PRODUCT_BLOCKS_OF(out);                                                \
        const ptrdiff_t block_inputs = RC_PRODUCT_BLOCK_INPUTS(in, most);                                \
        const ptrdiff_t blocks = (in + block_inputs - 1) / block_inputs;   /* the non-empty ones */      \
        real *partial = NULL;                                                                            \
        if (blocks > 1 && !(partial = (real *)malloc((size_t)((blocks - 1) * m * out) * sizeof(real))))  \
            return -1;                                                                                   \
        if (threads <= 1 || out < 256) {                                                                 \
            NAME##_units(wt, x, y, partial, m, out, in, block_inputs, 0, blocks * out);                  \
            NAME##_add_blocks(y, partial, m, out, blocks, 0, out);                                       \
        } else if (blocks == 1) {                                                                        \
            RC_PARALLEL_SHARES(threads, out, 16, NAME##_units(wt, x, y, NULL, m, out, in, block_inputs, o0_, o1_)) \
        } else {                                                                                         \
            RC_PARALLEL_SHARES_THEN(threads, blocks * out, 16,                                           \
                                    NAME##_units(wt, x, y, partial, m, out, in, block_inputs, o0_, o1_), \
                                    out, NAME##_add_blocks(y, partial, m, out, blocks, o0_, o1_))        \
        }                                                                                                \
        free(partial);                                                                                   \
        return 0;                                                                                        \
    }

RC_DEFINE_ROWS_PRODUCT(rc_rows_product_f32, float)
RC_DEFINE_ROWS_PRODUCT(rc_rows_product_f64, double)

#endif
