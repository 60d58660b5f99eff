"""The ggml types a state tensor can have: the ground floor of the formats.

``STATE_TYPES`` (by name: a cache's ``dtype_r`` / ``dtype_s``) and ``GGML_TYPES`` (by ggml
type id: a blob's tensor headers) are one table.  This module imports nothing from the
package, so the storage layer can take the table without pulling in the byte formats.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["StateType", "STATE_TYPES", "GGML_TYPES"]


@functools.cache
def _bf16_storage() -> np.dtype:
    """bfloat16 as a real numpy dtype when ml_dtypes is installed, else its raw bits (uint16):
    the upper half of the float32 bit pattern, exactly llama.cpp's layout.  Imported on first
    use, not with the package: ml_dtypes takes about a second to import, which every process
    (each CLI command) would pay for a type most caches never use."""
    try:
        from ml_dtypes import bfloat16
    except ImportError:  # pragma: no cover - exercised only without the extra
        return np.dtype(np.uint16)
    storage: np.dtype = np.dtype(bfloat16)
    return storage


@dataclass(frozen=True)
class StateType:
    """A type a state tensor can have: its name, ggml type id, element size and numpy forms."""

    name: str            # "f32", "f16", "bf16": a cache's dtype_r / dtype_s
    type_id: int         # ggml's type id, in a blob's tensor headers
    itemsize: int
    float_dtype: np.dtype | None   # numpy's own float type; None for bf16, which numpy lacks
    bits: np.dtype       # the little-endian bits of one element in a blob

    @property
    def numpy(self) -> np.dtype:
        """How a cache stores it (bf16: ml_dtypes.bfloat16, or raw uint16 bits without it)."""
        return self.float_dtype if self.float_dtype is not None else _bf16_storage()


# The one table of the state types (the cache's dtypes, the blob's type ids).
STATE_TYPES = {t.name: t for t in (StateType("f32", 0, 4, np.dtype(np.float32), np.dtype("<f4")),
                                   StateType("f16", 1, 2, np.dtype(np.float16), np.dtype("<f2")),
                                   StateType("bf16", 30, 2, None, np.dtype("<u2")))}
GGML_TYPES = {t.type_id: t for t in STATE_TYPES.values()}
