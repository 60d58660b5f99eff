"""The forward pass of the package's models in torch, where a cache with torch storage keeps its states.

``RecurrentModel.forward`` / ``forward_ubatch`` come here when the state rows
(``st.r(il)``) are torch tensors; this module is imported only then, so the
package imports and runs without torch.  The math is the numpy forward's
(``recurrent.py``, ``mamba.py``, ``mamba2.py``), formula for formula, in the
model's dtype (float32 or float64) on the rows' device, with the numpy
forward's rounding (``_storage.py``): a state is read from its storage dtype,
computed in the model's dtype, rounded to the storage dtype after every token,
and every conversion to the storage dtype goes through float32 first, as
ggml's does; bf16 rounds to nearest even (torch's conversion does).  Logits
and states agree with the numpy forward up to the order of floating-point
sums in matrix products (tests/test_torch_forward.py measures it).

The weights are converted to torch once per device and kept for as long as
the model lives; on the CPU they share the model's numpy memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from ..errors import ModelError
from .mamba import MambaModel
from .mamba2 import Mamba2Model
from .recurrent import RecurrentModel

__all__ = ["DeviceWeights", "TorchStateStorage", "concatenated", "device_weights", "forward_ubatch"]

Tensor = torch.Tensor
Weights = dict[str, Tensor]   # one layer's weights by ``MambaLayer`` / ``Mamba2Layer`` field name

_COMPUTE_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class TorchStateStorage:
    """The storage dtype of one state tensor in torch (f32, f16, bf16): ``StateStorage``'s rounding."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ModelError(f"state rows of dtype {dtype}: a torch cache stores float32, float16 or bfloat16")
        self.dtype = dtype

    def encode(self, values: Tensor) -> Tensor:
        """``values`` as this storage holds them, through float32 as ggml converts."""
        return values.to(torch.float32).to(self.dtype)

    def decode(self, stored: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored values as floats of ``dtype`` (the tensor itself when it has that dtype: never written to)."""
        return stored.to(dtype)

    def round(self, values: Tensor) -> Tensor:
        """``values`` as they would read back after a store (the input itself when lossless)."""
        if values.dtype == self.dtype:
            return values
        return self.decode(self.encode(values), values.dtype)


@dataclass(frozen=True)
class DeviceWeights:
    """A model's weights as torch tensors of its dtype on one device."""

    token_embd: Tensor
    output_norm: Tensor
    output: Tensor
    layers: list[Weights]


# model -> device -> its weights there: converted once, dropped with the model
_DEVICE_WEIGHTS: weakref.WeakKeyDictionary[RecurrentModel, dict[torch.device, DeviceWeights]] = \
    weakref.WeakKeyDictionary()


def device_weights(model: RecurrentModel, device: torch.device) -> DeviceWeights:
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
        weights = per_device[device] = DeviceWeights(
            token_embd=token_embd,
            output_norm=converted(model.output_norm),
            output=token_embd if model.tied else converted(model.output),
            layers=[{f.name: converted(getattr(layer, f.name)) for f in fields(layer)} for layer in model.layers])
    return weights


def concatenated(logits: list[Tensor]) -> Tensor:
    """The logits of several ubatches as one tensor, in order."""
    return torch.cat(logits)


# -- the forward ----------------------------------------------------------------------------


def forward_ubatch(model: RecurrentModel, st: Any, r_rows: list[Any], s_rows: list[Any]) -> Tensor:
    """``model.forward_ubatch(st)`` on torch rows ``r_rows`` / ``s_rows`` (``model.state_rows(st)``):
    the states are updated in place, the logits returned on the rows' device in the model's dtype."""
    for rows in (r_rows[0], s_rows[0]):
        if not isinstance(rows, Tensor):
            raise ModelError(f"state rows of type {type(rows).__name__}: neither numpy arrays nor torch tensors")
    mixer = _mixer(model)
    p = model.hparams
    ub = st.ubatch
    n_seqs, n_seq_tokens = ub.n_seqs, ub.n_seq_tokens
    device = r_rows[0].device
    dtype = _COMPUTE_DTYPES[model.dtype]
    weights = device_weights(model, device)
    storage_r, storage_s = TorchStateStorage(r_rows[0].dtype), TorchStateStorage(s_rows[0].dtype)

    # the input is checked before any state is read or written: a bad token leaves the cache as it was
    if ub.token is None:
        x = torch.tensor(model.checked_embd(ub.embd), dtype=dtype, device=device)   # a copy: ub.embd is read-only
    else:
        ids = torch.from_numpy(model.checked_tokens(ub.token).astype(np.int64)).to(device)
        x = weights.token_embd[ids]
    x = x.reshape(n_seqs, n_seq_tokens, p.n_embd)

    m = st.r_steps(0).shape[1]   # step states the cache keeps per group
    finals: list[tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]] = []
    for layer, r, s in zip(weights.layers, r_rows, s_rows):
        conv = storage_r.decode(r, dtype).reshape(n_seqs, p.conv_channels, p.d_conv - 1)
        ssm = storage_s.decode(s, dtype).reshape(n_seqs, p.d_inner, p.d_state)
        out, conv, ssm, steps = mixer(model, layer, _rms_norm(x, p.rms_eps) * layer["attn_norm"], conv, ssm,
                                      storage_r, storage_s, m)
        x = x + out
        finals.append((conv, ssm, steps))

    # written once every layer has run, so that an error in any layer leaves every row as it was
    for il, (r, s, (conv, ssm, steps)) in enumerate(zip(r_rows, s_rows, finals)):
        r.copy_(storage_r.encode(conv.reshape(n_seqs, p.n_embd_r)))
        s.copy_(storage_s.encode(ssm.reshape(n_seqs, p.n_embd_s)))
        if steps is not None:
            st.r_steps(il).copy_(storage_r.encode(steps[0].reshape(n_seqs, m, p.n_embd_r)))
            st.s_steps(il).copy_(storage_s.encode(steps[1].reshape(n_seqs, m, p.n_embd_s)))
    outputs = torch.from_numpy(np.flatnonzero(ub.output)).to(device)
    x = x.reshape(ub.n_tokens, p.n_embd)[outputs]
    result: Tensor = (_rms_norm(x, p.rms_eps) * weights.output_norm) @ weights.output.T
    return result


