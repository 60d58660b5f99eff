"""How a state tensor stores numbers, and the rounding that implies.

A model computes in float32 or float64 but the cache keeps its states in f32,
f16 or bf16.  ``StateStorage`` converts between the two, for numpy arrays and
(``torch_forward.TorchStateStorage``) torch tensors alike.  Every conversion to
the storage type goes through float32 first, as ggml does (its compute type
is f32), and bf16 rounds to nearest even, like ``ggml_compute_fp32_to_bf16``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..formats.dtypes import STATE_TYPES

__all__ = ["StateStorage", "astype"]

# Without ml_dtypes the cache stores a bf16 row as its raw bits in uint16.
_RAW_BF16 = np.dtype(np.uint16)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(is_nan, (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)


def astype(xp: Any, array: Any, dtype: Any, copy: bool = True) -> Any:
    """``array`` as ``dtype`` (numpy 2.0's namespace has no ``astype`` function: the method serves)."""
    if not copy and array.dtype == dtype:   # a state read or written in its own dtype: no library call at all
        return array
    if xp is np:
        return array.astype(dtype, copy=copy)
    return xp.astype(array, dtype, copy=copy)


class StateStorage:
    """The storage dtype of one state tensor (``cache.r[il].dtype``), for arrays of namespace ``xp``.

    The one rounding policy of every backend: a value goes to the storage dtype
    through float32 (ggml's compute type), bf16 rounding to nearest even.
    """

    def __init__(self, dtype: Any, xp: Any = np) -> None:
        self.xp = xp
        if xp is np:
            dtype = np.dtype(dtype)
            if dtype not in {t.numpy for t in STATE_TYPES.values()} | {_RAW_BF16}:
                raise TypeError(f"no state storage for dtype {dtype}")
        self.dtype = dtype
        self.raw_bf16 = xp is np and dtype == _RAW_BF16

    @classmethod
    def named(cls, name: str) -> "StateStorage":
        """The storage a cache built with ``dtype_r=name`` uses ("f32", "f16", "bf16")."""
        if name not in STATE_TYPES:
            raise ValueError(f"unknown state dtype {name!r} (expected one of {', '.join(STATE_TYPES)})")
        return cls(STATE_TYPES[name].numpy)

    def encode(self, values: Any) -> Any:
        """``values`` as this storage holds them: an array of the storage dtype (``values`` itself when it has
        that dtype: a state is written to its rows right after, so a copy here would only be a second one)."""
        as_f32 = astype(self.xp, values, self.xp.float32, copy=False)
        if self.raw_bf16:
            return _bf16_bits(as_f32)
        return astype(self.xp, as_f32, self.dtype, copy=False)

    def decode(self, stored: Any, dtype: Any) -> Any:
        """Stored values as floats of ``dtype`` (``stored`` itself when it has that dtype: never written to)."""
        if self.raw_bf16:
            return (stored.astype(np.uint32) << 16).view(np.float32).astype(dtype)
        return astype(self.xp, stored, dtype, copy=False)

    def round(self, values: Any) -> Any:
        """``values`` as they would read back after a store (the input itself when lossless)."""
        if values.dtype == self.dtype:
            return values
        return self.decode(self.encode(values), values.dtype)
