/* One row of a value head's matrix state in the gated delta rule's one-token step (models/_scan.pyx's delta_step):
 *   s[i] = state[i] * decay;  delta = (v - sum s[i] * k[i]) * beta;  s[i] += delta * k[i];
 *   out[i] = s[i] (through float when round_f32);  returns sum s[i] * q[i]
 * Two passes over a row of d_k values, both in L1.  Plain loops the compiler vectorizes (-fopenmp-simd lets it
 * split the sums into lanes: a fixed order for a given build, whatever the row's sequence or ubatch). */
#ifndef RC_DELTA_ROW_H
#define RC_DELTA_ROW_H

#include <stddef.h>

#define RC_DEFINE_DELTA_ROW(NAME, real)                                                             \
    static inline real NAME(const real *restrict state, real decay, const real *restrict q,         \
                            const real *restrict k, real v, real beta, real *restrict out,          \
                            ptrdiff_t d_k, int round_f32) {                                         \
        real sk = 0, y = 0;                                                                         \
        _Pragma("omp simd reduction(+:sk)")                                                         \
        for (ptrdiff_t i = 0; i < d_k; i++) {                                                       \
            sk += (state[i] * decay) * k[i];                                                        \
        }                                                                                           \
        real delta = (v - sk) * beta;                                                               \
        _Pragma("omp simd reduction(+:y)")                                                          \
        for (ptrdiff_t i = 0; i < d_k; i++) {                                                       \
            real s = state[i] * decay + delta * k[i];                                               \
            y += s * q[i];                                                                          \
            out[i] = round_f32 ? (real)(float)s : s;                                                \
        }                                                                                           \
        return y;                                                                                   \
    }

RC_DEFINE_DELTA_ROW(rc_delta_row_f32, float)
RC_DEFINE_DELTA_ROW(rc_delta_row_f64, double)

#endif
