"""The compiled silu and gated norm (models/_scan.pyx ``silu_values`` and ``gated_rms_rows``, numpy's path of
``_ssm.silu`` and ``_ssm.gated_rms_norm``; ``_silu.h``) against the array-API formulas they replace, the same
bits for a value whether a vector or the scalar tail computes it, the extremes, and their refusals."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models._scan import gated_rms_rows, silu_values
from recurrent_cache.models._ssm import gated_rms_norm, silu

# float32's exp is a polynomial within 1.4 ulp of the true exp; silu adds a division's rounding (numpy's own exp
# is within a few ulp too)
TOLERANCE = {np.float32: 4e-7, np.float64: 1e-15}


def formula_silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return v / (1.0 + np.exp(-v))


def formula_gated(y: np.ndarray, z: np.ndarray, weight: np.ndarray, n_group: int, eps: float) -> np.ndarray:
    gated = y * formula_silu(z)
    *lead, width = gated.shape
    grouped = gated.reshape((*lead, n_group, width // n_group))
    normed = grouped / np.sqrt(np.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    return normed.reshape(gated.shape) * weight


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), np.finfo(want.dtype).tiny)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_equals_the_formula_value_by_value(dtype):
    """Every value within the tolerance of its own size, over the range where exp(-v) is a normal float."""
    v = np.concatenate([np.linspace(-87, 87, 200_001), [0.0, -0.0, 1e-30, -1e-30]]).astype(dtype)
    got = silu(np, v)
    assert got.dtype == v.dtype and got.shape == v.shape
    assert relative_error(got, formula_silu(v)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_at_the_extremes(dtype):
    v = np.array([-1e30, -1e4, -100.0, -89.0, 89.0, 100.0, 1e4, 1e30, np.inf], dtype)
    got = silu(np, v)
    want = formula_silu(v)
    assert np.all(np.abs(got[:4] - want[:4]) <= 1e-30) and np.all(np.signbit(got[:4]))   # -0, or as tiny
    np.testing.assert_array_equal(got[4:], want[4:])   # very positive: v itself
    assert np.isnan(silu(np, np.array([np.nan], dtype)))[0]
    assert np.isnan(silu(np, np.array([-np.inf], dtype)))[0] == np.isnan(formula_silu(np.array([-np.inf], dtype)))[0]


def test_a_value_gets_the_same_bits_in_a_vector_or_alone():
    """The kernel vectorizes the loop and computes the tail one by one: every value its own bits either way."""
    v = np.random.default_rng(0).uniform(-20, 20, 1000).astype(np.float32)
    together = silu(np, v)
    alone = np.concatenate([silu(np, v[i:i + 1]) for i in range(v.size)])
    np.testing.assert_array_equal(together, alone)
    shifted = silu(np, v[3:])   # other alignments, other vector / tail splits
    np.testing.assert_array_equal(shifted, together[3:])


def test_silu_keeps_shapes_and_takes_strided_arrays():
    v = np.random.default_rng(1).uniform(-5, 5, (3, 4, 10)).astype(np.float32)
    np.testing.assert_array_equal(silu(np, v[:, :, ::2]), silu(np, np.ascontiguousarray(v[:, :, ::2])))
    assert silu(np, np.zeros((0, 3), np.float32)).shape == (0, 3)
    assert silu(np, np.float32(2.0) * np.ones((), np.float32)).shape == ()
    half = v.astype(np.float16)   # other dtypes take the formula
    np.testing.assert_array_equal(silu(np, half), formula_silu(half))


@pytest.mark.parametrize("n_group", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gated_norm_equals_the_formula(dtype, n_group):
    rng = np.random.default_rng(2)
    y = rng.uniform(-3, 3, (2, 3, 64)).astype(dtype)
    z_wide = rng.uniform(-6, 6, (2, 3, 100)).astype(dtype)
    z = z_wide[..., 10:74]    # the mixers pass a slice of a wider projection
    weight = rng.uniform(0.5, 1.5, 64).astype(dtype)
    got = gated_rms_norm(np, y, z, weight, n_group, 1e-5)
    want = formula_gated(y, z, weight, n_group, 1e-5)
    assert got.dtype == y.dtype and got.shape == y.shape
    assert float(np.abs(got - want).max()) <= 4 * TOLERANCE[dtype] * float(np.abs(want).max())


def test_gated_norm_of_a_row_is_its_own_among_others():
    rng = np.random.default_rng(3)
    y = rng.uniform(-3, 3, (8, 1, 48)).astype(np.float32)
    z = rng.uniform(-3, 3, (8, 1, 48)).astype(np.float32)
    weight = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    together = gated_rms_norm(np, y, z, weight, 2, 1e-5)
    for row in range(8):
        np.testing.assert_array_equal(gated_rms_norm(np, y[row:row + 1], z[row:row + 1], weight, 2, 1e-5),
                                      together[row:row + 1])


@pytest.mark.parametrize("bad", ["z shape", "weight", "groups", "zero groups", "z stride"])
def test_gated_norm_refuses_wrong_shapes_before_anything_is_written(bad):
    y, z, weight = np.ones((2, 8)), np.ones((2, 8)), np.ones(8)
    n_group = 2
    if bad == "z shape":
        z = np.ones((2, 9))
    elif bad == "weight":
        weight = np.ones(9)
    elif bad == "groups":
        n_group = 3
    elif bad == "zero groups":
        n_group = 0
    else:
        z = np.ones((2, 16))[:, ::2]
    out = np.full((2, 8), 7.0)
    with pytest.raises(ValueError):
        gated_rms_rows(y, z, weight, n_group, 1e-5, out)
    np.testing.assert_array_equal(out, 7.0)


def test_silu_values_refuses_a_short_output():
    out = np.full(3, 7.0)
    with pytest.raises(ValueError):
        silu_values(np.ones(4), out)
    np.testing.assert_array_equal(out, 7.0)
