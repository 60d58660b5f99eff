/* One channel's row of the selective scan's one-token step (models/_scan.pyx):
 * h[k] = state[k] * decay[k or 0] + x * b[k];  out[k] = h[k] (through float when round_f32);  returns sum h[k] * c[k];
 * with saved, saved[k] = state[k] as it was.  out may be state itself (the step in place: saved then keeps
 * the old row), so neither is restrict.  Every variant sums y alike (the same loop, one store more or less),
 * which the tests check bit for bit.  Plain loops over contiguous rows that the compiler vectorizes
 * (-fopenmp-simd lets it split the sum into lanes). */
#ifndef RC_SCAN_ROW_H
#define RC_SCAN_ROW_H

#include <stddef.h>

#define RC_SCAN_ROW_LOOP(real, DECAY, SAVE)                                                         \
    _Pragma("omp simd reduction(+:y)")                                                              \
    for (ptrdiff_t k = 0; k < d_state; k++) {                                                       \
        real old = state[k];                                                                        \
        real h = old * (DECAY) + x * b[k];                                                          \
        y += h * c[k];                                                                              \
        SAVE;                                                                                       \
        out[k] = round_f32 ? (real)(float)h : h;                                                    \
    }

#define RC_DEFINE_SCAN_ROW(NAME, real)                                                              \
    static inline real NAME(const real *state, const real *restrict decay, int per_state,           \
                            real x, const real *restrict b, const real *restrict c,                 \
                            real *out, real *restrict saved, ptrdiff_t d_state, int round_f32) {   \
        real y = 0;                                                                                 \
        real d = decay[0];                                                                          \
        if (saved) {                                                                                \
            if (per_state) { RC_SCAN_ROW_LOOP(real, decay[k], saved[k] = old) }                     \
            else { RC_SCAN_ROW_LOOP(real, d, saved[k] = old) }                                      \
        } else {                                                                                    \
            if (per_state) { RC_SCAN_ROW_LOOP(real, decay[k], (void)0) }                            \
            else { RC_SCAN_ROW_LOOP(real, d, (void)0) }                                             \
        }                                                                                           \
        return y;                                                                                   \
    }

RC_DEFINE_SCAN_ROW(rc_scan_row_f32, float)
RC_DEFINE_SCAN_ROW(rc_scan_row_f64, double)

#endif
