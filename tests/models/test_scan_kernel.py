"""The compiled one-token selective scan (models/_scan.pyx) against the array-API math it replaces
(``_ssm.scan_tokens``), on numpy and on torch CPU tensors, Mamba-1's and Mamba-2's shapes; and where it
must not run."""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import random_mamba2_model, random_model
from recurrent_cache.models._scan import scan_step
from recurrent_cache.models._ssm import scan_step_on_host, scan_tokens, selective_scan
from recurrent_cache.models._storage import StateStorage

# (decay's per-state axis, heads, channels per head, d_state, groups): Mamba-1 (a decay per channel and state,
# B and C shared by every channel), Mamba-2 (a decay per head, B and C per group of heads)
SHAPES = {"mamba1": (True, 6, 1, 16, 1), "mamba2": (False, 4, 8, 12, 2)}


def scan_inputs(xp, shape, n_seqs, dtype, seed=0):
    """Random inputs of ``selective_scan`` for one token, as a mixer passes them."""
    per_state, n_head, head_dim, d_state, n_group = SHAPES[shape]
    rng = np.random.default_rng(seed)

    def arr(*dims, low=-1.0, high=1.0):
        return xp.asarray(rng.uniform(low, high, dims).astype(dtype))
    if per_state:   # Mamba-1: lead = channels
        state = arr(n_seqs, n_head, d_state)
        dt, a = arr(n_seqs, 1, n_head, 1, low=0.001, high=0.1), arr(n_head, d_state, low=-16, high=-1)
        x, b, c = arr(n_seqs, 1, n_head), arr(n_seqs, 1, d_state), arr(n_seqs, 1, d_state)
    else:           # Mamba-2: lead = heads, head_dim; B and C repeated from their groups
        state = arr(n_seqs, n_head, head_dim, d_state)
        dt, a = arr(n_seqs, 1, n_head, 1, 1, low=0.001, high=0.1), arr(n_head, 1, 1, low=-8, high=-1)
        x = arr(n_seqs, 1, n_head, head_dim)
        b, c = (xp.repeat(arr(n_seqs, 1, n_group, d_state), n_head // n_group, axis=2) for _ in range(2))
    return state, dt, a, x, b, c


def namespace(name):
    if name == "numpy":
        return np
    return pytest.importorskip("array_api_compat.torch", reason="the torch variant needs torch: pip install '.[torch]'")


def host(values):
    return np.asarray(values)


@pytest.mark.parametrize("xp_name", ["numpy", pytest.param("torch", marks=pytest.mark.needs_torch)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, storage, bound", [(np.float32, np.float32, 2e-6), (np.float64, np.float32, 1e-14)])
def test_kernel_equals_the_array_api_scan(xp_name, shape, dtype, storage, bound):
    """Same new state and output as ``scan_tokens`` (up to the order of y's sum); a float64 state stored in f32
    rounds through float32 exactly as the array-API path does (``StateStorage.round``)."""
    xp = namespace(xp_name)
    args = scan_inputs(xp, shape, 3, dtype)
    storage_s = StateStorage(np.dtype(storage)) if xp is np else _torch_storage(storage)
    y, state, steps = scan_step_on_host(xp, *args, storage_s)
    y_ref, state_ref, _ = scan_tokens(xp, *args, storage_s, 0)
    assert steps is None
    assert type(y) is type(y_ref) and y.shape == y_ref.shape and state.shape == state_ref.shape
    assert y.dtype == y_ref.dtype and state.dtype == state_ref.dtype
    np.testing.assert_allclose(host(state), host(state_ref), rtol=bound, atol=bound)
    np.testing.assert_allclose(host(y), host(y_ref), rtol=bound, atol=bound)
    if storage != dtype:   # each new state value is a float32 value
        assert np.array_equal(host(state), host(state).astype(np.float32).astype(dtype))


def _torch_storage(dtype):   # the caches store f32, f16, bf16: the kernel serves f32
    from recurrent_cache.models.torch_forward import TorchStateStorage

    return TorchStateStorage(pytest.importorskip("torch").float32)


def test_kernel_leaves_the_old_state_alone():
    """The state before the token is read, never written: the rows stay as they were until every layer ran."""
    args = scan_inputs(np, "mamba2", 2, np.float32)
    before = args[0].copy()
    scan_step_on_host(np, *args, StateStorage(np.float32))
    assert np.array_equal(args[0], before)


def test_batched_step_equals_solo_steps():
    """Each sequence's result is its own (the exactness contract): 5 sequences together equal each alone."""
    state, dt, a, x, b, c = scan_inputs(np, "mamba2", 5, np.float32, seed=3)
    y, new_state, _ = scan_step_on_host(np, state, dt, a, x, b, c, StateStorage(np.float32))
    for s in range(5):
        one = slice(s, s + 1)
        y1, state1, _ = scan_step_on_host(np, state[one], dt[one], a, x[one], b[one], c[one],
                                          StateStorage(np.float32))
        assert np.array_equal(y1[0], y[s]) and np.array_equal(state1[0], new_state[s])


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_f16_and_bf16_states_take_the_array_api_path(storage):
    """A storage that rounds other than through float32 alone is the array-API math's (None here)."""
    args = scan_inputs(np, "mamba1", 2, np.float32)
    assert scan_step_on_host(np, *args, StateStorage.named(storage)) is None


def test_several_tokens_and_step_states_take_the_array_api_path(monkeypatch):
    """Only one token without step states goes to the kernel (selective_scan's dispatch)."""
    calls = []
    monkeypatch.setattr("recurrent_cache.models._ssm.scan_step_on_host",
                        lambda *args: calls.append(args) or None)
    state, dt, a, x, b, c = scan_inputs(np, "mamba1", 2, np.float32)
    storage_s = StateStorage(np.float32)
    selective_scan(np, state, np.concatenate([dt, dt], 1), a, np.concatenate([x, x], 1),
                   np.concatenate([b, b], 1), np.concatenate([c, c], 1), storage_s, 1)
    assert not calls
    selective_scan(np, state, dt, a, x, b, c, storage_s, 0)
    assert len(calls) == 1


def test_kernel_refuses_mismatched_shapes():
    """A shape that does not fit is a ValueError naming the array, before anything is written."""
    state = np.zeros((2, 4, 8), np.float32)
    out = np.full_like(state, 7.0)
    y = np.zeros((2, 4), np.float32)
    decay, x = np.ones((2, 4, 8), np.float32), np.ones((2, 4), np.float32)
    with pytest.raises(ValueError, match="b of shape"):
        scan_step(state, decay, x, np.ones((2, 4, 7), np.float32), np.ones((2, 4, 8), np.float32), out, y, False)
    with pytest.raises(ValueError, match="decay of shape"):
        scan_step(state, np.ones((2, 3, 8), np.float32), x, decay, decay, out, y, False)
    assert (out == 7.0).all()


@pytest.mark.parametrize("make", [random_model, random_mamba2_model])
def test_decoding_through_the_kernel_equals_the_array_api_forward(make, monkeypatch):
    """A whole model decoding two sequences token by token: logits and state rows with the kernel within
    1e-12 of the array-API scan's (float64)."""
    model = make(1, n_layer=2, n_vocab=50)
    runs = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr("recurrent_cache.models._ssm.scan_step_on_host", lambda *args: None)
        cache = model.new_cache(n_seq_max=2)
        logits = [model.forward(cache.init_batch(rc.Batch(token=[3 + i, 7], pos=[i, i], seq_id=[0, 1],
                                                          logits=[1, 1]), 2)) for i in range(4)]
        runs[kernel] = np.stack(logits), [np.asarray(row) for rows in cache.seq_state(1) for row in rows]
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=0, atol=1e-12)
    for with_kernel, without in zip(runs[True][1], runs[False][1]):
        np.testing.assert_allclose(with_kernel, without, rtol=0, atol=1e-12)
