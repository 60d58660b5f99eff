/* One channel's row of the selective scan's one-token step (models/_scan.pyx):
 * h[k] = state[k] * decay[k or 0] + x * b[k];  out[k] = h[k] (through float when round_f32);  returns sum h[k] * c[k];
 * with saved, saved[k] = state[k] as it was (copied before the row is stepped).  out may be state itself (the
 * step in place: saved then keeps the old row), so neither is restrict.  Every variant sums y alike (the same
 * loop), which the tests check bit for bit.  Plain loops over contiguous rows that the compiler vectorizes
 * (-fopenmp-simd lets it split the sum into lanes). */
#ifndef RC_SCAN_ROW_H
#define RC_SCAN_ROW_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "_parallel.h"

#define RC_SCAN_ROW_LOOP(real, DECAY)                                                               \
    _Pragma("omp simd reduction(+:y)")                                                              \
    for (ptrdiff_t k = 0; k < d_state; k++) {                                                       \
        real h = state[k] * (DECAY) + x * b[k];                                                     \
        y += h * c[k];                                                                              \
        out[k] = round_f32 ? (real)(float)h : h;                                                    \
    }

/* The old row into the undo buffer, which is read only if the forward fails: by non-temporal stores where the row
 * and the buffer allow (x86-64's SSE: 16-byte aligned whole vectors), so that no cache line of the buffer is read
 * before it is written, nor kept after (a Mamba-2 token at one thread: 19 MB less read); a copy otherwise. */
#if defined(__x86_64__) && defined(__SSE2__)
#define RC_HAS_STREAMS 1
#define RC_STREAM_F32(to, from) _mm_stream_ps(to, _mm_loadu_ps(from))
#define RC_STREAM_F64(to, from) _mm_stream_pd(to, _mm_loadu_pd(from))
#else
#define RC_HAS_STREAMS 0
#define RC_STREAM_F32(to, from) ((void)(to), (void)(from))
#define RC_STREAM_F64(to, from) ((void)(to), (void)(from))
#endif

#define RC_DEFINE_SAVE_ROW(NAME, real, STREAM)                                                      \
    static inline void NAME(real *restrict saved, const real *restrict state, ptrdiff_t n) {        \
        const ptrdiff_t lanes = 16 / (ptrdiff_t)sizeof(real);                                       \
        if (RC_HAS_STREAMS && ((uintptr_t)saved & 15) == 0 && n % lanes == 0) {                     \
            for (ptrdiff_t k = 0; k < n; k += lanes) STREAM(saved + k, state + k);                  \
            return;                                                                                 \
        }                                                                                           \
        memcpy(saved, state, (size_t)n * sizeof *saved);                                            \
    }

RC_DEFINE_SAVE_ROW(rc_save_row_f32, float, RC_STREAM_F32)
RC_DEFINE_SAVE_ROW(rc_save_row_f64, double, RC_STREAM_F64)

/* the non-temporal stores made visible to the other threads and to the undo (before the kernel returns) */
static inline void rc_saved_rows_fence(void) {
#if RC_HAS_STREAMS
    _mm_sfence();
#endif
}

#define RC_DEFINE_SCAN_ROW(NAME, real, SAVE_ROW)                                                    \
    static inline real NAME(const real *state, const real *restrict decay, int per_state,           \
                            real x, const real *restrict b, const real *restrict c,                 \
                            real *out, real *restrict saved, ptrdiff_t d_state, int round_f32) {   \
        real y = 0;                                                                                 \
        real d = decay[0];                                                                          \
        if (saved) SAVE_ROW(saved, state, d_state);                                                 \
        if (per_state) { RC_SCAN_ROW_LOOP(real, decay[k]) }                                \
        else { RC_SCAN_ROW_LOOP(real, d) }                                                 \
        return y;                                                                                   \
    }

