/* Ask the kernel to back a large fresh buffer with transparent huge pages.
 *
 * Filling a new 256 MiB bytes object costs more in 4 KiB page faults than in
 * copying; numpy gives its large arrays the same advice.  Advice only: the
 * memory stays the caller's, and other systems do nothing. */
#ifndef RC_HUGEPAGES_H
#define RC_HUGEPAGES_H

#include <stddef.h>
#include <stdint.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

static inline void rc_advise_hugepages(void *buffer, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;   /* 2 MiB */
    uintptr_t start = ((uintptr_t)buffer + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)buffer + n) & ~(huge - 1);
    if (end > start)
        madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)buffer;
    (void)n;
#endif
}

#endif
