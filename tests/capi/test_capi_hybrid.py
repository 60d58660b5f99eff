"""The C API on a HybridCache (API version 3): a C decode loop writing K / V rows by cell index and r / s
rows by row gives the Python path's cells, masks and rows; staleness across the two APIs; NULL and bad
arguments give codes (never a crash) and change nothing; which caches a context refuses."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import errors
from recurrent_cache.storage import TorchStorage

from capi_hybrid import MASK_FULL, MASK_SLIDING, T, CHybrid, python_decode, same_decode, small_hybrid, state_bytes
from capi_table import P, Ubatch, i32, i32p, ints, message, size_t
from hybrid_model import same, snapshot

pytest.importorskip("recurrent_cache._capi")


@pytest.fixture
def twins():
    in_c = CHybrid(small_hybrid(n_rollback=2))
    yield in_c, small_hybrid(n_rollback=2)
    in_c.close()


def test_the_version_and_the_attention_layers():
    in_c = CHybrid(small_hybrid(attn_layers=[0, 2], kv_size=12))
    try:
        assert rc._capi.API_VERSION == T.api_version == 3   # noqa: SLF001 (the versions are the module's)
        assert T.n_attn(in_c.ctx) == 2
        assert [T.attn_layer(in_c.ctx, j) for j in range(2)] == [0, 2]
        assert (T.kv_size(in_c.ctx), T.kv_used(in_c.ctx), T.size(in_c.ctx)) == (12, 0, 4)
        k_rows, v_trans = in_c.kv_rows(1, 0)
        assert np.shares_memory(k_rows, in_c.cache.k[2]) and k_rows.shape == (12, 2) and not v_trans
        v_rows, v_trans = in_c.kv_rows(1, 1)
        assert np.shares_memory(v_rows, in_c.cache.v[2]) and v_rows.shape == (3, 12) and v_trans
    finally:
        in_c.close()
    rows = CHybrid(small_hybrid(v_trans=False))
    try:
        v_rows, v_trans = rows.kv_rows(0, 1)
        assert v_rows.shape == (16, 3) and not v_trans and np.shares_memory(v_rows, rows.cache.v[0])
    finally:
        rows.close()


def test_a_c_decode_loop_matches_the_python_path(twins):
    """Prompts of three sequences in ubatches of 2, a fork, decode steps, a rollback and a shift:
    after each, the same reports (cells, n_kv, both masks), cells and K / V / r / s rows."""
    in_c, python = twins

    def decode(tokens, seq_ids, pos, n_ubatch=2):
        got = in_c.decode(tokens, seq_ids, pos, n_ubatch)
        assert same_decode(got, python_decode(python, tokens, seq_ids, pos, n_ubatch))
        assert same(snapshot(in_c.cache), snapshot(python))
        return got

    reports = decode([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 2, 2], [0, 1, 2, 0, 1, 0, 1])
    assert len(reports) > 1 and any(np.isinf(mask).any() for mask in reports[0][3])
    assert T.seq_cp_range(in_c.ctx, 0, 3, -1, -1) == 0
    python.seq_cp(0, 3)
    for step in range(3):
        decode([20 + step, 30 + step, 40 + step], [0, 1, 3], [3 + step, 2 + step, 3 + step], n_ubatch=4)
    decode([50, 51, 52], [2, 2, 2], [2, 3, 4], n_ubatch=4)   # several tokens: the step rows are kept
    assert T.seq_rm(in_c.ctx, 2, 3, -1) == 1 and python.seq_rm(2, 3, -1)   # a rollback to after position 2
    assert T.seq_add(in_c.ctx, 1, 0, -1, 4) == 0
    python.seq_add(1, 0, -1, 4)
    assert same(snapshot(in_c.cache), snapshot(python))
    assert in_c.cache.state_write() == python.state_write()
    shifts = i32p()
    assert T.kv_shifts(in_c.ctx, ctypes.byref(shifts)) == 0 and T.kv_has_shift(in_c.ctx) == 1
    assert [shifts[i] for i in range(16)] == python.kv_shifts().tolist()
    assert T.kv_reset_shift(in_c.ctx) == 0 and T.kv_has_shift(in_c.ctx) == 0
    python.kv_reset_shift()
    decode([60, 61], [1, 2], [6, 3], n_ubatch=1)
    assert T.clear(in_c.ctx) == 0
    python.clear()
    assert same(snapshot(in_c.cache), snapshot(python)) and T.kv_used(in_c.ctx) == 0


def test_the_sliding_mask_applies_the_window():
    in_c = CHybrid(small_hybrid(n_swa=2, swa_type="standard"))
    try:
        (order, cells, n_kv, (full, sliding)), = in_c.decode([1, 2, 3, 4], [0, 0, 0, 0], [0, 1, 2, 3], 8)
        assert np.isinf(sliding).sum() > np.isinf(full).sum()
        python = small_hybrid(n_swa=2, swa_type="standard")
        assert same_decode([(order, cells, n_kv, [full, sliding])], python_decode(python, [1, 2, 3, 4], [0] * 4,
                                                                                   [0, 1, 2, 3], 8))
    finally:
        in_c.close()


def test_a_batch_made_stale_by_a_python_call_is_refused_and_changes_nothing(twins):
    in_c, _ = twins
    in_c.decode([1, 2], [0, 1], [0, 0], 4)
    batch, ub = P(), Ubatch()
    assert T.batch_init(in_c.ctx, 2, ints([0, 1]), None, ints([1, 1]), None, 4, 0, ctypes.byref(batch)) == 0
    in_c.cache.seq_rm(1, -1, -1)                        # through Python
    before = snapshot(in_c.cache)
    assert T.batch_apply(batch, ctypes.byref(ub)) == errors.CAPI_STALE
    assert "changed since the batch was prepared" in in_c.message(errors.CAPI_STALE)
    assert same(snapshot(in_c.cache), before)
    T.batch_release(batch)
    assert T.batch_init(in_c.ctx, 1, ints([0]), None, ints([1]), None, 4, 0, ctypes.byref(batch)) == 0
    assert T.batch_apply(batch, ctypes.byref(ub)) == 1
    cells, n_kv, out = i32p(), i32(), (ctypes.c_float * 64)()
    in_c.cache.seq_keep(0)                              # through Python, after the apply
    assert T.batch_kv_cells(batch, ctypes.byref(cells), ctypes.byref(n_kv)) == errors.CAPI_STALE
    assert T.batch_kv_mask(batch, MASK_FULL, out, 64) == errors.CAPI_STALE
    T.batch_release(batch)


def test_a_python_state_made_stale_by_a_c_call_is_refused_and_changes_nothing(twins):
    """HybridState.apply places the KV half first: a change made through C (which the hybrid's own
    counter does not see) must refuse it before either half changes."""
    in_c, _ = twins
    cache = in_c.cache
    in_c.decode([1, 2], [0, 1], [0, 0], 4)
    st = cache.init_batch(rc.Batch(token=[3], seq_id=[0], pos=[1]))
    assert T.seq_rm(in_c.ctx, 1, -1, -1) == 1           # through C
    before = snapshot(cache)
    with pytest.raises(rc.UsageError, match="changed after this state was prepared"):
        st.apply()
    assert same(snapshot(cache), before)
    st = cache.init_batch(rc.Batch(token=[3], seq_id=[0], pos=[1]))
    st.apply()
    assert T.seq_keep(in_c.ctx, 0) == 0                 # through C, after the apply
    for read in (lambda: st.kv_cells, lambda: st.k(0), lambda: st.kv_mask()):
        with pytest.raises(rc.UsageError, match="changed after this ubatch was applied"):
            read()


def test_null_and_bad_arguments_give_codes_and_change_nothing(twins):
    in_c, _ = twins
    in_c.decode([1, 2, 3], [0, 0, 1], [0, 1, 0], 4)
    ctx, before = in_c.ctx, snapshot(in_c.cache)
    data, rows, n, flag, cells, n_kv = P(), i32(), size_t(), ctypes.c_int(), i32p(), i32()
    out_args = (ctypes.byref(data), ctypes.byref(rows), ctypes.byref(n), ctypes.byref(flag))
    for call in (lambda: T.n_attn(None), lambda: T.attn_layer(None, 0), lambda: T.kv_size(None),
                 lambda: T.kv_used(None), lambda: T.kv_tensor(None, 0, 0, None, None, None, None),
                 lambda: T.batch_kv_cells(None, None, None), lambda: T.batch_kv_mask(None, 0, None, 0),
                 lambda: T.seq_cp_range(None, 0, 1, -1, -1), lambda: T.kv_has_shift(None),
                 lambda: T.kv_shifts(None, None), lambda: T.kv_reset_shift(None),
                 lambda: T.kv_tensor(ctx, 0, 0, None, ctypes.byref(rows), ctypes.byref(n), ctypes.byref(flag)),
                 lambda: T.kv_shifts(ctx, None), lambda: T.state_size(ctx, -1, None)):
        assert call() == errors.CAPI_NULL
    cases = [
        (lambda: T.attn_layer(ctx, 2), errors.CAPI_TENSOR_INDEX,
         "rc_attn_layer: tensor index 2 is out of range [0, 2)"),
        (lambda: T.kv_tensor(ctx, -1, 0, *out_args), errors.CAPI_TENSOR_INDEX,
         "rc_kv_tensor: tensor index -1 is out of range [0, 2)"),
        (lambda: T.kv_tensor(ctx, 0, 2, *out_args), errors.ARGUMENT, "rc_kv_tensor: argument out of its domain"),
        (lambda: T.seq_keep(ctx, 4), errors.SEQ_RANGE, "seq_keep: seq_id 4: seq_id 4 is out of range [0, 4)"),
        (lambda: T.seq_cp(ctx, 0, 1), errors.CAPI_SEQ_HOLDS,
         "seq_cp: sequence 1 holds positions: remove it first (seq_rm(1))"),
        (lambda: T.seq_cp_range(ctx, 0, 2, 1, -1), errors.CAPI_CP_RANGE,
         "seq_cp: [1, -1) does not cover sequence 0's positions 0 .. 1: a hybrid sequence is copied whole"),
        (lambda: T.seq_div(ctx, 0, 0, -1, 0), errors.CAPI_KV, "seq_div: d must be >= 1, got 0"),
        (lambda: T.seq_add(ctx, 0, 0, 1, 5), errors.CAPI_MOVE_RANGE,
         "seq_add: [0, 1) of sequence 0 would leave sequence 0's KV cells ending at position 5 but its recurrent "
         "state at 1: a hybrid sequence's KV cells and recurrent state end at one position"),
    ]
    for call, code, text in cases:
        assert call() == code
        assert in_c.message(code) == text
        assert same(snapshot(in_c.cache), before)
    for python_call in (lambda: in_c.cache.seq_keep(4), lambda: in_c.cache.seq_cp(0, 1),
                        lambda: in_c.cache.seq_cp(0, 2, 1, -1), lambda: in_c.cache.seq_div(0, 0, -1, 0),
                        lambda: in_c.cache.seq_add(0, 0, 1, 5)):
        with pytest.raises(errors.RecurrentCacheError) as raised:
            python_call()
        assert str(raised.value) in [text for _, _, text in cases]
    target = ctypes.create_string_buffer(8)
    assert T.state_write(ctx, -1, target, 8, ctypes.byref(n)) == errors.CAPI_TARGET_SIZE and n.value == 0
    k_rows, _ = in_c.kv_rows(0, 0)
    assert T.state_write(ctx, -1, ctypes.c_void_p(k_rows.ctypes.data), 1 << 20, ctypes.byref(n)) == \
        errors.CAPI_OVERLAP
    assert T.state_read(ctx, -1, b"\x00" * 3, 3) == errors.CAPI_PYTHON
    assert "state blob truncated" in in_c.message(errors.CAPI_PYTHON)
    assert state_bytes(in_c, 9) == "state_write: seq_id must be in [-1, 4), got 9"
    assert same(snapshot(in_c.cache), before)
    batch, ub, out = P(), Ubatch(), (ctypes.c_float * 4)()
    assert T.batch_init(ctx, 2, ints([2, 2]), None, ints([0, 1]), None, 4, 0, ctypes.byref(batch)) == 0
    assert T.batch_kv_cells(batch, ctypes.byref(cells), ctypes.byref(n_kv)) == errors.CAPI_NOT_APPLIED
    assert T.batch_apply(batch, ctypes.byref(ub)) == 1
    assert T.batch_kv_cells(batch, None, ctypes.byref(n_kv)) == errors.CAPI_NULL
    assert T.batch_kv_mask(batch, MASK_FULL, out, 4) == errors.CAPI_MASK_SIZE
    assert in_c.message(errors.CAPI_MASK_SIZE) == "rc_batch_kv_mask: the buffer holds 4 floats, the mask needs 16"
    assert T.batch_kv_mask(batch, 7, out, 4) == errors.ARGUMENT
    assert T.batch_kv_mask(batch, MASK_SLIDING, None, 4) == errors.CAPI_NULL
    T.batch_release(batch)


def test_a_batch_that_fits_nowhere_in_the_kv_cache_changes_nothing():
    in_c, python = CHybrid(small_hybrid(kv_size=4)), small_hybrid(kv_size=4)
    try:
        in_c.decode([1, 2, 3], [0, 0, 0], [0, 1, 2], 4)
        before = snapshot(in_c.cache)
        got = in_c.decode([4, 5], [1, 1], [0, 1], 4)
        assert got[0] == errors.CAPI_KV_NO_SLOT
        assert got[1] == "rc_batch_init: the batch's tokens fit nowhere in the KV cache (3 of 4 cells used)"
        assert same(snapshot(in_c.cache), before)
        python_decode(python, [1, 2, 3], [0, 0, 0], [0, 1, 2], 4)
        assert same_decode(got, python_decode(python, [4, 5], [1, 1], [0, 1], 4))
    finally:
        in_c.close()


def test_a_recurrent_context_has_no_kv_half():
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=2)
    ctx = T.ctx_new(cache)
    try:
        assert T.n_attn(ctx) == 0
        for call, what in ((lambda: T.kv_size(ctx), "rc_kv_size"), (lambda: T.kv_used(ctx), "rc_kv_used"),
                           (lambda: T.kv_has_shift(ctx), "rc_kv_has_shift"),
                           (lambda: T.kv_reset_shift(ctx), "rc_kv_reset_shift")):
            assert call() == errors.CAPI_NOT_HYBRID
            assert message(T, ctx, errors.CAPI_NOT_HYBRID) == \
                f"{what}: this context is of a RecurrentCache, which has no KV cache"
        batch, ub, cells, n_kv = P(), Ubatch(), i32p(), i32()
        assert T.batch_init(ctx, 1, ints([0]), None, ints([0]), None, 4, 0, ctypes.byref(batch)) == 0
        assert T.batch_apply(batch, ctypes.byref(ub)) == 1
        assert T.batch_kv_cells(batch, ctypes.byref(cells), ctypes.byref(n_kv)) == errors.CAPI_NOT_HYBRID
        T.batch_release(batch)
        assert T.seq_cp_range(ctx, 0, 1, -1, -1) == 0 and cache.seq_pos_max(1) == 0   # rc_seq_cp's
    finally:
        assert T.ctx_free(ctx) == 0


def test_a_context_needs_the_compiled_engine():
    with pytest.raises(errors.ArgumentError, match="compiled engine"):
        T.ctx_new(small_hybrid(engine="reference"))


@pytest.mark.needs_torch
def test_a_context_needs_host_memory():
    torch = pytest.importorskip("torch", reason="the index path's storage is torch's")
    assert torch
    with pytest.raises(errors.ConfigError, match="host memory"):
        T.ctx_new(small_hybrid(storage=TorchStorage("cpu", host_access=False)))