# One block: (model, its layer's weights, u [n_seqs, n_tokens, n_embd] normed, conv, ssm, storage_r, storage_s, m)
# -> (output to add to the residual, conv after, ssm after, the step states (conv, ssm) when m > 0).
Mixer = Callable[[Any, Weights, Tensor, Tensor, Tensor, TorchStateStorage, TorchStateStorage, int],
                 tuple[Tensor, Tensor, Tensor, "tuple[Tensor, Tensor] | None"]]


def _mixer(model: RecurrentModel) -> Mixer:
    if isinstance(model, MambaModel):
        return _mamba_mixer
    if isinstance(model, Mamba2Model):
        return _mamba2_mixer
    raise ModelError(f"no torch forward for {type(model).__name__} (Mamba-1 and Mamba-2 have one)")


# -- the math, as recurrent.py's --------------------------------------------------------------


def _rms_norm(v: Tensor, eps: float) -> Tensor:
    return v / torch.sqrt(torch.mean(v * v, dim=-1, keepdim=True) + eps)


def _silu(v: Tensor) -> Tensor:
    return v / (1.0 + torch.exp(-v))   # as the numpy forward writes it (exp overflows to inf: -0)


def _softplus(v: Tensor) -> Tensor:
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0))))


def _conv_window(conv: Tensor, inputs: Tensor, storage_r: TorchStateStorage) -> Tensor:
    """recurrent.conv_window's window: the state then the inputs rounded as stored, [n_seqs, channels, d_conv-1+n]."""
    return torch.cat([conv, storage_r.round(inputs).transpose(1, 2)], dim=2)


def _causal_conv(window: Tensor, weight: Tensor, bias: Tensor, n_tokens: int) -> Tensor:
    summed = window[:, :, 0:n_tokens] * weight[:, 0, None]
    for k in range(1, weight.shape[1]):
        summed = summed + window[:, :, k:k + n_tokens] * weight[:, k, None]
    return _silu(summed.transpose(1, 2) + bias)


def _conv_after(window: Tensor, d_conv: int, m: int) -> tuple[Tensor, Tensor | None]:
    """The conv state after the last token, and after tokens n_tokens-1-m .. n_tokens-2 when m > 0."""
    n_tokens = window.shape[2] - (d_conv - 1)
    steps = (torch.stack([window[:, :, t + 1:t + d_conv] for t in range(n_tokens - 1 - m, n_tokens - 1)], dim=1)
             if m else None)
    return window[:, :, n_tokens:], steps


