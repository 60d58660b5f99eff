"""The C API's own status for a tensor of a layer the cache's layer filter excludes.

Every tensor index of a filtered cache is classified three ways and checked
against the Python API's view of the same cache: a tensor with state (RC_OK,
the numpy array's memory), a tensor of a layer without state
(RC_ERR_FILTERED_LAYER, naming the layer), an index outside the model's
tensors (RC_ERR_TENSOR_INDEX, as before).
"""

from __future__ import annotations

import ctypes

import pytest

import recurrent_cache as rc
from recurrent_cache import errors

pytest.importorskip("recurrent_cache._capi")
from capi_table import P, Ubatch, header_codes, ints, message, size_t, table  # noqa: E402

T = table()


def test_the_header_names_the_code_errors_maps():
    assert header_codes()["RC_ERR_FILTERED_LAYER"] == errors.CAPI_FILTERED_LAYER
    assert errors.CAPI_FILTERED_LAYER != errors.CAPI_TENSOR_INDEX
    assert isinstance(errors.engine_error(errors.CAPI_FILTERED_LAYER, what="rc_tensor", index=3, n=1),
                      errors.OutOfRangeError)


@pytest.mark.parametrize("n_layer, layers", [(5, (0, 2, 3)), (4, ()), (3, (2,))])
def test_rc_tensor_tells_a_filtered_layer_from_an_index_out_of_range(n_layer, layers):
    cache = rc.RecurrentCache(n_layer, 3, 5, n_seq_max=2, layers=layers, engine="compiled")
    ctx = T.ctx_new(cache)
    try:
        data, row_bytes = P(), size_t()
        arrays = cache.r + cache.s
        for index in range(-2, 2 * n_layer + 2):
            code = T.tensor(ctx, index, ctypes.byref(data), ctypes.byref(row_bytes))
            if not 0 <= index < 2 * n_layer:
                assert code == errors.CAPI_TENSOR_INDEX
                assert message(T, ctx, code) == (f"rc_tensor: tensor index {index} is out of range "
                                                 f"[0, {2 * n_layer})")
            elif arrays[index] is None:
                layer = index % n_layer
                assert layer not in layers
                assert code == errors.CAPI_FILTERED_LAYER
                assert message(T, ctx, code) == (f"rc_tensor: tensor index {index} is of layer {layer}, which "
                                                 f"holds no recurrent state (the cache's layer filter excludes it)")
            else:
                assert code == errors.OK
                assert (data.value, row_bytes.value) == (arrays[index].ctypes.data, arrays[index].strides[0])
    finally:
        assert T.ctx_free(ctx) == 0


def test_step_rows_of_a_filtered_layer_have_the_same_code():
    n_layer, layers = 4, (1, 3)
    cache = rc.RecurrentCache(n_layer, 3, 5, n_seq_max=2, n_rollback=2, layers=layers, engine="compiled")
    ctx = T.ctx_new(cache)
    batch = P()
    try:
        assert T.batch_init(ctx, 3, ints([0, 0, 0]), None, ints([0, 1, 2]), None, 512, 0, ctypes.byref(batch)) == 0
        ubatch = Ubatch()
        assert T.batch_apply(batch, ctypes.byref(ubatch)) == 1
        row = P()
        for tensor in range(2 * n_layer):
            code = T.batch_step_row(batch, tensor, 0, 0, ctypes.byref(row))
            expected = errors.OK if tensor % n_layer in layers else errors.CAPI_FILTERED_LAYER
            assert code == expected, tensor
        assert T.batch_step_row(batch, 2 * n_layer, 0, 0, ctypes.byref(row)) == errors.CAPI_TENSOR_INDEX
        assert T.batch_step_row(batch, n_layer + 2, 0, 0, ctypes.byref(row)) == errors.CAPI_FILTERED_LAYER
        assert message(T, ctx, errors.CAPI_FILTERED_LAYER).startswith(
            f"rc_batch_step_row: tensor index {n_layer + 2} is of layer 2,")
        T.batch_release(batch)
    finally:
        assert T.ctx_free(ctx) == 0
