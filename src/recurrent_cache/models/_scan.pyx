"""The compiled kernels numpy's and torch's CPU tensors both run (``_ssm`` hands them host views, no copy);
``_ssm``'s array-API functions are the reference they are tested against, and run every other case.

- ``scan_step``: the selective scan's one-token step in one pass over the state, optionally in place with the
  old rows kept for an undo (``_scan_row.h``).  The array-API scan makes several passes over
  ``[n, d_inner, d_state]`` a token, and at 130m shapes those passes, not the arithmetic, were the step's cost.
- ``delta_step``: Gated DeltaNet's one-token step (``_deltanet.delta_rule``) in the same way (``_delta_row.h``).
- ``conv_tokens``: the causal conv of every recurrent family, window, taps, bias, silu and the kept inputs in one
  pass (one token in C: ``_conv_step.h``).
- ``rows_product``: a few rows times a weight, the weight streamed once for 8 rows (``_rows_product.h``).
- ``rms_rows``, ``silu_values``, ``gated_rms_rows`` (``_silu.h``), ``copy_bytes``.

Passes over 256 KiB or more split their rows or outputs between ``product_threads()`` OpenMP threads
(``_parallel.h``), each thread whole rows or outputs of its own, so the count changes no bit.
"""

import os
import threading

cimport cython
from cython.parallel cimport prange
from libc.string cimport memcpy

ctypedef fused real:
    float
    double


cdef extern from "_parallel.h" nogil:
    int rc_product_threads_default()


# The threads the kernels' parallel passes take by default: OpenMP's count (OMP_NUM_THREADS, else the CPUs); 1
# without OpenMP.
cdef int _product_threads = rc_product_threads_default()
# Whether this process has run a pass in several threads, and whether it is a child forked after its parent
# had: GNU OpenMP's threads do not survive a fork, and the child's first parallel region would wait for them
# for ever, so such a child runs every pass in one thread.
cdef bint _threads_started = False
cdef bint _forked_after_threads = False


def _after_fork_in_child() -> None:
    global _forked_after_threads
    if _threads_started:
        _forked_after_threads = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# A pass over fewer bytes than this runs in one thread: waking a second one costs about what it would save
cdef Py_ssize_t _PARALLEL_MIN_BYTES = 256 * 1024
PARALLEL_MIN_BYTES = _PARALLEL_MIN_BYTES


# Per Python thread: how many ``one_thread()`` blocks it is in
_one_thread_depth = threading.local()


