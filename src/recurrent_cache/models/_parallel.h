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

#ifdef _OPENMP
#define RC_PARALLEL_SHARES(threads, total, align, CALL)                                                  \
    _Pragma("omp parallel num_threads(threads)")                                                         \
    {                                                                                                    \
        const ptrdiff_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num();                          \
        const ptrdiff_t per_ = ((total + nt_ - 1) / nt_ + (align) - 1) / (align) * (align);             \
        const ptrdiff_t o0_ = t_ * per_, o1_ = o0_ + per_ < total ? o0_ + per_ : total;                  \
        if (o0_ < o1_) CALL;                                                                             \
    }
/* RC_PARALLEL_SHARES of CALL over `total`, then, once every thread is done, of THEN over `then_total` */
#define RC_PARALLEL_SHARES_THEN(threads, total, align, CALL, then_total, THEN)                           \
    _Pragma("omp parallel num_threads(threads)")                                                         \
    {                                                                                                    \
        const ptrdiff_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num();                          \
        {                                                                                                \
            const ptrdiff_t per_ = ((total + nt_ - 1) / nt_ + (align) - 1) / (align) * (align);         \
            const ptrdiff_t o0_ = t_ * per_, o1_ = o0_ + per_ < total ? o0_ + per_ : total;              \
            if (o0_ < o1_) CALL;                                                                         \
        }                                                                                                \
        _Pragma("omp barrier")                                                                           \
        {                                                                                                \
            const ptrdiff_t per_ = ((then_total + nt_ - 1) / nt_ + (align) - 1) / (align) * (align);    \
            const ptrdiff_t o0_ = t_ * per_, o1_ = o0_ + per_ < then_total ? o0_ + per_ : then_total;   \
            if (o0_ < o1_) THEN;                                                                         \
        }                                                                                                \
    }
static int rc_product_threads_default(void) { return omp_get_max_threads(); }
#else
#define RC_PARALLEL_SHARES(threads, total, align, CALL)                                                  \
    {                                                                                                    \
        (void)(threads);                                                                                 \
        const ptrdiff_t o0_ = 0, o1_ = total;                                                            \
        CALL;                                                                                            \
    }
#define RC_PARALLEL_SHARES_THEN(threads, total, align, CALL, then_total, THEN)                           \
    {                                                                                                    \
        (void)(threads);                                                                                 \
        {                                                                                                \
            const ptrdiff_t o0_ = 0, o1_ = total;                                                        \
            CALL;                                                                                        \
        }                                                                                                \
        {                                                                                                \
            const ptrdiff_t o0_ = 0, o1_ = then_total;                                                   \
            THEN;                                                                                        \
        }                                                                                                \
    }
static int rc_product_threads_default(void) { return 1; }
#endif

#endif
