"""Torch state tensors in host memory, computed on by the numpy forward over the same memory.

A cache on torch storage on the CPU keeps its rows in host memory, which numpy can
read and write without a copy (``Tensor.numpy()``).  The one math (``_ssm.py``, the
architectures) runs on either library, but on a CPU numpy's is the faster: one
dispatch per op where torch's costs ~10 µs, OpenBLAS products, and the compiled
kernels take numpy arrays directly.  So ``LanguageModel.forward`` runs the numpy
forward on a ``HostViews`` of such a state and hands the logits back as a torch
tensor: the same rows are written, the result is bit for bit what a numpy cache
gives.  ``forward(st, native=True)`` runs torch's own ops instead (what a GPU runs;
the tests check the torch math that way on machines without one).

Only dense float32 / float16 CPU tensors that carry no autograd state qualify
(numpy has no bfloat16): anything else is computed by torch as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["HostViews", "host_views"]

_NUMPY_DTYPES = ("torch.float32", "torch.float16")   # what caches store that numpy has (not bfloat16)


def _viewable(tensor: Any) -> bool:
    """True for a torch tensor whose memory numpy can use as is: dense, on the CPU, float32 / float16, no grad."""
    return (not isinstance(tensor, np.ndarray) and getattr(tensor, "device", None) is not None
            and tensor.device.type == "cpu" and str(tensor.dtype) in _NUMPY_DTYPES
            and str(tensor.layout) == "torch.strided" and not tensor.requires_grad)


class HostViews:
    """A batch state (``MemoryState`` / ``HybridState``) whose torch CPU state tensors read as numpy arrays over
    the same memory; everything else (the ubatch, KV cells, mask, ...) is the state's own."""

    def __init__(self, st: Any) -> None:
        self._st = st

    def r(self, il: int) -> np.ndarray:
        return np.asarray(self._st.r(il).numpy())

    def s(self, il: int) -> np.ndarray:
        return np.asarray(self._st.s(il).numpy())

    def r_steps(self, il: int) -> np.ndarray:
        return np.asarray(self._st.r_steps(il).numpy())

    def s_steps(self, il: int) -> np.ndarray:
        return np.asarray(self._st.s_steps(il).numpy())

    def k(self, il: int) -> np.ndarray:
        return np.asarray(self._st.k(il).numpy())

    def v(self, il: int) -> np.ndarray:
        return np.asarray(self._st.v(il).numpy())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)

    @staticmethod
    def tensor(array: np.ndarray) -> Any:
        """A result of the numpy forward as a torch tensor (the same memory)."""
        import torch   # only reached with torch tensors, hence torch installed

        return torch.from_numpy(array)


def host_views(st: Any, samples: Sequence[Any]) -> HostViews | None:
    """``st`` seen through numpy when ``samples`` (one state tensor of each kind it holds: r, s, K, V) are
    torch tensors numpy can use in place; None otherwise (numpy rows already, another device, bfloat16)."""
    if not samples or not all(_viewable(tensor) for tensor in samples):
        return None
    return HostViews(st)
