"""The state tensors are raw memory a C pipeline can hold on to: C-contiguous, never moved."""

import numpy as np
import pytest

import recurrent_cache as rc


def addresses(cache):
    return [a.__array_interface__["data"][0] for a in cache.r + cache.s]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_tensors_never_move(dtype):
    cache = rc.RecurrentCache(2, 3, 5, n_seq_max=4, dtype_r=dtype, dtype_s=dtype)
    before = addresses(cache)
    assert all(a.flags.c_contiguous and a.flags.writeable for a in cache.r + cache.s)
    for _ub in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 1, 1], pos=[0, 0, 1])):
        pass
    blob = cache.state_write()
    cache.clear()
    cache.state_read(blob)
    cache.seq_keep(1)
    assert addresses(cache) == before


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dlpack_shares_memory(dtype):
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=2, dtype_r=dtype, dtype_s=dtype)
    view = np.from_dlpack(cache.s[0])
    view[1, 2] = 7
    assert cache.s[0][1, 2] == 7


def test_bf16_goes_through_dlpack_as_its_raw_bits():
    # DLPack has no bfloat16 for numpy's custom dtypes: export the uint16 bits
    # (torch: torch.from_dlpack(cache.r[0].view(np.uint16)).view(torch.bfloat16)).
    cache = rc.RecurrentCache(1, 3, 5, n_seq_max=2, dtype_r="bf16")
    bits = np.from_dlpack(cache.r[0].view(np.uint16))
    bits[0, 0] = 0x3F80  # 1.0 in bfloat16
    assert float(cache.r[0][0, 0]) == 1.0 or cache.r[0][0, 0] == 0x3F80
