"""The compiled causal conv (models/_scan.pyx ``conv_tokens``, through ``_ssm.conv_tokens``) against the
array-API functions it replaces (``conv_window``, ``causal_conv``, ``conv_state_after``): the same outputs,
states and step states for any number of tokens, split invariance bit for bit, strided inputs, its refusals,
and where it must not run."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models._scan import conv_tokens as kernel
from recurrent_cache.models._ssm import causal_conv, conv_state_after, conv_tokens, conv_window
from recurrent_cache.models._storage import StateStorage

TOLERANCE = {np.float32: 2e-6, np.float64: 1e-14}


def inputs(dtype, n=3, n_tokens=4, channels=10, taps=4, seed=0, wide=False):
    rng = np.random.default_rng(seed)
    state = rng.uniform(-2, 2, (n, channels, taps - 1)).astype(dtype)
    # the mixers hand over a slice of a wider projection: strided over tokens
    x = rng.uniform(-2, 2, (n, n_tokens, 2 * channels if wide else channels)).astype(dtype)[..., :channels]
    weight = rng.uniform(-1, 1, (channels, taps)).astype(dtype)
    bias = rng.uniform(-1, 1, channels).astype(dtype)
    return state, x, weight, bias


def array_api(state, x, weight, bias, storage, m, activation):
    window = conv_window(np, state, x, storage)
    return (causal_conv(np, window, weight, bias, x.shape[1], activation),
            *conv_state_after(np, window, weight.shape[1], m))


def close(got, want, dtype):
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    assert float(np.abs(got - want).max(initial=0.0)) / scale <= TOLERANCE[dtype]


@pytest.mark.parametrize("activation", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("n_tokens, m", [(1, 0), (3, 0), (3, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_equals_the_array_api_functions(dtype, n_tokens, m, activation):
    state, x, weight, bias = inputs(dtype, n_tokens=n_tokens, wide=True)
    storage = StateStorage(np.dtype(np.float32))   # an f64 model rounds the kept inputs through it
    got = conv_tokens(np, state, x, weight, bias, storage, m, activation)
    want = array_api(state, x, weight, bias, storage, m, activation)
    for have, expected in zip(got[:2], want[:2], strict=True):
        close(have, expected, dtype)
    if m:
        close(got[2], want[2], dtype)
        np.testing.assert_array_equal(got[2][:, -1], want[2][:, -1])   # kept inputs are copied, not computed
    else:
        assert got[2] is None and want[2] is None
    np.testing.assert_array_equal(got[1], want[1])


def test_f32_storage_rounds_f64_inputs_as_the_array_api_does():
    state, x, weight, bias = inputs(np.float64, n_tokens=2)
    storage = StateStorage(np.dtype(np.float32))
    got = conv_tokens(np, state, x, weight, bias, storage, 1)
    want = array_api(state, x, weight, bias, storage, 1, True)
    np.testing.assert_array_equal(got[1], want[1])       # the new inputs kept as the f32 rows hold them
    np.testing.assert_array_equal(got[2], want[2])
    assert not np.array_equal(got[1][..., -1], x[:, -1])
    close(got[0], want[0], np.float64)


@pytest.mark.parametrize("activation", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("taps", [2, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_sequence_split_anyhow_gives_the_same_bits(dtype, taps, activation):
    """Single tokens (decoding: the kernel's one-token path) and runs of several give the same bits."""
    state, x, weight, bias = inputs(dtype, n_tokens=7, taps=taps, wide=True)
    bias = 0.0 if taps == 5 else bias   # a family without a conv bias (Qwen3-Next, LFM2) passes 0.0
    storage = StateStorage(np.dtype(np.float32))   # an f64 model rounds the kept inputs through it
    whole, after, _ = conv_tokens(np, state, x, weight, bias, storage, 0, activation)
    parts, conv = [], state
    for a, b in ((0, 1), (1, 4), (4, 5), (5, 6), (6, 7)):
        out, conv, _ = conv_tokens(np, conv, x[:, a:b], weight, bias, storage, 0, activation)
        parts.append(out)
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    np.testing.assert_array_equal(conv, after)


def test_f16_storage_runs_the_array_api_functions_exactly():
    state, x, weight, bias = inputs(np.float32, n_tokens=3)
    storage = StateStorage(np.dtype(np.float16))
    got = conv_tokens(np, state, x, weight, bias, storage, 2)
    want = array_api(state, x, weight, bias, storage, 2, True)
    for have, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(have, expected)


@pytest.mark.parametrize("bad", ["state", "weight", "bias", "out", "new_state", "steps", "m", "taps"])
def test_wrong_shapes_are_refused_before_anything_is_written(bad):
    state, x, weight, bias = inputs(np.float64, n_tokens=3)
    n, n_tokens, channels = x.shape
    args = {"state": state, "x": x, "weight": weight, "bias": bias,
            "out": np.full((n, n_tokens, channels), 7.0), "new_state": np.full(state.shape, 7.0),
            "steps": np.full((n, 1, channels, 3), 7.0)}
    if bad == "m":
        args["steps"] = np.full((n, 3, channels, 3), 7.0)      # 3 step states for 3 tokens: at most 2
    elif bad == "taps":
        args["weight"], args["state"] = np.ones((channels, 1)), np.ones((n, channels, 0))
        args["new_state"], args["steps"] = np.full((n, channels, 0), 7.0), np.full((n, 1, channels, 0), 7.0)
    else:
        args[bad] = np.full(tuple(d + 1 for d in args[bad].shape), 7.0)
    written = [args[name].copy() for name in ("out", "new_state", "steps")]
    with pytest.raises(ValueError):
        kernel(args["state"], args["x"], args["weight"], args["bias"], args["out"], args["new_state"],
               args["steps"], False, True)
    for name, before in zip(("out", "new_state", "steps"), written, strict=True):
        np.testing.assert_array_equal(args[name], before)


@pytest.mark.needs_torch
def test_torch_cpu_tensors_run_the_kernel_and_stay_tensors():
    torch = pytest.importorskip("torch")
    state, x, weight, bias = inputs(np.float32, n_tokens=2)
    storage = StateStorage(np.dtype(np.float32))
    want = conv_tokens(np, state, x, weight, bias, storage, 1)
    from recurrent_cache.models.torch_forward import TORCH_XP, TorchStateStorage

    got = conv_tokens(TORCH_XP, *(torch.from_numpy(a) for a in (state, x, weight, bias)),
                      TorchStateStorage(torch.float32), 1)
    for have, expected in zip(got, want, strict=True):
        assert isinstance(have, torch.Tensor)
        np.testing.assert_array_equal(have.numpy(), expected)
