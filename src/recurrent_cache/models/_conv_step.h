/* The causal conv of one token (decoding: models/_scan.pyx's conv_tokens with T = 1), per sequence s and channel:
 *
 *     out[s, ch] = state[s, ch, 0] * w[ch, 0] + ... + state[s, ch, K-2] * w[ch, K-2] + x * w[ch, K-1] + bias[ch]
 *
 * summed in that order (the order of conv_tokens' loop over several tokens, so a token's output does not depend
 * on its ubatch), then silu (_silu.h) when use_silu; new_state[s, ch] is the window after the token (the state
 * shifted, x last).  x is [n, C] by element strides (x_s, x_c): the mixers pass a slice of a wider projection,
 * rounded through float when round_f32 (as the state's storage keeps it).  The silu runs as a second loop over a
 * sequence's channels, which vectorizes; the taps' loop is compiled for 4 taps (every model here) and for any. */
#ifndef RC_CONV_STEP_H
#define RC_CONV_STEP_H

#include <stddef.h>

#include "_silu.h"
#include "_vector_clones.h"

#define RC_DEFINE_CONV_CHANNELS(NAME, real)                                                              \
    static inline __attribute__((always_inline)) void NAME(                                              \
            const real *state, const real *x, ptrdiff_t x_c, const real *weight, const real *bias,      \
            real *restrict out, real *new_state, ptrdiff_t channels, ptrdiff_t taps, int round_f32) {    \
        const ptrdiff_t kept = taps - 1;                                                                 \
        for (ptrdiff_t ch = 0; ch < channels; ch++) {                                                    \
            const real *in = state + ch * kept, *w = weight + ch * taps;                                 \
            real *after = new_state + ch * kept;                                                         \
            real value = x[ch * x_c];                                                                    \
            if (round_f32) value = (real)(float)value;                                                   \
            real acc = in[0] * w[0];                                                                     \
            for (ptrdiff_t k = 1; k < kept; k++) acc = acc + in[k] * w[k];                               \
            acc = acc + value * w[kept];                                                                 \
            out[ch] = acc + bias[ch];                                                                    \
            for (ptrdiff_t k = 0; k + 1 < kept; k++) after[k] = in[k + 1];                               \
            after[kept - 1] = value;                                                                     \
        }                                                                                                \
    }

#define RC_DEFINE_CONV_STEP(NAME, real, SILU)                                                            \
    RC_DEFINE_CONV_CHANNELS(NAME##_channels, real)                                                       \
    RC_VECTOR_CLONES                                                                                     \
    static void NAME(const real *state, const real *x, ptrdiff_t x_s, ptrdiff_t x_c, const real *weight,  \
                     const real *bias, real *out, real *new_state, ptrdiff_t n, ptrdiff_t channels,      \
                     ptrdiff_t taps, int round_f32, int use_silu) {                                      \
        for (ptrdiff_t s = 0; s < n; s++) {                                                              \
            const real *state_s = state + s * channels * (taps - 1);                                     \
            real *out_s = out + s * channels, *after_s = new_state + s * channels * (taps - 1);          \
            if (taps == 4)                                                                               \
                NAME##_channels(state_s, x + s * x_s, x_c, weight, bias, out_s, after_s, channels, 4,     \
                                round_f32);                                                              \
            else                                                                                         \
                NAME##_channels(state_s, x + s * x_s, x_c, weight, bias, out_s, after_s, channels, taps,  \
                                round_f32);                                                              \
            if (use_silu) {                                                                              \
                _Pragma("omp simd")                                                                      \
                for (ptrdiff_t ch = 0; ch < channels; ch++) out_s[ch] = SILU(out_s[ch]);                 \
            }                                                                                            \
        }                                                                                                \
    }

RC_DEFINE_CONV_STEP(rc_conv_step_f32, float, rc_silu_f32)
RC_DEFINE_CONV_STEP(rc_conv_step_f64, double, rc_silu_f64)

#endif
