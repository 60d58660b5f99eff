/* The vector widths GCC compiles a kernel's loops for, the one the CPU has chosen when the module loads
 * (x86-64: AVX-512, AVX2, else SSE2).  A kernel marked RC_VECTOR_CLONES gives the same bits at every width: the
 * order of its sums is fixed by its code (none is a reduction the compiler splits into a vector's lanes). */
#ifndef RC_VECTOR_CLONES_H
#define RC_VECTOR_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define RC_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define RC_VECTOR_CLONES
#endif

#endif
