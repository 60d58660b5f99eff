"""The one shape of a cache's state: ``Geometry``.

A cache is built from one (``RecurrentCache`` checks its arguments here, raising
``ConfigError``), and every blob, sequence file, snapshot and store key is checked against
one.  It also sizes and allocates a cache's state tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _args
from ..errors import ArgumentError
from .dtypes import GGML_TYPES, STATE_TYPES, StateType
from .layouts import CELL, CELL_COUNT, DATA_HEADER, TENSOR_HEADER

if TYPE_CHECKING:
    from ..storage import Storage

__all__ = ["Geometry"]


def _geometry_fields(error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any,
                     dtype_s: Any, size: Any, layers: Any) -> dict[str, Any]:
    """The fields of a ``Geometry``, checked (``error`` for a bad one) and normalised to int."""
    fields: dict[str, Any] = {
        "n_layer": _args.count(n_layer, "n_layer", 0, error), "n_embd_r": _args.count(n_embd_r, "n_embd_r", 1, error),
        "n_embd_s": _args.count(n_embd_s, "n_embd_s", 0, error)}
    for name, value in (("dtype_r", dtype_r), ("dtype_s", dtype_s)):
        if not isinstance(value, str) or value not in STATE_TYPES:
            raise error(f"unknown {name} {value!r} (expected one of {', '.join(STATE_TYPES)})")
        fields[name] = value
    fields["size"] = _args.count(size, "size", 1, error)
    fields["layers"] = _args.layer_filter(layers, fields["n_layer"], error)
    return fields


@dataclass(frozen=True)
class Geometry:
    """The shape of a cache's state: what a blob or a snapshot must match to be read into it.

    ``n_layer`` layers of one r row (``n_embd_r`` values of ``dtype_r``) and
    one s row per cell; ``dtype_r`` / ``dtype_s`` are names of
    ``STATE_TYPES``.  ``size`` (cells) matters only to a whole-cache blob: a
    snapshot is one sequence's state, which any size holds, so a store key
    (``key_text``) leaves it out.  Bad fields raise ``ArgumentError``.

    ``layers``: the layers that hold recurrent state (a hybrid model's recurrent
    layers, llama.cpp's layer filter), sorted; None (also what a filter naming
    every layer becomes) is every layer.  A blob still records ``n_layer``, the
    model's layer count, but holds the r sections, then the s sections, of these
    layers only.
    """

    n_layer: int
    n_embd_r: int
    n_embd_s: int
    dtype_r: str = "f32"
    dtype_s: str = "f32"
    size: int = 1
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fields = _geometry_fields(ArgumentError, self.n_layer, self.n_embd_r, self.n_embd_s, self.dtype_r,
                                  self.dtype_s, self.size, self.layers)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def checked(cls, error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any = "f32",
                dtype_s: Any = "f32", size: Any = 1, layers: Any = None) -> Geometry:
        """A geometry, raising ``error`` (a constructor's ``ConfigError``) for a bad field."""
        return cls(**_geometry_fields(error, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, size, layers))

    @classmethod
    def of(cls, cache: Any) -> Geometry:
        """The geometry of a ``RecurrentCache`` of either engine, from its public attributes."""
        return cls(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s, cache.size,
                   cache.layers)

    @classmethod
    def of_tensors(cls, size: int, type_ids: Sequence[int], tensors: Sequence[np.ndarray], n_layer: int,
                   layers: Sequence[int]) -> Geometry:
        """The geometry of an engine's state tensors: r of each of ``layers`` (of the model's
        ``n_layer``), then their s, (size, n_embd) arrays of ggml types ``type_ids``.  Without
        tensors no row width or type is recorded anywhere; 1 and f32 are taken (no row of them
        is ever read or written)."""
        n_state = len(tensors) // 2
        if not n_state:
            return cls(n_layer, 1, 1, size=size, layers=tuple(layers))
        return cls(n_layer, tensors[0].shape[1], tensors[n_state].shape[1], GGML_TYPES[type_ids[0]].name,
                   GGML_TYPES[type_ids[n_state]].name, size, tuple(layers))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with state, sorted (every layer unless filtered)."""
        return tuple(range(self.n_layer)) if self.layers is None else self.layers

    @property
    def n_state_layers(self) -> int:
        """How many layers hold state: a blob's r sections (and s sections)."""
        return self.n_layer if self.layers is None else len(self.layers)

    @property
    def type_r(self) -> StateType:
        return STATE_TYPES[self.dtype_r]

    @property
    def type_s(self) -> StateType:
        return STATE_TYPES[self.dtype_s]

    @property
    def row_bytes_r(self) -> int:
        return self.n_embd_r * self.type_r.itemsize

    @property
    def row_bytes_s(self) -> int:
        return self.n_embd_s * self.type_s.itemsize

    @property
    def type_ids(self) -> tuple[int, ...]:
        """The ggml type of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.type_r.type_id,) * n_state + (self.type_s.type_id,) * n_state

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """The row size of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.row_bytes_r,) * n_state + (self.row_bytes_s,) * n_state

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's rows (r and s of every layer with state)."""
        return self.n_state_layers * (self.row_bytes_r + self.row_bytes_s)

    def cache_bytes(self, n_rollback: int) -> int:
        """Bytes of a cache's state tensors of this geometry (``size`` cells) with ``n_rollback``
        past states per cell (their rollback history)."""
        return self.size * (1 + n_rollback) * self.state_bytes

    def allocate(self, storage: Storage) -> tuple[Any, Any]:
        """The zeroed r and s tensors of ``storage``: ``[n_state, size, n_embd_r]`` and
        ``[n_state, size, n_embd_s]`` (row k of axis 0: the k-th layer with state)."""
        n_state = self.n_state_layers
        return (storage.allocate((n_state, self.size, self.n_embd_r), self.type_r),
                storage.allocate((n_state, self.size, self.n_embd_s), self.type_s))

    def sequence_blob_size(self) -> int:
        """Length of a one-cell sequence blob of this geometry."""
        return (CELL_COUNT.size + CELL.size + DATA_HEADER.size + 2 * self.n_state_layers * TENSOR_HEADER.size
                + self.state_bytes)

    def check_rows(self, rows: Sequence[Any], which: str) -> list[np.ndarray]:
        """One sequence's ``which`` ("r" or "s") rows, one per layer with state (in layer order),
        as contiguous arrays; ``ArgumentError`` unless they have exactly this geometry's widths and
        storage dtype."""
        n_embd, dtype = (self.n_embd_r, self.type_r.numpy) if which == "r" else (self.n_embd_s, self.type_s.numpy)
        if len(rows) != self.n_state_layers:
            raise ArgumentError(f"{which}_rows has {len(rows)} rows, the geometry has {self.n_state_layers} "
                                f"layers with state")
        out = []
        for il, row in enumerate(rows):
            array = np.asarray(row)
            if array.shape != (n_embd,) or array.dtype != dtype:
                raise ArgumentError(f"{which}_rows[{il}] has shape {array.shape} and dtype {array.dtype}, "
                                    f"the geometry has ({n_embd},) and {dtype}")
            out.append(np.ascontiguousarray(array))
        return out

    def key_text(self) -> str:
        """What a store key holds of the geometry: every field but ``size``.  A filter is appended
        (``;layers=0,2``, ``;layers=`` for none); an unfiltered geometry's text is as it always was."""
        text = (f"n_layer={self.n_layer};n_embd_r={self.n_embd_r};n_embd_s={self.n_embd_s};"
                f"dtype_r={self.dtype_r};dtype_s={self.dtype_s}")
        if self.layers is not None:
            text += ";layers=" + ",".join(map(str, self.layers))
        return text
