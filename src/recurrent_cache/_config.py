"""Constructor checks and state-tensor allocation shared by both implementations."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ArgumentError, ConfigError, SeqIdError
from .state_format import TYPE_IDS

try:  # bfloat16 as a real numpy dtype when ml_dtypes is installed
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - exercised only without the extra
    _bfloat16 = None


@dataclass(frozen=True)
class DType:
    """A state-tensor element type: its name, numpy storage and ggml type id."""

    name: str
    numpy: np.dtype
    ggml_type: int


DTYPES = {
    "f32": DType("f32", np.dtype(np.float32), TYPE_IDS["f32"]),
    "f16": DType("f16", np.dtype(np.float16), TYPE_IDS["f16"]),
    # Without ml_dtypes a bf16 row is stored as its raw bits (uint16): the
    # upper half of the float32 bit pattern, exactly llama.cpp's layout.
    "bf16": DType("bf16", np.dtype(_bfloat16) if _bfloat16 is not None else np.dtype(np.uint16), TYPE_IDS["bf16"]),
}


def _integer(value: Any, name: str, error: type[Exception]) -> int:
    """``value`` as an int, or ``error`` naming it (a bool is not an integer here)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise error(f"{name} must be an integer, got {value!r}")


def _count(value: Any, name: str, minimum: int) -> int:
    number = _integer(value, name, ConfigError)
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    if number >= 2**31:
        raise ConfigError(f"{name} must be < 2**31, got {number}")
    return number


def _dtype(value: Any, name: str) -> DType:
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ConfigError(f"unknown {name} {value!r} (expected one of {', '.join(DTYPES)})")


@dataclass(frozen=True)
class Config:
    n_layer: int
    n_embd_r: int
    n_embd_s: int
    n_seq_max: int
    size: int
    dtype_r: DType
    dtype_s: DType

    @classmethod
    def check(cls, n_layer: Any, n_embd_r: Any, n_embd_s: Any, n_seq_max: Any = 1,
              size: Any = None, dtype_r: Any = "f32", dtype_s: Any = "f32") -> "Config":
        n_seq = _count(n_seq_max, "n_seq_max", 0)
        return cls(
            n_layer=_count(n_layer, "n_layer", 0),
            n_embd_r=_count(n_embd_r, "n_embd_r", 1),
            n_embd_s=_count(n_embd_s, "n_embd_s", 1),
            n_seq_max=n_seq,
            size=max(1, n_seq) if size is None else _count(size, "size", 1),
            dtype_r=_dtype(dtype_r, "dtype_r"),
            dtype_s=_dtype(dtype_s, "dtype_s"),
        )

    def type_ids(self) -> list[int]:
        """The ggml type id of every state tensor: r[0..n_layer), then s[0..n_layer)."""
        return [self.dtype_r.ggml_type] * self.n_layer + [self.dtype_s.ggml_type] * self.n_layer

    def allocate(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Zeroed per-layer tensors ``r[il]`` (size, n_embd_r) and ``s[il]`` (size, n_embd_s)."""
        r = [np.zeros((self.size, self.n_embd_r), dtype=self.dtype_r.numpy) for _ in range(self.n_layer)]
        s = [np.zeros((self.size, self.n_embd_s), dtype=self.dtype_s.numpy) for _ in range(self.n_layer)]
        return r, s


def as_int(value: Any, name: str) -> int:
    """An int32 method argument (numpy integers too; bools are not integers here)."""
    number = _integer(value, name, ArgumentError)
    if not -2**31 <= number < 2**31:
        raise ArgumentError(f"{name} must fit in int32, got {number}")
    return number


def as_flag(value: Any, name: str) -> bool:
    """A bool argument: a bool, or an integer 0 / 1 (numpy's included)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number in (0, 1):
        return bool(number)
    raise ArgumentError(f"{name} must be True or False, got {value!r}")


def state_seq_id(seq_id: Any, size: int, op: str) -> int:
    """The seq_id of a state call: -1 (the whole cache) or a sequence of the cache."""
    seq_id = as_int(seq_id, "seq_id")
    if not -1 <= seq_id < size:
        raise SeqIdError(f"{op}: seq_id {seq_id} out of range [-1, {size})")
    return seq_id
