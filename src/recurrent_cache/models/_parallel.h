/* The kernels' threads (models/_scan.pyx): OpenMP's where the compiler has it, one thread otherwise.
 *
 * RC_PARALLEL_SHARES(threads, total, align, CALL) runs CALL in each of `threads` threads with o0_ .. o1_ its one
 * contiguous share of 0 .. total-1 (shares a multiple of `align`: whole vectors of outputs, say), and without
 * OpenMP CALL once over all of it.  A kernel whose threads each compute whole outputs or rows of their own
 * gives the same bits for any thread count. */
#ifndef RC_PARALLEL_H
#define RC_PARALLEL_H

#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* CALL with o0_ .. o1_ the share of 0 .. total-1 of thread t_ of nt_ (nothing when the share is empty) */
#define RC_THREAD_SHARE(total, align, CALL)                                                              \
    {                                                                                                    \
        const ptrdiff_t per_ = ((total + nt_ - 1) / nt_ + (align) - 1) / (align) * (align);             \
        const ptrdiff_t o0_ = t_ * per_, o1_ = o0_ + per_ < total ? o0_ + per_ : total;                  \
        if (o0_ < o1_) CALL;                                                                             \
    }

#ifdef _OPENMP
#define RC_PARALLEL_REGION(threads) _Pragma("omp parallel num_threads(threads)")
#define RC_THREAD_NUMBERS const ptrdiff_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num()
#define RC_BARRIER _Pragma("omp barrier")
static int rc_product_threads_default(void) { return omp_get_max_threads(); }
#else
#define RC_PARALLEL_REGION(threads) (void)(threads);
#define RC_THREAD_NUMBERS const ptrdiff_t nt_ = 1, t_ = 0
#define RC_BARRIER
static int rc_product_threads_default(void) { return 1; }
#endif

#define RC_PARALLEL_SHARES(threads, total, align, CALL)                                                  \
    RC_PARALLEL_REGION(threads)                                                                          \
    {                                                                                                    \
        RC_THREAD_NUMBERS;                                                                               \
        RC_THREAD_SHARE(total, align, CALL)                                                              \
    }

/* RC_PARALLEL_SHARES of CALL over `total`, then, once every thread is done, of THEN over `then_total` */
#define RC_PARALLEL_SHARES_THEN(threads, total, align, CALL, then_total, THEN)                           \
    RC_PARALLEL_REGION(threads)                                                                          \
    {                                                                                                    \
        RC_THREAD_NUMBERS;                                                                               \
        RC_THREAD_SHARE(total, align, CALL)                                                              \
        RC_BARRIER                                                                                       \
        RC_THREAD_SHARE(then_total, align, THEN)                                                         \
    }

#endif
