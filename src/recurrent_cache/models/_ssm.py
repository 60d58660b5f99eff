"""The pieces of math the recurrent architectures share, written once against an array namespace ``xp``.

Every function takes ``xp`` (numpy, or torch through array-api-compat:
``_arrays.py``) and uses only what the array API standard names, so one
copy serves the numpy and the torch forward.  Shapes: ``n`` sequences,
``T`` tokens; a state is ``[n, *lead, d_state]`` (Mamba-1: lead = channels;
Mamba-2: lead = heads, head_dim).  The seeded initialisers are numpy only:
they make the weights a model then keeps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np

from .. import _args
from ._arrays import Array
from ._scan import conv_tokens as conv_tokens_kernel
from ._scan import (gated_rms_rows, one_thread, product_threads, rms_rows, rows_product, scan_step,
                    set_product_threads, silu_values)
from ._storage import StateStorage

_DLPACK_CPU = 1   # DLPack's device type of host memory (kDLCPU)
_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Rows ``linear`` computes with the compiled kernel, more with BLAS: at 130m shapes (one core, and two) the kernel
# streams a weight faster for 1-8 rows and BLAS's GEMM is the faster from 16 (docs/models.md)
FEW_ROWS = 8

__all__ = ["FEW_ROWS", "causal_conv", "conv_state_after", "conv_tokens", "conv_window", "gated_rms_norm",
           "get_num_threads", "host_step_rounding", "kernel_threads_for", "linear", "linear_rows", "product_weight",
           "random_conv", "random_dt_bias", "random_head", "rms_norm", "scan_step_on_host", "scan_tokens",
           "selective_scan", "set_num_threads", "silu", "softplus"]


def product_weight(weight: np.ndarray) -> np.ndarray:
    """A weight ``[out, in]`` of ``linear`` with the same values, stored as ``[in, out]`` rows (a Fortran-ordered
    view), so that ``weight.T`` is C-contiguous; a stack of them ``[n, out, in]`` (a mixture's experts) likewise,
    each ``weight[e]`` in that layout.

    BLAS then streams the weight once, adding ``x[k] * weight.T[k]`` into the
    outputs, rather than taking one dot product per output row: measured at
    130m shapes (one core), the 50,280 x 768 head 9.7 -> 6.7 ms for one row
    and 31 -> 17 ms for 8, on numpy's OpenBLAS and torch's MKL alike.
    """
    return np.ascontiguousarray(np.swapaxes(weight, -1, -2)).swapaxes(-1, -2)


def get_num_threads() -> int:
    """The threads the compiled kernels use (``linear`` on a few numpy rows, or torch CPU rows computed on by
    numpy; a scan or delta-rule step, a state's copy to its rows, from 256 KiB): at first OpenMP's default —
    ``OMP_NUM_THREADS``, else the CPUs — as numpy's BLAS takes; 1 in a build without OpenMP, in a child forked
    after its parent's kernels ran in threads (GNU OpenMP's threads do not survive a fork), and in a forward
    whose products go to BLAS (``kernel_threads_for``)."""
    return product_threads()


def set_num_threads(threads: int) -> None:
    """Have the compiled kernels use ``threads`` (at least 1); ``ArgumentError`` otherwise, nothing changed."""
    set_product_threads(_args.count(threads, "threads", 1))


def kernel_threads_for(n_rows: int) -> AbstractContextManager[None]:
    """The context a forward of ``n_rows`` token rows runs its kernels in: their threads when the products are
    the compiled kernel's (up to ``FEW_ROWS`` rows), one thread when they go to BLAS, which brings its own
    threads (``_scan.one_thread``: two pools on the same cores make each wait for the other; the same bits)."""
    return one_thread() if n_rows > FEW_ROWS else nullcontext()


def linear(x: Array, weight: Array) -> Array:
    """``x @ weight.T`` over the last axis of ``x`` [..., k], as one 2-D product; fastest with ``weight`` from
    ``product_weight``.

    Up to ``FEW_ROWS`` numpy rows (decoding: a token per sequence) times a float32 / float64 weight in that
    layout go to the compiled kernel (``_scan.rows_product``: each output summed over ``k`` in an order fixed
    by the weight's shape, so its bits are the same for any number of rows up to ``FEW_ROWS``, any thread count
    and any CPU); more rows, and torch's tensors, to the library's matmul (BLAS's GEMM: numpy's stacked matmul
    of a 3-D ``x`` does not reach BLAS, hence one 2-D product).
    """
    rows = x.reshape((-1, x.shape[-1]))
    if 0 < rows.shape[0] <= FEW_ROWS and _kernel_multiplies(rows, weight):
        product = np.empty((rows.shape[0], weight.shape[0]), rows.dtype)
        rows_product(np.ascontiguousarray(rows), weight.T, product)
    else:
        product = rows @ weight.T
    return product.reshape((*x.shape[:-1], weight.shape[0]))


def _kernel_multiplies(rows: Array, weight: Array) -> bool:
    """Whether ``_scan.rows_product`` takes ``rows`` times ``weight``: numpy arrays of one float32 / float64 dtype,
    the weight in ``product_weight``'s layout."""
    return (isinstance(rows, np.ndarray) and rows.dtype == weight.dtype and rows.dtype in _KERNEL_DTYPES
            and weight.T.flags.c_contiguous)


def linear_rows(x: Array, weight: Array) -> Array:
    """``linear``, with every row's outputs the same bits whatever the rows beside it, for any number of rows, on
    numpy (float32 / float64, ``weight`` in ``product_weight``'s layout): the compiled kernel, which streams the
    weight once for every ``FEW_ROWS`` rows (one BLAS product over many rows sums in another order than over one:
    its blocking changes with the rows).  Torch's tensors take a product per row, as close as torch comes (its
    batched product's kernel, hence its bits, also depends on how many rows there are)."""
    rows = x.reshape((-1, x.shape[-1]))
    if not _kernel_multiplies(rows, weight):
        return (x[..., None, :] @ weight.T)[..., 0, :]
    product = np.empty((rows.shape[0], weight.shape[0]), rows.dtype)
    rows_product(np.ascontiguousarray(rows), weight.T, product)
    return product.reshape((*x.shape[:-1], weight.shape[0]))


def rms_norm(xp: Any, v: Array, eps: float) -> Array:
    """``v / sqrt(mean(v*v) + eps)`` over the last axis (ggml_rms_norm, no weight): numpy's float32 / float64
    arrays by the compiled kernel (``_scan.rms_rows``: one pass, the mean summed in double precision, where
    numpy's ufuncs make six), anything else by the array API."""
    if _host_kernel_takes(xp, v):
        rows = np.ascontiguousarray(v).reshape((-1, v.shape[-1]))
        out = np.empty(rows.shape, v.dtype)
        rms_rows(rows, eps, out)
        return out.reshape(v.shape)
    return v / xp.sqrt(xp.mean(v * v, axis=-1, keepdims=True) + eps)


def silu(xp: Any, v: Array) -> Array:
    """``v / (1 + exp(-v))``: numpy's float32 / float64 arrays by the compiled kernel (``_scan.silu_values``: one
    pass, float32's exp a polynomial within 1.4 ulp), anything else by the array API (exp overflows to inf for
    very negative v: -0; numpy's warning is off in a forward)."""
    if _host_kernel_takes(xp, v):
        values = np.asarray(v, order="C")   # (ascontiguousarray would make a 0-d array 1-d)
        out = np.empty(values.shape, values.dtype)
        silu_values(values.reshape(-1), out.reshape(-1))
        return out
    return v / (1.0 + xp.exp(-v))


def _host_kernel_takes(xp: Any, *arrays: Array) -> bool:
    """Whether the compiled kernels take ``arrays``: numpy's, of one float32 / float64 dtype, not empty."""
    dtype = arrays[0].dtype
    return xp is np and dtype in _KERNEL_DTYPES and all(a.dtype == dtype and a.size for a in arrays)


def softplus(xp: Any, v: Array) -> Array:
    """ggml's: ``v`` above 20, else ``log1p(exp(v))``."""
    return xp.where(v > 20.0, v, xp.log1p(xp.exp(xp.minimum(v, 20.0))))


def gated_rms_norm(xp: Any, y: Array, z: Array, weight: Array, n_group: int, eps: float) -> Array:
    """``rms_norm(y * silu(z))`` over each of ``n_group`` groups of the last axis, times ``weight``
    (transformers' ``MambaRMSNormGated``, ``norm_before_gate=False``; llama.cpp's grouped ``build_norm``)."""
    *lead, width = y.shape
    if _host_kernel_takes(xp, y, z, weight) and z.shape == y.shape:
        # one call (``_scan.gated_rms_rows``) where the array API makes eleven: the same steps in the same order
        rows = np.ascontiguousarray(y).reshape((-1, width))
        out = np.empty(rows.shape, rows.dtype)
        gates = z.reshape((-1, width))
        if gates.strides[1] != gates.itemsize:
            gates = np.ascontiguousarray(gates)
        gated_rms_rows(rows, gates, np.ascontiguousarray(weight), n_group, eps, out)
        return out.reshape(y.shape)
    gated = y * silu(xp, z)
    grouped = rms_norm(xp, gated.reshape((*lead, n_group, width // n_group)), eps)
    return grouped.reshape((*lead, width)) * weight


# -- the causal conv over the cache's r row ------------------------------------------------------


def conv_window(xp: Any, conv: Array, inputs: Array, storage_r: StateStorage) -> Array:
    """The causal conv's window ``[n, channels, d_conv-1+T]``: the state ``conv`` [n, channels, d_conv-1],
    then ``inputs`` [n, T, channels].

    The inputs are rounded as the cache stores them *before* use, so the window
    is the same whether an input came from this ubatch or from the cache: the
    result does not depend on ubatch boundaries.
    """
    return xp.concat([conv, xp.permute_dims(storage_r.round(inputs), (0, 2, 1))], axis=2)


def causal_conv(xp: Any, window: Array, weight: Array, bias: Array | float, n_tokens: int,
                activation: bool = True) -> Array:
    """``silu(depthwise conv + bias)`` (``activation`` false: without the silu) over ``window`` (from
    ``conv_window``): [n, T, channels]."""
    # The taps summed in order for any number of tokens: a token's sum is then the same whatever its ubatch
    # (a dot product for one token, vecdot, sums in the order of its BLAS kernel: its bits differ by CPU)
    summed = window[:, :, 0:n_tokens] * weight[:, 0, None]
    for k in range(1, weight.shape[1]):
        summed = summed + window[:, :, k:k + n_tokens] * weight[:, k, None]
    summed = xp.permute_dims(summed, (0, 2, 1)) + bias
    return silu(xp, summed) if activation else summed


def conv_tokens(xp: Any, conv: Array, inputs: Array, weight: Array, bias: Array | float, storage_r: StateStorage,
                m: int, activation: bool = True) -> tuple[Array, Array, Array | None]:
    """The causal conv of ``inputs`` [n, T, channels] after the state ``conv`` [n, channels, d_conv-1]: its
    outputs [n, T, channels] (``silu`` of the sums when ``activation``), the state after the last token and
    (``m > 0``) after tokens T-1-m .. T-2 [n, m, channels, d_conv-1] — ``conv_window``, ``causal_conv`` and
    ``conv_state_after`` in one.

    In host memory, with a state storage that rounds through float32 or not at all, the compiled kernel
    (``_scan.conv_tokens``) does it in one pass for any number of tokens, so a sequence's result does not
    depend on its ubatch split; elsewhere the array-API functions run.
    """
    round_f32 = host_step_rounding(xp, conv, storage_r)
    d_conv = weight.shape[1]
    if round_f32 is None or weight.shape[1] > 64:
        window = conv_window(xp, conv, inputs, storage_r)
        outputs = causal_conv(xp, window, weight, bias, inputs.shape[1], activation)
        return (outputs, *conv_state_after(xp, window, d_conv, m))
    host_conv, host_inputs = np.ascontiguousarray(np.asarray(conv)), np.asarray(inputs)
    n, n_tokens, channels = host_inputs.shape
    host_bias = np.asarray(bias, dtype=host_conv.dtype)
    if host_bias.ndim == 0:   # a family without a conv bias passes 0.0
        host_bias = np.full(channels, host_bias)
    outputs = np.empty((n, n_tokens, channels), host_conv.dtype)
    new_state = np.empty_like(host_conv)
    steps = np.empty((n, m, channels, d_conv - 1), host_conv.dtype)
    conv_tokens_kernel(host_conv, host_inputs, np.asarray(weight), np.ascontiguousarray(host_bias), outputs,
                       new_state, steps, round_f32, activation)
    return xp.asarray(outputs), xp.asarray(new_state), xp.asarray(steps) if m else None


def conv_state_after(xp: Any, window: Array, d_conv: int, m: int) -> tuple[Array, Array | None]:
    """The conv state after the window's last token, and (``m > 0``) after each of its tokens
    T-1-m .. T-2: [n, m, channels, d_conv-1]."""
    n_tokens = window.shape[2] - (d_conv - 1)
    steps = (xp.stack([window[:, :, t + 1:t + d_conv] for t in range(n_tokens - 1 - m, n_tokens - 1)], axis=1)
             if m else None)
    return window[:, :, n_tokens:], steps


# -- the selective scan over the cache's s row ---------------------------------------------------


def selective_scan(xp: Any, state: Array, dt: Array, a: Array, x: Array, b: Array, c: Array,
                   storage_s: StateStorage, m: int) -> tuple[Array, Array, Array | None]:
    """The recurrence, token by token: ``h = h * exp(dt*a) + x ⊗ b``, ``y = h @ c``.

    ``state`` [n, *lead, d_state] is the state before the first token; ``dt``
    [n, T, ...] broadcasts with ``a`` to a token's decay; ``x`` [n, T, *lead];
    ``b`` and ``c`` [n, T, ..., d_state] broadcast over ``lead``'s last axis.
    The state is rounded to its storage after every token (the exactness
    contract: a batched run equals a solo run).  Returns ``y`` [n, T, *lead],
    the state after the last token, and (``m > 0``) the states after tokens
    T-1-m .. T-2, [n, m, *lead, d_state].

    One token without step states (decoding) in host memory runs the compiled
    kernel (``scan_step_on_host``); everything else, and the reference the
    kernel is tested against, is ``scan_tokens``.
    """
    if x.shape[1] == 1 and not m:
        stepped = scan_step_on_host(xp, state, dt, a, x, b, c, storage_s)
        if stepped is not None:
            return stepped
    return scan_tokens(xp, state, dt, a, x, b, c, storage_s, m)


def scan_tokens(xp: Any, state: Array, dt: Array, a: Array, x: Array, b: Array, c: Array,
                storage_s: StateStorage, m: int) -> tuple[Array, Array, Array | None]:
    """``selective_scan`` in the array API, token by token (any device, any storage)."""
    n_tokens = x.shape[1]
    first_step = n_tokens - 1 - m
    ys, steps = [], []
    for t in range(n_tokens):
        # one new array, updated in place: each pass over [n, *lead, d_state] costs (8 Mamba-2 rows: 6 MB)
        h = state * xp.exp(dt[:, t] * a)
        h += x[:, t, ..., None] * b[:, t, ..., None, :]
        ys.append((h @ c[:, t, ..., None])[..., 0])
        state = storage_s.round(h)
        if first_step <= t < n_tokens - 1:
            steps.append(state)
    y = ys[0][:, None] if n_tokens == 1 else xp.stack(ys, axis=1)
    return y, state, xp.stack(steps, axis=1) if m else None


def host_step_rounding(xp: Any, state: Array, storage_s: StateStorage) -> bool | None:
    """How a compiled one-token step (``_scan``) keeps the new ``state``: rounded through float32 (True), as
    computed (False: its storage is of its dtype), or None where no kernel applies: arrays outside host memory,
    a compute dtype other than float32 / float64, a storage that rounds other than through float32 (f16, bf16)."""
    if state.__dlpack_device__()[0] != _DLPACK_CPU or state.dtype not in (xp.float32, xp.float64):
        return None
    if storage_s.dtype == state.dtype:
        return False
    return True if storage_s.dtype == xp.float32 else None


def scan_step_on_host(xp: Any, state: Array, dt: Array, a: Array, x: Array, b: Array, c: Array,
                      storage_s: StateStorage) -> tuple[Array, Array, None] | None:
    """``selective_scan`` of one token (no step states) by the compiled kernel (``_scan.scan_step``: one pass
    over the state where the array-API math makes several), or None where it does not apply: arrays outside
    host memory, a state storage that rounds other than through float32 (f16, bf16).

    The arrays go to the kernel and back without a copy (a CPU tensor's memory is
    a numpy array's): numpy's and torch's CPU tensors alike run this one implementation.
    """
    round_f32 = host_step_rounding(xp, state, storage_s)
    if round_f32 is None:
        return None
    n, n_state = state.shape[0], state.shape[-1]
    # host views (np.asarray: numpy's own array, or a CPU tensor's memory through __array__, no copy)
    decay = np.asarray(xp.exp(dt[:, 0] * a))
    decay = decay.reshape((n, -1, decay.shape[-1]))   # [n, heads, d_state or 1]
    host_state = np.ascontiguousarray(np.asarray(state))
    y = np.empty(host_state.shape[:-1], host_state.dtype)
    channels = y.reshape((n, -1)).shape[1]
    inputs = (decay, np.ascontiguousarray(np.asarray(x[:, 0])).reshape((n, channels)),
              np.asarray(b[:, 0]).reshape((n, -1, n_state)), np.asarray(c[:, 0]).reshape((n, -1, n_state)))
    rows = host_state.reshape((n, channels, n_state))
    if storage_s.undo is not None and not round_f32 and host_state.flags.writeable:
        # the state is its rows as stored: stepped in place, the old values kept to undo it
        saved, done = storage_s.undo.saving(rows)
        scan_step(rows, *inputs, rows, y.reshape((n, channels)), False, saved, done)
        new_state = host_state
    else:
        new_state = np.empty_like(host_state)
        scan_step(rows, *inputs, new_state.reshape((n, channels, n_state)), y.reshape((n, channels)), round_f32)
    return xp.asarray(y)[:, None], xp.asarray(new_state), None


# -- seeded random weights, initialised as mamba_ssm does ------------------------------------------


def random_dt_bias(rng: np.random.Generator, n: int) -> np.ndarray:
    """The softplus bias that makes ``dt`` log-uniform in [1e-3, 1e-1] (mamba_ssm's ``dt_proj.bias``)."""
    dt_init = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), size=n))
    return dt_init + np.log(-np.expm1(-dt_init))   # softplus(bias) = dt_init


def random_conv(rng: np.random.Generator, channels: int, d_conv: int) -> tuple[np.ndarray, np.ndarray]:
    """A depthwise conv's weight [channels, d_conv] and bias, uniform in ±1/sqrt(d_conv) (torch's Conv1d)."""
    bound = 1 / np.sqrt(d_conv)
    return (rng.uniform(-bound, bound, size=(channels, d_conv)), rng.uniform(-bound, bound, size=channels))


def random_head(rng: np.random.Generator, n_vocab: int, n_embd: int, tied: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """token_embd, output_norm and output (None when tied), the output scaled so that logits spread over a
    few units: greedy decoding is not degenerate and sampling is not uniform."""
    token_embd = rng.standard_normal((n_vocab, n_embd))
    output_norm = 1.0 + 0.1 * rng.standard_normal(n_embd)
    output = None if tied else 3.0 * rng.standard_normal((n_vocab, n_embd)) / np.sqrt(n_embd)
    return token_embd, output_norm, output
