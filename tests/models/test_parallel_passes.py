"""The compiled kernels' threads and the scan's step in place (models/_scan.pyx): a scan step, a delta step or a
copy split between threads gives the bits of one thread; a scan step made in place gives the bits of the step
into a new array, keeps the old state for its undo and says when it is done; refusals write nothing; a forward
whose products go to BLAS runs the kernels in one thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import recurrent_cache as rc
from recurrent_cache.models import _ssm, get_num_threads, random_mamba2_model, set_num_threads
from recurrent_cache.models._scan import copy_bytes, delta_step, one_thread, scan_step
from recurrent_cache.models._ssm import FEW_ROWS

# a pass takes threads from 256 KiB on (smaller ones run in one): this is above it
LARGE_DELTA = (1, 16, 128, 128)         # n, value heads, Dv, Dk: 1 MB


def scan_arrays(rng, dtype, n, channels, d_state, n_head, per_state, n_group):
    state = rng.standard_normal((n, channels, d_state)).astype(dtype)
    decay = rng.uniform(0.5, 1.0, (n, n_head, d_state if per_state else 1)).astype(dtype)
    x = rng.standard_normal((n, channels)).astype(dtype)
    b, c = (rng.standard_normal((n, n_group, d_state)).astype(dtype) for _ in range(2))
    return state, decay, x, b, c


def stepped(state, decay, x, b, c, round_f32):
    """The step into a new array: (new state, y)."""
    out, y = np.empty_like(state), np.empty(state.shape[:2], state.dtype)
    scan_step(state, decay, x, b, c, out, y, round_f32)
    return out, y


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), n_head=st.integers(1, 5), per_head=st.integers(1, 9), d_state=st.integers(1, 40),
       mamba1=st.booleans(), shared_bc=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]),
       round_f32=st.booleans(), n_threads=st.integers(1, 3), seed=st.integers(0, 2**16),
       misaligned=st.booleans())
def test_a_step_in_place_is_the_step_into_a_new_array(n, n_head, per_head, d_state, mamba1, shared_bc, dtype,
                                                      round_f32, n_threads, seed, misaligned):
    """Same new state and y bit for bit; ``saved`` holds the state as it was and ``done`` is 1 — whether the old
    rows go to ``saved`` by streaming stores (whole 16-byte vectors, aligned) or by a copy (an odd d_state, a
    ``saved`` one element off alignment)."""
    before = get_num_threads()
    set_num_threads(n_threads)
    try:
        rng = np.random.default_rng(seed)
        state, decay, x, b, c = scan_arrays(rng, dtype, n, n_head * per_head, d_state, n_head, mamba1,
                                            1 if shared_bc else n_head)
        expected_state, expected_y = stepped(state, decay, x, b, c, round_f32)
        rows, done = state.copy(), np.zeros(1, np.uint8)
        saved = np.empty(state.size + 1, dtype)[1:].reshape(state.shape) if misaligned else np.empty_like(state)
        y = np.empty_like(expected_y)
        scan_step(rows, decay, x, b, c, rows, y, round_f32, saved, done)
        assert np.array_equal(rows, expected_state) and np.array_equal(y, expected_y)
        assert np.array_equal(saved, state) and done[0] == 1
    finally:
        set_num_threads(before)


def test_a_refused_step_in_place_writes_nothing():
    """A ``saved`` of the wrong shape is a ValueError before the state, ``saved`` or ``done`` change."""
    rng = np.random.default_rng(0)
    state, decay, x, b, c = scan_arrays(rng, np.float32, 2, 4, 8, 4, False, 1)
    rows, before = state.copy(), state.copy()
    saved, done, y = np.full((2, 4, 7), 3.0, np.float32), np.zeros(1, np.uint8), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="saved of shape"):
        scan_step(rows, decay, x, b, c, rows, y, False, saved, done)
    assert np.array_equal(rows, before) and (saved == 3.0).all() and done[0] == 0 and not y.any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", ["mamba2-shared-bc", "mamba2-bc-per-head", "mamba1"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_scan_step_in_threads_gives_the_bits_of_one(threads, dtype, shape, in_place):
    """Shares of 2 and 3 threads start mid-head and mid-sequence (the kernel counts sequence, head and channel
    along a share): every row the bits of one thread."""
    n, n_head, per_head, d_state, per_state, n_group = {
        "mamba2-shared-bc": (2, 25, 49, 128, False, 1), "mamba2-bc-per-head": (2, 25, 49, 128, False, 25),
        "mamba1": (8, 2001, 1, 16, True, 1)}[shape]
    rng = np.random.default_rng(1)
    state, decay, x, b, c = scan_arrays(rng, dtype, n, n_head * per_head, d_state, n_head, per_state, n_group)
    assert state.nbytes >= 256 * 1024   # large enough for threads
    results = []
    for n_threads in (1, 2, 3):
        threads(n_threads)
        if in_place:
            rows, saved, y = state.copy(), np.empty_like(state), np.empty(state.shape[:2], dtype)
            scan_step(rows, decay, x, b, c, rows, y, dtype == np.float64, saved, np.zeros(1, np.uint8))
            results.append((rows, y))
        else:
            results.append(stepped(state, decay, x, b, c, dtype == np.float64))
    for new_state, y in results[1:]:
        assert np.array_equal(new_state, results[0][0]) and np.array_equal(y, results[0][1])
    assert np.array_equal(results[0][0], stepped(state, decay, x, b, c, dtype == np.float64)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_delta_step_in_threads_gives_the_bits_of_one(threads, dtype):
    n, n_v, d_v, d_k = LARGE_DELTA
    n_k = n_v // 2
    rng = np.random.default_rng(2)
    state = rng.uniform(-1, 1, (n, n_v, d_v, d_k)).astype(dtype)
    decay, beta = rng.uniform(0.1, 1, (n, n_v)).astype(dtype), rng.uniform(0.05, 0.95, (n, n_v)).astype(dtype)
    q, k = ((rng.standard_normal((n, n_k, d_k)) / np.sqrt(d_k)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((n, n_v, d_v)).astype(dtype)
    results = []
    for n_threads in (1, 2, 3):
        threads(n_threads)
        out, y = np.empty_like(state), np.empty((n, n_v, d_v), dtype)
        delta_step(state, decay, q, k, v, beta, out, y, dtype == np.float64)
        results.append((out, y))
    for out, y in results[1:]:
        assert np.array_equal(out, results[0][0]) and np.array_equal(y, results[0][1])


@pytest.mark.parametrize("size", [0, 1, 63, 65, 256 * 1024 - 1, 256 * 1024 + 3, 3 * 1024 * 1024 + 5])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_copy_bytes_copies_every_byte(threads, size, n_threads):
    """Every byte, in shares split at cache lines whatever the size (and none beyond the end)."""
    threads(n_threads)
    source = np.random.default_rng(size).integers(0, 256, size + 8, dtype=np.uint8)
    target = np.zeros(size + 8, np.uint8)
    copy_bytes(source[:size], target[:size])
    assert np.array_equal(target[:size], source[:size]) and not target[size:].any()


def test_copy_bytes_refuses_another_length():
    target = np.zeros(10, np.uint8)
    with pytest.raises(ValueError, match="11 bytes into 10"):
        copy_bytes(np.ones(11, np.uint8), target)
    assert not target.any()


def test_one_thread_holds_in_its_block_and_its_python_thread_only(threads):
    threads(2)
    seen_elsewhere = []
    with one_thread():
        assert get_num_threads() == 1
        with one_thread():
            assert get_num_threads() == 1
        assert get_num_threads() == 1
        other = threading.Thread(target=lambda: seen_elsewhere.append(get_num_threads()))
        other.start()
        other.join()
    assert seen_elsewhere == [2] and get_num_threads() == 2
    with pytest.raises(KeyError), one_thread():
        raise KeyError("an exception leaves the block as it came")
    assert get_num_threads() == 2


@pytest.mark.parametrize("n_seqs, expected", [(FEW_ROWS, 2), (FEW_ROWS + 1, 1)])
def test_a_forward_whose_products_go_to_blas_runs_the_kernels_in_one_thread(threads, monkeypatch, n_seqs, expected):
    """Up to FEW_ROWS rows the products are the kernel's and its threads run every pass; past it BLAS multiplies
    with threads of its own, and the scan's step (here large enough for threads) runs in one."""
    threads(2)
    model = random_mamba2_model(0, n_embd=256, n_layer=2, d_state=128, head_dim=64, dtype=np.float32)
    cache = model.new_cache(n_seq_max=n_seqs)
    seen = []
    original = _ssm.scan_step

    def recording(*args, **kwargs):
        seen.append(get_num_threads())
        return original(*args, **kwargs)
    monkeypatch.setattr(_ssm, "scan_step", recording)
    st = cache.init_batch(rc.Batch(token=[1] * n_seqs, pos=[0] * n_seqs, seq_id=list(range(n_seqs)),
                                   logits=[1] * n_seqs), n_seqs)
    model.forward(st)
    assert seen == [expected] * 2 and get_num_threads() == 2
