"""The compiled RMS norm rows (models/_scan.pyx ``rms_rows``, numpy's path of ``_ssm.rms_norm``) against the
array-API formula it replaces, on every shape the models hand it, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models._scan import rms_rows
from recurrent_cache.models._ssm import rms_norm

TOLERANCE = {np.float32: 5e-7, np.float64: 1e-15}


def formula(v: np.ndarray, eps: float) -> np.ndarray:
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("shape", [(7,), (3, 768), (2, 3, 4, 16), (1, 1, 48)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_equals_the_formula(dtype, shape):
    v = np.random.default_rng(1).uniform(-3, 3, shape).astype(dtype)
    got = rms_norm(np, v, 1e-5)
    want = formula(v, 1e-5)
    assert got.dtype == v.dtype and got.shape == v.shape
    assert float(np.abs(got - want).max()) <= TOLERANCE[dtype] * float(np.abs(want).max())


def test_a_strided_slice_is_normed_as_its_values():
    wide = np.random.default_rng(2).uniform(-3, 3, (4, 80)).astype(np.float32)
    part = wide[:, 8:24]      # the mixers norm slices of a projection (Falcon-Mamba's dt, B, C)
    np.testing.assert_array_equal(rms_norm(np, part, 1e-6), rms_norm(np, part.copy(), 1e-6))


def test_other_dtypes_and_empty_rows_take_the_formula():
    v = np.random.default_rng(3).uniform(-3, 3, (2, 5)).astype(np.float16)
    np.testing.assert_array_equal(rms_norm(np, v, 1e-3), formula(v, 1e-3))
    assert rms_norm(np, np.zeros((0, 5)), 1e-5).shape == (0, 5)


def test_wrong_shapes_are_refused_before_anything_is_written():
    out = np.full((2, 4), 7.0)
    with pytest.raises(ValueError):
        rms_rows(np.ones((2, 5)), 1e-5, out)
    with pytest.raises(ValueError):
        rms_rows(np.ones((2, 0)), 1e-5, np.ones((2, 0)))
    np.testing.assert_array_equal(out, 7.0)
