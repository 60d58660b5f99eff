"""What the torch forward owns: weights on the device, no autograd, the dtype mapping.

``RecurrentModel.forward`` / ``forward_ubatch`` come here when the state rows
(``st.r(il)``) are torch tensors; this module is imported only then, so the
package imports and runs without torch.  The math is not here: it is the one
the numpy forward runs (``_ssm.py``, each architecture's ``mixer``), on
torch's array-API namespace (``array-api-compat``, installed by the ``torch``
extra), in the model's dtype (float32 or float64) on the rows' device, with
the one rounding policy (``_storage.StateStorage``): a state is read from its
storage dtype, computed in the model's dtype, rounded to the storage dtype
after every token, every conversion to the storage dtype through float32
first, as ggml's; bf16 rounds to nearest even (torch's conversion does).
Logits and states agree with the numpy forward up to the order of
floating-point sums in matrix products (tests/models/test_torch_forward.py measures it).

The weights are converted to torch once per device and kept for as long as
the model lives; on the CPU they share the model's numpy memory.
"""

from __future__ import annotations

import weakref
from typing import Any

import array_api_compat.torch as torch_xp
import numpy as np
import torch

from ..errors import ModelError
from ._arrays import ModelWeights, layer_arrays
from ._storage import StateStorage

__all__ = ["TORCH", "TORCH_XP", "TorchBackend", "TorchNamespace", "TorchStateStorage", "device_weights"]

Tensor = torch.Tensor

_COMPUTE_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class TorchStateStorage(StateStorage):
    """The storage dtype of one torch state tensor (f32, f16, bf16): ``StateStorage``'s rounding on torch."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelError(f"state rows of dtype {dtype}: a torch cache stores float32, float16 or bfloat16")
        super().__init__(dtype, TORCH_XP)


# model -> device -> its weights there: converted once, dropped with the model
_DEVICE_WEIGHTS: weakref.WeakKeyDictionary[Any, dict[torch.device, ModelWeights]] = weakref.WeakKeyDictionary()


def device_weights(model: Any, device: torch.device) -> ModelWeights:
    """``model``'s weights on ``device``, converted on the first call for that device and kept."""
    per_device = _DEVICE_WEIGHTS.setdefault(model, {})
    weights = per_device.get(device)
    if weights is None:
        if device.type == "mps" and model.dtype == np.float64:
            raise ModelError("a float64 model cannot run on mps (Apple GPUs have no float64): "
                             "load it with dtype=np.float32")

        def converted(array: np.ndarray) -> Tensor:
            # on the CPU a writable array is shared, not copied (torch warns about read-only ones)
            tensor = torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
            return tensor.to(device)

        token_embd = converted(model.token_embd)
        weights = per_device[device] = ModelWeights(
            token_embd=token_embd,
            output_norm=converted(model.output_norm),
            output=token_embd if model.tied else converted(model.output),
            layers=[{name: converted(array) for name, array in layer_arrays(layer).items()} for layer in model.layers])
    return weights


class TorchNamespace:
    """array-api-compat's torch namespace, handing out torch's own function where it is the same one for every
    call the math makes (torch takes ``axis`` / ``keepdims`` too): each compat wrapper is one more Python call
    per op, and a decoded token makes some 200 of them."""

    concat = staticmethod(torch.cat)
    mean = staticmethod(torch.mean)
    permute_dims = staticmethod(torch.permute)
    repeat = staticmethod(torch.repeat_interleave)
    vecdot = staticmethod(torch.linalg.vecdot)   # compat's moves axes and broadcasts first (real inputs here)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch_xp, name)


TORCH_XP = TorchNamespace()


class TorchBackend:
    """torch tensors on any device (``_arrays.Backend``)."""

    xp = TORCH_XP

    def device_of(self, rows: Any) -> torch.device:
        """The device of state rows ``rows``; ``ModelError`` when they are no torch tensor."""
        if not isinstance(rows, Tensor):
            raise ModelError(f"state rows of type {type(rows).__name__}: neither numpy arrays nor torch tensors")
        return rows.device

    def weights(self, model: Any, device: torch.device) -> ModelWeights:
        return device_weights(model, device)

    def compute_dtype(self, model: Any) -> torch.dtype:
        return _COMPUTE_DTYPES[model.dtype]

    def storage(self, rows: Tensor) -> StateStorage:
        return TorchStateStorage(rows.dtype)

    def from_host(self, array: np.ndarray, device: torch.device) -> Tensor:
        return torch.from_numpy(array).to(device)

    def computing(self) -> Any:
        return torch.inference_mode()


TORCH = TorchBackend()