class one_thread:
    """``with one_thread():`` the kernels called from this Python thread run in one thread, other threads' calls
    as they were: a forward whose products go to BLAS, whose own threads keep spinning for a while after each
    call, would otherwise have two thread pools on the same cores (8 Mamba-2 sequences and 8 more at two threads
    each: 212 against 80 ms a step).  The results are the same bits (every pass here gives each thread whole
    outputs, rows or bytes of its own)."""

    def __enter__(self) -> None:
        _one_thread_depth.depth = getattr(_one_thread_depth, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _one_thread_depth.depth -= 1


cdef int _threads_now() except -1:
    """``product_threads()``: the setting, or 1 inside ``one_thread()`` and in a child forked after threads ran."""
    return 1 if _forked_after_threads or getattr(_one_thread_depth, "depth", 0) else _product_threads


cdef int _kernel_threads() except -1:
    """The threads a kernel's parallel pass takes (``_threads_now``), noting when that is several."""
    cdef int threads = _threads_now()
    if threads > 1:
        _mark_threads_started()
    return threads


cdef int _threads_for(Py_ssize_t size) except -1:
    """The threads a parallel pass over ``size`` bytes takes: ``_kernel_threads()``, or 1 for a small pass
    (every pass here gives each thread whole outputs, rows or bytes of its own: its result is the same bits
    whatever the count)."""
    return 1 if size < _PARALLEL_MIN_BYTES else _kernel_threads()


cdef void _mark_threads_started() noexcept:
    global _threads_started
    _threads_started = True


def product_threads() -> int:
    """The threads ``rows_product`` and the other parallel passes (a large enough scan step, delta step or copy)
    called from this Python thread use now (``set_product_threads``; at first OpenMP's default; 1 inside
    ``one_thread()``, and in a child forked after its parent's products ran in threads)."""
    return _threads_now()


def set_product_threads(int threads) -> None:
    """Have ``rows_product`` and the other parallel passes use ``threads`` threads (at least 1; a child forked
    after its parent's products ran in threads keeps to one)."""
    global _product_threads
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    _product_threads = threads


cdef extern from "_scan_row.h" nogil:
    void rc_scan_step_f32(const float* state, const float* decay, Py_ssize_t decay_s, Py_ssize_t decay_h,
                          int per_state, const float* x, const float* b, Py_ssize_t b_s, Py_ssize_t b_h,
                          const float* c, Py_ssize_t c_s, Py_ssize_t c_h, float* out, float* saved, float* y,
                          Py_ssize_t n, Py_ssize_t channels, Py_ssize_t per_head, Py_ssize_t d_state, int round_f32,
                          int threads)
    void rc_scan_step_f64(const double* state, const double* decay, Py_ssize_t decay_s, Py_ssize_t decay_h,
                          int per_state, const double* x, const double* b, Py_ssize_t b_s, Py_ssize_t b_h,
                          const double* c, Py_ssize_t c_s, Py_ssize_t c_h, double* out, double* saved, double* y,
                          Py_ssize_t n, Py_ssize_t channels, Py_ssize_t per_head, Py_ssize_t d_state, int round_f32,
                          int threads)


@cython.boundscheck(False)
@cython.wraparound(False)
def scan_step(const real[:, :, ::1] state, const real[:, :, :] decay, const real[:, ::1] x,
              const real[:, :, :] b, const real[:, :, :] c, real[:, :, ::1] out, real[:, ::1] y,
              bint round_f32, real[:, :, ::1] saved=None, unsigned char[::1] done=None):
    """One token: ``h = state * decay + x ⊗ b``, ``y = h @ c``, ``out = h`` (rounded through float32 when
    ``round_f32``: the state as its storage keeps it; ``y`` is of ``h`` unrounded, as in ``_ssm.scan_tokens``).

    Shapes, for ``n`` sequences of ``H`` heads of ``P`` channels and ``N`` =
    d_state: ``state`` / ``out`` [n, H*P, N]; ``decay`` [n, H, N or 1] (the
    same for every channel of a head, and for every ``N`` when its last axis
    is 1); ``x`` [n, H*P]; ``b`` / ``c`` [n, H or 1, N] (contiguous over ``N``;
    1: every head reads the same); ``y`` [n, H*P]; ``state``,
    ``x``, ``out`` and ``y`` C-contiguous.  Any other
    shape is a ``ValueError`` before anything is written.

    ``out`` may be ``state`` itself (the step in place), and ``saved`` [n, H*P, N]
    then gets the state as it was (what undoes the step) and ``done[0]`` is set to
    1 once the step is made (so that an undo knows, whenever it runs, whether
    ``saved`` holds anything); ``y`` is the same bits either way.
    """
    cdef Py_ssize_t n = state.shape[0], channels = state.shape[1], d_state = state.shape[2]
    cdef Py_ssize_t n_head = decay.shape[1], per_state = decay.shape[2]
    if n_head < 1 or channels % n_head or per_state not in (1, d_state):
        raise ValueError(f"decay of shape {(decay.shape[0], n_head, per_state)} for a state of "
                         f"{(n, channels, d_state)}")
    cdef Py_ssize_t shared_bc = 1 if b.shape[1] == 1 else n_head   # one B and C for every head, or one each
    for name, view_shape, wanted in (("decay", (decay.shape[0],), (n,)),
                                     ("x", (x.shape[0], x.shape[1]), (n, channels)),
                                     ("b", (b.shape[0], b.shape[1], b.shape[2]), (n, shared_bc, d_state)),
                                     ("c", (c.shape[0], c.shape[1], c.shape[2]), (n, shared_bc, d_state)),
                                     ("out", (out.shape[0], out.shape[1], out.shape[2]), (n, channels, d_state)),
                                     ("y", (y.shape[0], y.shape[1]), (n, channels)),
                                     ("saved", (n, channels, d_state) if saved is None else
                                      (saved.shape[0], saved.shape[1], saved.shape[2]), (n, channels, d_state))):
        if view_shape != wanted:
            raise ValueError(f"{name} of shape {view_shape}, expected {wanted}")
    # b, c and a decay per state are read as rows over d_state: their last axis must be contiguous
    for name, last_stride in (("b", b.strides[2]), ("c", c.strides[2]),
                              ("decay", decay.strides[2] if per_state > 1 else sizeof(real))):
        if last_stride != sizeof(real) and d_state > 1:
            raise ValueError(f"{name} is not contiguous over d_state (stride {last_stride} bytes)")
    for name, by_seq, by_head in (("decay", decay.strides[0], decay.strides[1]), ("b", b.strides[0], b.strides[1]),
                                  ("c", c.strides[0], c.strides[1])):
        if by_seq % sizeof(real) or by_head % sizeof(real):
            raise ValueError(f"{name}'s strides {(by_seq, by_head)} bytes are not whole elements")
    if n == 0 or channels == 0 or d_state == 0:
        return
    cdef Py_ssize_t per_head = channels // n_head
    cdef int threads = _threads_for(n * channels * d_state * sizeof(real))
    # element strides of the arrays read by sequence and head (b / c: 0 by head when every head reads one)
    cdef Py_ssize_t decay_s = decay.strides[0] // sizeof(real), decay_h = decay.strides[1] // sizeof(real)
    cdef Py_ssize_t b_s = b.strides[0] // sizeof(real), b_h = b.strides[1] // sizeof(real) if shared_bc > 1 else 0
    cdef Py_ssize_t c_s = c.strides[0] // sizeof(real), c_h = c.strides[1] // sizeof(real) if shared_bc > 1 else 0
    cdef real* saved_rows = NULL if saved is None else &saved[0, 0, 0]
    with nogil:
        # each row is its own: the threads' shares of them do not change a bit
        if real is float:
            rc_scan_step_f32(&state[0, 0, 0], &decay[0, 0, 0], decay_s, decay_h, per_state > 1, &x[0, 0],
                             &b[0, 0, 0], b_s, b_h, &c[0, 0, 0], c_s, c_h, &out[0, 0, 0], saved_rows, &y[0, 0], n,
                             channels, per_head, d_state, round_f32, threads)
        else:
            rc_scan_step_f64(&state[0, 0, 0], &decay[0, 0, 0], decay_s, decay_h, per_state > 1, &x[0, 0],
                             &b[0, 0, 0], b_s, b_h, &c[0, 0, 0], c_s, c_h, &out[0, 0, 0], saved_rows, &y[0, 0], n,
                             channels, per_head, d_state, round_f32, threads)
    if done is not None and done.shape[0]:
        done[0] = 1


cdef extern from "_delta_row.h" nogil:
    float rc_delta_row_f32(const float* state, float decay, const float* q, const float* k, float v, float beta,
                           float* out, Py_ssize_t d_k, int round_f32)
    double rc_delta_row_f64(const double* state, double decay, const double* q, const double* k, double v,
                            double beta, double* out, Py_ssize_t d_k, int round_f32)


@cython.boundscheck(False)
@cython.wraparound(False)
def delta_step(const real[:, :, :, ::1] state, const real[:, ::1] decay, const real[:, :, ::1] q,
               const real[:, :, ::1] k, const real[:, :, ::1] v, const real[:, ::1] beta,
               real[:, :, :, ::1] out, real[:, :, ::1] y, bint round_f32):
    """One token of the gated delta rule (``_deltanet.delta_rule``) in one pass over the state: per value head
    ``h``, ``S = state * decay``, ``S += ((v - S @ k) * beta) ⊗ k``, ``y = S @ q``, ``out = S`` (rounded through
    float32 when ``round_f32``; ``y`` is of ``S`` unrounded).

    Shapes, for ``n`` sequences of ``Hv`` value heads over ``Hk`` key heads (value head ``h`` reads key head
    ``h // (Hv / Hk)``): ``state`` / ``out`` [n, Hv, Dv, Dk]; ``decay`` and ``beta`` [n, Hv]; ``q`` / ``k``
    [n, Hk, Dk]; ``v`` / ``y`` [n, Hv, Dv]; all C-contiguous.  Any other shape is a ``ValueError`` before
    anything is written.
    """
    cdef Py_ssize_t n = state.shape[0], n_v = state.shape[1], d_v = state.shape[2], d_k = state.shape[3]
    cdef Py_ssize_t n_k = q.shape[1]
    if n_k < 1 or n_v % n_k:
        raise ValueError(f"{n_k} key heads for {n_v} value heads")
    for name, view_shape, wanted in (("decay", (decay.shape[0], decay.shape[1]), (n, n_v)),
                                     ("beta", (beta.shape[0], beta.shape[1]), (n, n_v)),
                                     ("q", (q.shape[0], q.shape[1], q.shape[2]), (n, n_k, d_k)),
                                     ("k", (k.shape[0], k.shape[1], k.shape[2]), (n, n_k, d_k)),
                                     ("v", (v.shape[0], v.shape[1], v.shape[2]), (n, n_v, d_v)),
                                     ("y", (y.shape[0], y.shape[1], y.shape[2]), (n, n_v, d_v)),
                                     ("out", (out.shape[0], out.shape[1], out.shape[2], out.shape[3]),
                                      (n, n_v, d_v, d_k))):
        if view_shape != wanted:
            raise ValueError(f"{name} of shape {view_shape}, expected {wanted}")
    if n == 0 or n_v == 0 or d_v == 0 or d_k == 0:
        return
    cdef Py_ssize_t per_key = n_v // n_k
    cdef Py_ssize_t i, s, h, hk, j
    cdef int threads = _threads_for(n * n_v * d_v * d_k * sizeof(real))
    with nogil:
        # each value head's matrix is its own: the threads' shares of them do not change a bit
        for i in prange(n * n_v, num_threads=threads, schedule="static"):
            s = i // n_v
            h = i % n_v
            hk = h // per_key
            for j in range(d_v):
                if real is float:
                    y[s, h, j] = rc_delta_row_f32(&state[s, h, j, 0], decay[s, h], &q[s, hk, 0], &k[s, hk, 0],
                                                  v[s, h, j], beta[s, h], &out[s, h, j, 0], d_k, round_f32)
                else:
                    y[s, h, j] = rc_delta_row_f64(&state[s, h, j, 0], decay[s, h], &q[s, hk, 0], &k[s, hk, 0],
                                                  v[s, h, j], beta[s, h], &out[s, h, j, 0], d_k, round_f32)


cdef extern from "_silu.h" nogil:
    float rc_silu_f32(float v)
    double rc_silu_f64(double v)
    void rc_silu_values_f32(const float* v, float* out, Py_ssize_t n)
    void rc_silu_values_f64(const double* v, double* out, Py_ssize_t n)
    void rc_gated_rms_rows_f32(const float* y, const float* z, Py_ssize_t z_row, const float* weight, float* out,
                               Py_ssize_t rows, Py_ssize_t width, Py_ssize_t n_group, double eps)
    void rc_gated_rms_rows_f64(const double* y, const double* z, Py_ssize_t z_row, const double* weight,
                               double* out, Py_ssize_t rows, Py_ssize_t width, Py_ssize_t n_group, double eps)


cdef extern from "_conv_step.h" nogil:
    void rc_conv_step_f32(const float* state, const float* x, Py_ssize_t x_s, Py_ssize_t x_c, const float* weight,
                          const float* bias, float* out, float* new_state, Py_ssize_t n, Py_ssize_t channels,
                          Py_ssize_t taps, int round_f32, int use_silu)
    void rc_conv_step_f64(const double* state, const double* x, Py_ssize_t x_s, Py_ssize_t x_c,
                          const double* weight, const double* bias, double* out, double* new_state, Py_ssize_t n,
                          Py_ssize_t channels, Py_ssize_t taps, int round_f32, int use_silu)


@cython.boundscheck(False)
@cython.wraparound(False)
def conv_tokens(const real[:, :, ::1] state, const real[:, :, :] x, const real[:, ::1] weight, const real[::1] bias,
                real[:, :, ::1] out, real[:, :, ::1] new_state, real[:, :, :, ::1] steps, bint round_f32,
                bint use_silu):
    """The depthwise causal conv over ``T`` tokens in one pass (``_ssm.conv_tokens``' kernel): per sequence and
    channel, the window of the last ``K - 1`` inputs (``state``) takes each token's input (rounded through
    float32 when ``round_f32``: as its storage keeps it), ``out[s, t, ch] = sum_k window[k] * weight[ch, k] +
    bias[ch]`` summed in ``k`` order (then ``silu`` when ``use_silu``), and the window after the last token goes to
    ``new_state``; ``steps`` [n, m, C, K-1] gets the windows after tokens ``T-1-m .. T-2``.

    Shapes: ``state`` / ``new_state`` [n, C, K-1]; ``x`` [n, T, C] (any strides); ``weight`` [C, K]; ``bias``
    [C]; ``out`` [n, T, C].  Any other shape is a ``ValueError`` before anything is written.
    """
    cdef Py_ssize_t n = x.shape[0], n_tokens = x.shape[1], channels = x.shape[2], taps = weight.shape[1]
    cdef Py_ssize_t kept = taps - 1, m = steps.shape[1]
    for name, view_shape, wanted in (("state", (state.shape[0], state.shape[1], state.shape[2]), (n, channels, kept)),
                                     ("weight", (weight.shape[0], weight.shape[1]), (channels, taps)),
                                     ("bias", (bias.shape[0],), (channels,)),
                                     ("out", (out.shape[0], out.shape[1], out.shape[2]), (n, n_tokens, channels)),
                                     ("new_state", (new_state.shape[0], new_state.shape[1], new_state.shape[2]),
                                      (n, channels, kept)),
                                     ("steps", (steps.shape[0], steps.shape[2], steps.shape[3]), (n, channels, kept))):
        if view_shape != wanted:
            raise ValueError(f"{name} of shape {view_shape}, expected {wanted}")
    if not 2 <= taps <= 64 or m > max(n_tokens - 1, 0):   # convolutions are a few taps wide
        raise ValueError(f"{taps} taps and {m} step states for {n_tokens} tokens")
    cdef Py_ssize_t s, ch, t, k, first_step = n_tokens - 1 - m
    cdef real acc, value
    cdef real window[64]     # the K - 1 kept inputs and the new one
    if n == 0 or channels == 0:
        return
    if n_tokens == 1:
        # decoding: the same sums in the same order, in C (a loop the compiler unrolls for 4 taps, and the silu
        # vectorized: a Mamba-2 layer's 1,792 channels 16 -> 2 us)
        if x.strides[0] % sizeof(real) or x.strides[2] % sizeof(real):
            raise ValueError(f"x's strides {(x.strides[0], x.strides[2])} bytes are not whole elements")
        with nogil:
            if real is float:
                rc_conv_step_f32(&state[0, 0, 0], &x[0, 0, 0], x.strides[0] // sizeof(real),
                                 x.strides[2] // sizeof(real), &weight[0, 0], &bias[0], &out[0, 0, 0],
                                 &new_state[0, 0, 0], n, channels, taps, round_f32, use_silu)
            else:
                rc_conv_step_f64(&state[0, 0, 0], &x[0, 0, 0], x.strides[0] // sizeof(real),
                                 x.strides[2] // sizeof(real), &weight[0, 0], &bias[0], &out[0, 0, 0],
                                 &new_state[0, 0, 0], n, channels, taps, round_f32, use_silu)
        return
    with nogil:
        for s in range(n):
            for ch in range(channels):
                for k in range(kept):
                    window[k] = state[s, ch, k]
                for t in range(n_tokens):
                    value = x[s, t, ch]
                    if round_f32:
                        value = <real><float>value
                    window[kept] = value
                    acc = window[0] * weight[ch, 0]
                    for k in range(1, taps):
                        acc = acc + window[k] * weight[ch, k]
                    acc = acc + bias[ch]
                    if use_silu:
                        if real is float:
                            acc = rc_silu_f32(acc)
                        else:
                            acc = rc_silu_f64(acc)
                    out[s, t, ch] = acc
                    for k in range(kept):
                        window[k] = window[k + 1]
                    if first_step <= t < n_tokens - 1:
                        for k in range(kept):
                            steps[s, t - first_step, ch, k] = window[k]
                for k in range(kept):
                    new_state[s, ch, k] = window[k]


cdef extern from "_rows_product.h" nogil:
    int rc_rows_product_f32(const float* wt, const float* x, float* y, Py_ssize_t m, Py_ssize_t out, Py_ssize_t n_in,
                            int threads)
    int rc_rows_product_f64(const double* wt, const double* x, double* y, Py_ssize_t m, Py_ssize_t out,
                            Py_ssize_t n_in, int threads)


@cython.boundscheck(False)
@cython.wraparound(False)
def rows_product(const real[:, ::1] x, const real[:, ::1] weight_t, real[:, ::1] y):
    """``y = x @ weight_t`` for rows ``x`` [m, in] and a weight kept as ``weight_t`` [in, out] (``_ssm.linear``'s
    kernel, ``_rows_product.h``; 8 rows a pass over the weight): each output summed over the inputs in an order
    fixed by the weight's shape (a weight of fewer than 16,384 outputs: in 4 blocks, each in order, the blocks'
    sums then added in order; a wider one: in order), in ``product_threads()`` threads.
    ``y`` [m, out], else a ``ValueError`` before anything is written."""
    cdef Py_ssize_t m = x.shape[0], n_in = x.shape[1], out = weight_t.shape[1]
    if weight_t.shape[0] != n_in or y.shape[0] != m or y.shape[1] != out:
        raise ValueError(f"rows of shape {(m, n_in)} times a weight of {(weight_t.shape[0], out)} "
                         f"into {(y.shape[0], y.shape[1])}")
    if m == 0 or out == 0:
        return
    if n_in == 0:
        y[:, :] = 0
        return
    cdef int threads = _kernel_threads()
    cdef int failed
    with nogil:
        if real is float:
            failed = rc_rows_product_f32(&weight_t[0, 0], &x[0, 0], &y[0, 0], m, out, n_in, threads)
        else:
            failed = rc_rows_product_f64(&weight_t[0, 0], &x[0, 0], &y[0, 0], m, out, n_in, threads)
    if failed:
        raise MemoryError(f"no memory for the partial sums of {m} rows of {out} outputs")


cdef extern from "math.h" nogil:
    double sqrt(double)


@cython.boundscheck(False)
@cython.wraparound(False)
def rms_rows(const real[:, ::1] v, double eps, real[:, ::1] out):
    """``out = v / sqrt(mean(v * v) + eps)`` row by row (``_ssm.rms_norm``'s kernel), the mean summed in double
    precision.  ``out`` of ``v``'s shape, else a ``ValueError`` before anything is written."""
    cdef Py_ssize_t rows = v.shape[0], width = v.shape[1], i, j
    if (out.shape[0], out.shape[1]) != (rows, width) or width == 0:
        raise ValueError(f"rows of shape {(rows, width)} into {(out.shape[0], out.shape[1])}")
    cdef double total
    cdef real scale
    with nogil:
        for i in range(rows):
            total = 0
            for j in range(width):
                total = total + <double>v[i, j] * v[i, j]
            scale = <real>sqrt(total / width + eps)
            for j in range(width):
                out[i, j] = v[i, j] / scale


def silu_values(const real[::1] v, real[::1] out):
    """``out = v / (1 + exp(-v))`` (``_ssm.silu``'s kernel; float32's exp ``_silu.h``'s, within 1.4 ulp: one
    vectorized pass where numpy makes four).  ``out`` as long as ``v``, else a ``ValueError`` before anything is
    written."""
    cdef Py_ssize_t n = v.shape[0]
    if out.shape[0] != n:
        raise ValueError(f"{n} values into {out.shape[0]}")
    if n == 0:
        return
    with nogil:
        if real is float:
            rc_silu_values_f32(&v[0], &out[0], n)
        else:
            rc_silu_values_f64(&v[0], &out[0], n)


def gated_rms_rows(const real[:, ::1] y, const real[:, :] z, const real[::1] weight, Py_ssize_t n_group, double eps,
                   real[:, ::1] out):
    """``out = rms_norm(y * silu(z))`` over each of ``n_group`` groups of a row, times ``weight``
    (``_ssm.gated_rms_norm``'s kernel: one call where the array-API function makes eleven; the norm as
    ``rms_rows``').  ``y`` / ``out`` [rows, width], ``z`` [rows, width] contiguous over its last axis,
    ``weight`` [width], ``width`` a multiple of ``n_group``; anything else is a ``ValueError`` before anything
    is written."""
    cdef Py_ssize_t rows = y.shape[0], width = y.shape[1]
    if ((z.shape[0], z.shape[1]) != (rows, width) or (out.shape[0], out.shape[1]) != (rows, width)
            or weight.shape[0] != width):
        raise ValueError(f"y of shape {(rows, width)} with z of {(z.shape[0], z.shape[1])}, weight of "
                         f"{(weight.shape[0],)} into {(out.shape[0], out.shape[1])}")
    if n_group < 1 or width % n_group or width == 0:
        raise ValueError(f"{n_group} groups of a row of {width}")
    if (z.strides[1] != sizeof(real) and width > 1) or z.strides[0] % sizeof(real):
        raise ValueError(f"z's strides {(z.strides[0], z.strides[1])} bytes: not contiguous over a row")
    if rows == 0:
        return
    with nogil:
        if real is float:
            rc_gated_rms_rows_f32(&y[0, 0], &z[0, 0], z.strides[0] // sizeof(real), &weight[0], &out[0, 0], rows,
                                  width, n_group, eps)
        else:
            rc_gated_rms_rows_f64(&y[0, 0], &z[0, 0], z.strides[0] // sizeof(real), &weight[0], &out[0, 0], rows,
                                  width, n_group, eps)


@cython.boundscheck(False)
@cython.wraparound(False)
def copy_bytes(const unsigned char[::1] source, unsigned char[::1] target):
    """``target[:] = source`` (``_storage.StateStorage.write``'s kernel: a layer's new states into its rows),
    split between ``product_threads()`` threads when it is large (one core does not reach the memory's
    bandwidth).  ``target`` as long as ``source``, else a ``ValueError`` before anything is written."""
    cdef Py_ssize_t size = source.shape[0]
    if target.shape[0] != size:
        raise ValueError(f"{size} bytes into {target.shape[0]}")
    if size == 0:
        return
    cdef int threads = _threads_for(size)
    # each thread one contiguous share, whole cache lines but the last
    cdef Py_ssize_t share = ((size + threads - 1) // threads + 63) // 64 * 64
    cdef Py_ssize_t part, start
    with nogil:
        for part in prange(threads, num_threads=threads, schedule="static"):
            start = part * share
            if start < size:
                memcpy(&target[start], &source[start], <size_t>min(share, size - start))
