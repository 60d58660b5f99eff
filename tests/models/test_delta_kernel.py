"""The compiled one-token gated delta rule (models/_scan.pyx's ``delta_step``, run by ``_deltanet.delta_rule`` in
host memory) against the array-API math it replaces (``_deltanet.delta_rule_tokens``), on numpy and on torch CPU
tensors; its exactness contract (a sequence's bits do not depend on its batch); and where it must not run."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models._deltanet import delta_rule, delta_rule_tokens
from recurrent_cache.models._scan import delta_step
from recurrent_cache.models._storage import StateStorage

# (value heads, key heads, Dv, Dk): value heads sharing a key head with Dk != Dv, and one odd Dk (rows that start
# at every alignment)
SHAPES = {"shared-keys": (4, 2, 6, 8), "odd-width": (3, 3, 5, 7)}


def delta_inputs(xp, shape, n_seqs, n_tokens, dtype, seed=0):
    """Random inputs of ``delta_rule`` as ``gated_deltanet`` passes them: q and k l2-normed, g <= 0, beta in (0, 1)."""
    n_v, n_k, d_v, d_k = SHAPES[shape]
    rng = np.random.default_rng(seed)

    def normed(*dims):
        x = rng.standard_normal(dims)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)
    arrays = (rng.uniform(-1, 1, (n_seqs, n_v, d_v, d_k)), normed(n_seqs, n_tokens, n_k, d_k) / np.sqrt(d_k),
              normed(n_seqs, n_tokens, n_k, d_k), rng.standard_normal((n_seqs, n_tokens, n_v, d_v)),
              -rng.uniform(0.01, 2.0, (n_seqs, n_tokens, n_v)), rng.uniform(0.05, 0.95, (n_seqs, n_tokens, n_v)))
    return tuple(xp.asarray(a.astype(dtype)) for a in arrays)


def namespace(name):
    if name == "numpy":
        return np
    return pytest.importorskip("recurrent_cache.models.torch_forward",
                               reason="the torch variant needs torch: pip install '.[torch]'").TORCH_XP


def storage_of(xp, dtype):
    if xp is np:
        return StateStorage(np.dtype(dtype))
    from recurrent_cache.models.torch_forward import TorchStateStorage

    return TorchStateStorage(pytest.importorskip("torch").float32)   # the caches store f32, f16, bf16


@pytest.mark.parametrize("xp_name", ["numpy", pytest.param("torch", marks=pytest.mark.needs_torch)])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, storage, bound", [(np.float32, np.float32, 2e-6), (np.float64, np.float32, 1e-14)])
@pytest.mark.parametrize("n_tokens, m", [(1, 0), (5, 3)])
def test_kernel_equals_the_array_api_delta_rule(xp_name, shape, dtype, storage, bound, n_tokens, m):
    """Outputs, the state and the step states as ``delta_rule_tokens`` gives them, up to the order of the sums;
    a float64 state stored in f32 is rounded through float32 after every token, as the array-API path does."""
    xp = namespace(xp_name)
    args = delta_inputs(xp, shape, 3, n_tokens, dtype)
    storage_s = storage_of(xp, storage)
    y, state, steps = delta_rule(xp, *args, storage_s, m)
    y_ref, state_ref, steps_ref = delta_rule_tokens(xp, *args, storage_s, m)
    for ours, theirs in ((y, y_ref), (state, state_ref)) + (((steps, steps_ref),) if m else ()):
        assert type(ours) is type(theirs) and ours.shape == theirs.shape and ours.dtype == theirs.dtype
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=bound, atol=bound)
    assert steps is None if not m else steps.shape[1] == m
    if storage != dtype:   # each new state value is a float32 value
        assert np.array_equal(np.asarray(state), np.asarray(state).astype(np.float32).astype(dtype))


@pytest.mark.parametrize("shape", SHAPES)
def test_sequences_together_give_the_bits_each_gives_alone(shape):
    """The exactness contract: 5 sequences in one call equal each alone, and a run of 4 tokens equals 4 runs of
    one (the kernel serves every token in host memory, so the split cannot change the order of a sum)."""
    state, q, k, v, g, beta = delta_inputs(np, shape, 5, 4, np.float32, seed=3)
    storage_s = StateStorage(np.dtype(np.float32))
    y, new_state, _ = delta_rule(np, state, q, k, v, g, beta, storage_s, 0)
    for s in range(5):
        one = slice(s, s + 1)
        current = state[one]
        for t in range(4):
            token = slice(t, t + 1)
            y1, current, _ = delta_rule(np, current, q[one, token], k[one, token], v[one, token], g[one, token],
                                        beta[one, token], storage_s, 0)
            assert np.array_equal(y1[0, 0], y[s, t])
        assert np.array_equal(current[0], new_state[s])


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_f16_and_bf16_states_take_the_array_api_path(storage, monkeypatch):
    """A storage that rounds other than through float32 is the array-API math's: the kernel is not called."""
    monkeypatch.setattr("recurrent_cache.models._deltanet.delta_step", lambda *args: pytest.fail("kernel called"))
    args = delta_inputs(np, "shared-keys", 2, 2, np.float32)
    y, state, _ = delta_rule(np, *args, StateStorage.named(storage), 0)
    y_ref, state_ref, _ = delta_rule_tokens(np, *args, StateStorage.named(storage), 0)
    assert np.array_equal(y, y_ref) and np.array_equal(state, state_ref)


def test_kernel_leaves_the_old_state_alone():
    """The state before the token is read, never written (it may be the cache's own rows)."""
    args = delta_inputs(np, "shared-keys", 2, 1, np.float32)
    before = args[0].copy()
    delta_rule(np, *args, StateStorage(np.dtype(np.float32)), 0)
    assert np.array_equal(args[0], before)


def test_kernel_refuses_mismatched_shapes():
    """A shape that does not fit is a ValueError naming the array, before anything is written."""
    state = np.zeros((2, 4, 3, 8), np.float32)
    out, y = np.full_like(state, 7.0), np.full((2, 4, 3), 7.0, np.float32)
    heads, keys, values = np.ones((2, 4), np.float32), np.ones((2, 2, 8), np.float32), np.ones((2, 4, 3), np.float32)
    with pytest.raises(ValueError, match="k of shape"):
        delta_step(state, heads, keys, np.ones((2, 2, 7), np.float32), values, heads, out, y, False)
    with pytest.raises(ValueError, match="beta of shape"):
        delta_step(state, heads, keys, keys, values, np.ones((2, 3), np.float32), out, y, False)
    with pytest.raises(ValueError, match="3 key heads for 4 value heads"):
        delta_step(state, heads, np.ones((2, 3, 8), np.float32), keys, values, heads, out, y, False)
    assert (out == 7.0).all() and (y == 7.0).all()
