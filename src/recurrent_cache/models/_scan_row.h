/* One channel's row of the selective scan's one-token step (models/_scan.pyx):
 * h[k] = state[k] * decay[k or 0] + x * b[k];  out[k] = h[k] (through float when round_f32);  returns sum h[k] * c[k].
 * Plain loops over contiguous rows that the compiler vectorizes (-fopenmp-simd lets it split the sum into lanes). */
#ifndef RC_SCAN_ROW_H
#define RC_SCAN_ROW_H

#include <stddef.h>

#define RC_DEFINE_SCAN_ROW(NAME, real)                                                              \
    static inline real NAME(const real *restrict state, const real *restrict decay, int per_state,  \
                            real x, const real *restrict b, const real *restrict c,                 \
                            real *restrict out, ptrdiff_t d_state, int round_f32) {                 \
        real y = 0;                                                                                 \
        if (per_state) {                                                                            \
            _Pragma("omp simd reduction(+:y)")                                                      \
            for (ptrdiff_t k = 0; k < d_state; k++) {                                               \
                real h = state[k] * decay[k] + x * b[k];                                            \
                y += h * c[k];                                                                      \
                out[k] = round_f32 ? (real)(float)h : h;                                            \
            }                                                                                       \
        } else {                                                                                    \
            real d = decay[0];                                                                      \
            _Pragma("omp simd reduction(+:y)")                                                      \
            for (ptrdiff_t k = 0; k < d_state; k++) {                                               \
                real h = state[k] * d + x * b[k];                                                   \
                y += h * c[k];                                                                      \
                out[k] = round_f32 ? (real)(float)h : h;                                            \
            }                                                                                       \
        }                                                                                           \
        return y;                                                                                   \
    }

RC_DEFINE_SCAN_ROW(rc_scan_row_f32, float)
RC_DEFINE_SCAN_ROW(rc_scan_row_f64, double)

#endif
