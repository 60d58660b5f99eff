/* silu(v) = v / (1 + exp(-v)) for the kernels (models/_scan.pyx: _ssm.silu, the causal conv's activation, the
 * gated norm).
 *
 * float's exp is rc_expf: exp(v) = 2^n * exp(r) with n = round(v / ln 2), r = v - n ln 2 (ln 2 in two parts),
 * and exp(r) by Cephes' degree-7 polynomial: within 1.4 ulp of the true exp over [-87.3, 88.3]; inf above
 * (float's largest is exp(88.72)), 0 below (where the true exp is subnormal: silu there is -0, as numpy's).
 * Plain arithmetic, so a loop of it vectorizes at the CPU's width, with the same bits at every width; libm's
 * expf is a call per value (silu of a Mamba-2 layer's 1,792 conv channels: 6.1 -> 0.9 us).  double keeps
 * libm's exp. */
#ifndef RC_SILU_H
#define RC_SILU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_vector_clones.h"

static inline float rc_expf(float v) {
    const float x = v < -87.3f ? -87.3f : v > 88.3f ? 88.3f : v;
    const float shifter = 12582912.0f;   /* 1.5 * 2^23: adding and taking it away rounds to an integer */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;   /* 2^n: n is within [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return v > 88.3f ? INFINITY : v < -87.3f ? 0.0f : p * scale;
}

static inline float rc_silu_f32(float v) { return v / (1.0f + rc_expf(-v)); }
static inline double rc_silu_f64(double v) { return v / (1.0 + exp(-v)); }

/* out[i] = silu(v[i]) for i < n (_ssm.silu's kernel) */
#define RC_DEFINE_SILU_VALUES(NAME, real, SILU)                                                          \
    RC_VECTOR_CLONES                                                                                     \
    static void NAME(const real *restrict v, real *restrict out, ptrdiff_t n) {                          \
        _Pragma("omp simd")                                                                              \
        for (ptrdiff_t i = 0; i < n; i++) out[i] = SILU(v[i]);                                           \
    }

/* Each row of y [rows, width] gated by silu of z's row (z: rows z_row elements apart), RMS-normed over each of
 * n_group groups (the mean of squares summed in double, in order) and times weight (_ssm.gated_rms_norm's
 * kernel): out = g / (real)sqrt(mean(g * g) + eps) * weight with g = y * silu(z), in the order the array-API
 * function takes (silu, the gate, _scan.rms_rows' norm, the weight). */
#define RC_DEFINE_GATED_RMS_ROWS(NAME, real, SILU)                                                       \
    RC_VECTOR_CLONES                                                                                     \
    static void NAME(const real *restrict y, const real *restrict z, ptrdiff_t z_row,                    \
                     const real *restrict weight, real *restrict out, ptrdiff_t rows, ptrdiff_t width,   \
                     ptrdiff_t n_group, double eps) {                                                    \
        const ptrdiff_t group = width / n_group;                                                         \
        for (ptrdiff_t r = 0; r < rows; r++) {                                                           \
            const real *yr = y + r * width, *zr = z + r * z_row;                                         \
            real *o = out + r * width;                                                                   \
            _Pragma("omp simd")                                                                          \
            for (ptrdiff_t j = 0; j < width; j++) o[j] = yr[j] * SILU(zr[j]);                            \
            for (ptrdiff_t g0 = 0; g0 < width; g0 += group) {                                            \
                double total = 0;                                                                        \
                for (ptrdiff_t j = g0; j < g0 + group; j++) total = total + (double)o[j] * o[j];         \
                const real scale = (real)sqrt(total / group + eps);                                      \
                _Pragma("omp simd")                                                                      \
                for (ptrdiff_t j = g0; j < g0 + group; j++) o[j] = o[j] / scale * weight[j];             \
            }                                                                                            \
        }                                                                                                \
    }

RC_DEFINE_SILU_VALUES(rc_silu_values_f32, float, rc_silu_f32)
RC_DEFINE_SILU_VALUES(rc_silu_values_f64, double, rc_silu_f64)
RC_DEFINE_GATED_RMS_ROWS(rc_gated_rms_rows_f32, float, rc_silu_f32)
RC_DEFINE_GATED_RMS_ROWS(rc_gated_rms_rows_f64, double, rc_silu_f64)

#endif
