"""A cache's rows, whatever its storage: numpy arrays or torch tensors, read and written exactly.

Tests compare rows on the host in the cache's numpy dtype (bf16: ``ml_dtypes.bfloat16``, the same
bits torch holds), and write values into rows with numpy's casting, so a test compares and writes
the same numbers on every storage.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from recurrent_cache.formats.dtypes import STATE_TYPES, StateType


def is_host(rows: Any) -> bool:
    """Whether ``rows`` is a numpy array (numpy storage) rather than a tensor of another storage."""
    return isinstance(rows, np.ndarray)


@functools.cache
def _torch_storage() -> Any:
    from recurrent_cache.storage import TorchStorage   # torch only when a test hands over a tensor
    return TorchStorage("cpu")


def state_type(rows: Any) -> StateType:
    """The state type ``rows`` hold."""
    if is_host(rows):
        return next(t for t in STATE_TYPES.values() if t.numpy == rows.dtype)
    storage = _torch_storage()
    return next(t for t in STATE_TYPES.values() if storage.torch_dtype(t) == rows.dtype)


def dtype(rows: Any) -> np.dtype[Any]:
    """The numpy dtype of ``rows`` on the host (the cache's numpy dtype for its state type)."""
    return rows.dtype if is_host(rows) else state_type(rows).numpy


def host(rows: Any) -> np.ndarray:
    """An exact copy of ``rows`` in host memory, in the cache's numpy dtype (never a view)."""
    if is_host(rows):
        return np.array(rows, copy=True)
    return _torch_storage().to_host(rows)


def assign(rows: Any, values: Any) -> None:
    """``rows[...] = values`` on any storage, ``values`` cast (and broadcast) as numpy casts them."""
    if is_host(rows):
        rows[...] = values
        return
    cast = np.array(np.broadcast_to(np.asarray(values).astype(dtype(rows)), tuple(rows.shape)))
    rows.copy_(_torch_storage().from_host(cast, state_type(rows)).to(rows.device))
