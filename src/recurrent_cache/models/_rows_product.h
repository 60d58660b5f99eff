/* A few rows times a weight kept as [in, out] rows (models/_scan.pyx's rows_product, through _ssm.linear):
 *
 *     y[i, o] = sum over k = 0 .. in-1, in order, of x[i, k] * wt[k, o]      for each of the m rows of x
 *
 * The weight is streamed once for every 8 rows: the outputs in chunks, each chunk taking 12 inputs a pass (6
 * where its rows are a multiple of 4 KiB apart), and with several threads each thread takes one contiguous
 * share of the outputs.  Every output is one sum over k in k's order, so its bits do not depend on m, the
 * chunking, the inputs a pass, the thread count or the CPU's vector width (products are not fused into FMAs:
 * the build passes -ffp-contract=off).  Decoding one token
 * is such a product per projection; BLAS's GEMV / GEMM for these shapes stream the weight more slowly
 * (measured in docs/models.md). */
#ifndef RC_ROWS_PRODUCT_H
#define RC_ROWS_PRODUCT_H

#include <stddef.h>

#include "_parallel.h"

/* The vector widths GCC compiles the streaming loop for, chosen when the module loads (x86-64). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define RC_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RC_VECTOR_CLONES
#endif

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

/* Rows one pass over the weight serves: any more are taken in groups of 8 (their chunks and the weight
 * segments they read stay in L2), each output summed alike whatever the group */
#define RC_PRODUCT_GROUP 8

#define RC_DEFINE_PRODUCT_SPAN(NAME, real, STEP)                                                         \
    RC_VECTOR_CLONES                                                                                     \
    static void NAME(const real *restrict wt, const real *restrict x, real *restrict y,                  \
                     ptrdiff_t m, ptrdiff_t out, ptrdiff_t in, ptrdiff_t o0, ptrdiff_t o1) {             \
        const ptrdiff_t chunk = RC_PRODUCT_CHUNK(m);                                                     \
        for (ptrdiff_t c0 = o0; c0 < o1; c0 += chunk) {                                                  \
            const ptrdiff_t n = o1 - c0 < chunk ? o1 - c0 : chunk;                                       \
            for (ptrdiff_t i = 0; i < m; i++)                                                            \
                for (ptrdiff_t j = 0; j < n; j++) y[i * out + c0 + j] = 0;                               \
            ptrdiff_t k = 0;                                                                             \
            for (; k + STEP <= in; k += STEP) {                                                          \
                const real *a = wt + k * out + c0;                                                       \
                for (ptrdiff_t i = 0; i < m; i++) {                                                      \
                    real xs[STEP];                                                                       \
                    for (int q = 0; q < STEP; q++) xs[q] = x[i * in + k + q];                            \
                    real *yi = y + i * out + c0;                                                         \
                    _Pragma("omp simd")                                                                  \
                    for (ptrdiff_t j = 0; j < n; j++) {                                                  \
                        real s = yi[j];                                                                  \
                        for (int q = 0; q < STEP; q++) s += xs[q] * a[j + q * out];                      \
                        yi[j] = s;                                                                       \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
            for (; k < in; k++) {                                                                        \
                const real *a = wt + k * out + c0;                                                       \
                for (ptrdiff_t i = 0; i < m; i++) {                                                      \
                    const real xk = x[i * in + k];                                                       \
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
    /* the rows RC_PRODUCT_GROUP at a time, over outputs o0 .. o1-1 */                                 \
    static void NAME##_groups(const real *wt, const real *x, real *y, ptrdiff_t m, ptrdiff_t out,        \
                              ptrdiff_t in, ptrdiff_t o0, ptrdiff_t o1) {                                \
        for (ptrdiff_t i0 = 0; i0 < m; i0 += RC_PRODUCT_GROUP) {                                         \
            const ptrdiff_t rows = m - i0 < RC_PRODUCT_GROUP ? m - i0 : RC_PRODUCT_GROUP;                \
            if (RC_ALIASED_ROWS(out, real))                                                              \
                NAME##_span_aliased(wt, x + i0 * in, y + i0 * out, rows, out, in, o0, o1);               \
            else                                                                                         \
                NAME##_span(wt, x + i0 * in, y + i0 * out, rows, out, in, o0, o1);                       \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    static void NAME(const real *wt, const real *x, real *y, ptrdiff_t m, ptrdiff_t out, ptrdiff_t in,   \
                     int threads) {                                                                      \
        if (threads <= 1 || out < 256) {                                                                 \
            NAME##_groups(wt, x, y, m, out, in, 0, out);                                                 \
            return;                                                                                      \
        }                                                                                                \
        RC_PARALLEL_SHARES(threads, out, 16, NAME##_groups(wt, x, y, m, out, in, o0_, o1_))              \
    }

RC_DEFINE_ROWS_PRODUCT(rc_rows_product_f32, float)
RC_DEFINE_ROWS_PRODUCT(rc_rows_product_f64, double)

#endif