/* The step over rows r0 .. r1-1 of the n * channels rows (row r: sequence r / channels, channel r % channels, of
 * head channel / per_head), the sequence, head and channel counted along rather than divided out per row (a
 * Mamba-1 row is 16 values: three divisions a row cost more than its arithmetic).  Strides in elements: decay
 * [n, heads, d_state or 1] by (decay_s, decay_h); b and c [n, heads or 1, d_state] by (b_s, b_h) and (c_s, c_h),
 * b_h and c_h 0 when every head reads one. */
#define RC_DEFINE_SCAN_ROWS(NAME, ROW, real)                                                              \
    static void NAME(const real *state, const real *decay, ptrdiff_t decay_s, ptrdiff_t decay_h,           \
                     int per_state, const real *x, const real *b, ptrdiff_t b_s, ptrdiff_t b_h,          \
                     const real *c, ptrdiff_t c_s, ptrdiff_t c_h, real *out, real *saved, real *y,         \
                     ptrdiff_t channels, ptrdiff_t per_head, ptrdiff_t d_state, int round_f32,             \
                     ptrdiff_t r0, ptrdiff_t r1) {                                                         \
        ptrdiff_t s = r0 / channels, ch = r0 % channels, h = ch / per_head, p = ch % per_head;            \
        for (ptrdiff_t r = r0; r < r1; r++) {                                                             \
            const ptrdiff_t at = r * d_state;                                                             \
            y[r] = ROW(state + at, decay + s * decay_s + h * decay_h, per_state, x[r],                    \
                       b + s * b_s + h * b_h, c + s * c_s + h * c_h, out + at,                            \
                       saved ? saved + at : NULL, d_state, round_f32);                                    \
            if (++p == per_head) { p = 0; h++; }                                                          \
            if (++ch == channels) { ch = 0; h = 0; p = 0; s++; }                                          \
        }                                                                                                 \
        if (saved) rc_saved_rows_fence();                                                                 \
    }

RC_DEFINE_SCAN_ROW(rc_scan_row_f32, float, rc_save_row_f32)
RC_DEFINE_SCAN_ROW(rc_scan_row_f64, double, rc_save_row_f64)
RC_DEFINE_SCAN_ROWS(rc_scan_rows_f32, rc_scan_row_f32, float)
RC_DEFINE_SCAN_ROWS(rc_scan_rows_f64, rc_scan_row_f64, double)

/* The step over all n * channels rows, each of `threads` threads a contiguous share of them. */
#define RC_DEFINE_SCAN_STEP(NAME, ROWS, real)                                                             \
    static void NAME(const real *state, const real *decay, ptrdiff_t decay_s, ptrdiff_t decay_h,           \
                     int per_state, const real *x, const real *b, ptrdiff_t b_s, ptrdiff_t b_h,          \
                     const real *c, ptrdiff_t c_s, ptrdiff_t c_h, real *out, real *saved, real *y,         \
                     ptrdiff_t n, ptrdiff_t channels, ptrdiff_t per_head, ptrdiff_t d_state, int round_f32,\
                     int threads) {                                                                        \
        const ptrdiff_t rows = n * channels;                                                              \
        if (threads <= 1) {                                                                               \
            ROWS(state, decay, decay_s, decay_h, per_state, x, b, b_s, b_h, c, c_s, c_h, out, saved, y,   \
                 channels, per_head, d_state, round_f32, 0, rows);                                        \
            return;                                                                                       \
        }                                                                                                 \
        RC_PARALLEL_SHARES(threads, rows, 1, ROWS(state, decay, decay_s, decay_h, per_state, x, b, b_s,   \
                                                  b_h, c, c_s, c_h, out, saved, y, channels, per_head,    \
                                                  d_state, round_f32, o0_, o1_))                          \
    }

RC_DEFINE_SCAN_STEP(rc_scan_step_f32, rc_scan_rows_f32, float)
RC_DEFINE_SCAN_STEP(rc_scan_step_f64, rc_scan_rows_f64, double)

#endif
