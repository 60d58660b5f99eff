"""The arrays a model computes on: numpy's, or another library's through the array API standard.

The architectures' math (``_ssm.py``, ``mamba.py``, ``mamba2.py``) is written
once against an array namespace ``xp``: numpy (≥ 2) serves the standard
itself; torch serves it through ``array-api-compat`` (the ``torch`` extra),
which ``torch_forward.py`` brings in.  A ``Backend`` holds what differs
between the two and is not math: where the weights live, the compute dtype,
moving host arrays in, and the context a forward runs in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ._storage import StateStorage

__all__ = ["NUMPY", "Array", "Backend", "ModelWeights", "NumpyBackend", "layer_arrays"]

# A numpy array or a tensor of an array-API library (torch); the math uses only what the standard names.
Array = Any


@dataclass(frozen=True)
class ModelWeights:
    """A model's weights as one backend's arrays: the head, and each layer's by field name."""

    token_embd: Array
    output_norm: Array
    output: Array
    layers: list[dict[str, Array]]


def layer_arrays(layer: Any) -> dict[str, np.ndarray]:
    """A layer's weights by field name: a recurrent model's layer is a dataclass, a hybrid model's a dict."""
    return dict(layer) if isinstance(layer, dict) else dict(vars(layer))


class Backend(Protocol):
    """What a forward needs of an array library besides its namespace ``xp``."""

    @property
    def xp(self) -> Any:
        """The library's array-API namespace."""

    def weights(self, model: Any, device: Any) -> ModelWeights:
        """``model``'s weights on ``device`` (kept from call to call where converting them costs)."""

    def compute_dtype(self, model: Any) -> Any:
        """The dtype of ``model.dtype`` in this library."""

    def storage(self, rows: Array) -> StateStorage:
        """The storage of state rows ``rows`` (refused when no cache stores that dtype)."""

    def from_host(self, array: np.ndarray, device: Any) -> Array:
        """A host array on ``device``."""

    def computing(self) -> Any:
        """The context a forward runs in."""


class NumpyBackend:
    """numpy arrays in host memory: the weights are the model's own."""

    xp = np

    def weights(self, model: Any, device: Any = None) -> ModelWeights:
        return ModelWeights(model.token_embd, model.output_norm, model.output,
                            [layer_arrays(layer) for layer in model.layers])

    def compute_dtype(self, model: Any) -> Any:
        return model.dtype

    def storage(self, rows: Array) -> StateStorage:
        return StateStorage(rows.dtype)

    def from_host(self, array: np.ndarray, device: Any = None) -> Array:
        return array

    @contextmanager
    def computing(self) -> Iterator[None]:
        # silu's exp(-v) overflows to inf for very negative v (silu -> -0): expected, not worth a warning
        with np.errstate(over="ignore"):
            yield


NUMPY = NumpyBackend()