def _mamba_mixer(model: MambaModel, w: Weights, u: Tensor, conv: Tensor, ssm: Tensor, storage_r: TorchStateStorage,
                 storage_s: TorchStateStorage, m: int) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """``MambaModel.mixer`` in torch."""
    p = model.hparams
    n_tokens = u.shape[1]
    xz = u @ w["ssm_in"].T
    z = xz[..., p.d_inner:]
    window = _conv_window(conv, xz[..., :p.d_inner], storage_r)
    xc = _causal_conv(window, w["ssm_conv1d"], w["ssm_conv1d_b"], n_tokens)   # [n_seqs, n_tokens, d_inner]

    dbc = xc @ w["ssm_x"].T
    dt = dbc[..., :p.dt_rank]
    b = dbc[..., p.dt_rank:p.dt_rank + p.d_state]
    c = dbc[..., p.dt_rank + p.d_state:]
    if p.dt_b_c_rms:
        dt, b, c = _rms_norm(dt, p.rms_eps), _rms_norm(b, p.rms_eps), _rms_norm(c, p.rms_eps)
    dt = _softplus(dt @ w["ssm_dt"].T + w["ssm_dt_b"])
    dt_x = dt * xc

    first_step = n_tokens - 1 - m
    ssm_steps, ys = [], []
    for t in range(n_tokens):
        h = ssm * torch.exp(dt[:, t, :, None] * w["ssm_a"]) + dt_x[:, t, :, None] * b[:, t, None, :]
        ys.append((h @ c[:, t, :, None])[..., 0])
        ssm = storage_s.round(h)
        if first_step <= t < n_tokens - 1:
            ssm_steps.append(ssm)
    y = torch.stack(ys, dim=1)
    conv, conv_steps = _conv_after(window, p.d_conv, m)
    steps = None if conv_steps is None else (conv_steps, torch.stack(ssm_steps, dim=1))
    return ((y + xc * w["ssm_d"]) * _silu(z)) @ w["ssm_out"].T, conv, ssm, steps


def _mamba2_mixer(model: Mamba2Model, w: Weights, u: Tensor, conv: Tensor, ssm: Tensor, storage_r: TorchStateStorage,
                  storage_s: TorchStateStorage, m: int) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """``Mamba2Model.mixer`` in torch."""
    p = model.hparams
    n_seqs, n_tokens = u.shape[:2]
    n_head, head_dim, n_group, d_state = p.n_head, p.head_dim, p.n_group, p.d_state
    zxbcdt = u @ w["ssm_in"].T
    z = zxbcdt[..., :p.d_inner]
    window = _conv_window(conv, zxbcdt[..., p.d_inner:p.d_inner + p.conv_channels], storage_r)
    xbc = _causal_conv(window, w["ssm_conv1d"], w["ssm_conv1d_b"], n_tokens)
    x = xbc[..., :p.d_inner].reshape(n_seqs, n_tokens, n_head, head_dim)
    per_group = n_head // n_group   # head h reads group h // per_group
    b = xbc[..., p.d_inner:p.d_inner + n_group * d_state].reshape(n_seqs, n_tokens, n_group, d_state)
    c = xbc[..., p.d_inner + n_group * d_state:].reshape(n_seqs, n_tokens, n_group, d_state)
    b, c = b.repeat_interleave(per_group, dim=2), c.repeat_interleave(per_group, dim=2)
    dt = _softplus(zxbcdt[..., p.d_inner + p.conv_channels:] + w["ssm_dt_b"])
    if p.limits_time_step:
        dt = torch.clamp(dt, *p.time_step_limit)
    decay = torch.exp(dt * w["ssm_a"])
    dt_x = dt[..., None] * x

    state = ssm.reshape(n_seqs, n_head, head_dim, d_state)
    first_step = n_tokens - 1 - m
    ssm_steps, ys = [], []
    for t in range(n_tokens):
        h = state * decay[:, t, :, None, None] + dt_x[:, t, :, :, None] * b[:, t, :, None, :]
        ys.append((h @ c[:, t, :, :, None])[..., 0])
        state = storage_s.round(h)
        if first_step <= t < n_tokens - 1:
            ssm_steps.append(state.reshape(n_seqs, p.d_inner, d_state))
    y = torch.stack(ys, dim=1)
    conv, conv_steps = _conv_after(window, p.d_conv, m)
    steps = None if conv_steps is None else (conv_steps, torch.stack(ssm_steps, dim=1))

    y = (y + x * w["ssm_d"][:, None]).reshape(n_seqs, n_tokens, p.d_inner) * _silu(z)
    grouped = _rms_norm(y.reshape(n_seqs, n_tokens, n_group, p.d_inner // n_group), p.rms_eps)
    out = (grouped.reshape(n_seqs, n_tokens, p.d_inner) * w["ssm_norm"]) @ w["ssm_out"].T
    return out, conv, state.reshape(n_seqs, p.d_inner, d_state), steps
