/* Bit helpers for the free-cell bitset: index of the lowest set bit. */
#ifndef RC_BITS_H
#define RC_BITS_H

#include <stdint.h>

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static inline int rc_ctz64(uint64_t x) {
    unsigned long index;
    _BitScanForward64(&index, x);
    return (int) index;
}
#else
/* x must be non-zero */
static inline int rc_ctz64(uint64_t x) { return __builtin_ctzll(x); }
#endif

#endif
