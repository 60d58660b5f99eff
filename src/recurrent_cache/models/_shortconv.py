"""LFM2's short convolution on an array namespace ``xp`` (numpy, or torch: ``_arrays.py``), served from the cache.

transformers' ``Lfm2ShortConv`` and llama.cpp's ``build_shortconv_block`` (src/models/lfm2.cpp).
For each sequence's tokens ``u`` [T, n_embd] (already normed by the layer)::

    B, C, x = split(in_proj @ u)                  # n_embd each, in this order
    window  = [conv state ; B * x]                # per channel: the last L_cache inputs
    y       = sum_k window[:, k] * conv[:, k]     # a depthwise causal conv of L_cache taps, no activation
    out     = out_proj @ (C * y)

``conv_bias`` (transformers' flag; LFM2's checkpoints have it off) adds a bias to ``in_proj``,
to the conv and to ``out_proj``; llama.cpp's ``lfm2`` has none of the three, so a model with them
has no GGUF form (``shortconv_gguf_tensors`` refuses it).

The state is the conv's only (llama.cpp: ``n_embd_r = n_embd * (L_cache - 1)``, ``n_embd_s = 0``).
r row: the last ``L_cache - 1`` values of ``B * x`` of each channel, channel-major, oldest first —
``r[ch * (L_cache - 1) + t]`` — as llama.cpp reshapes its conv state ``{d_conv, n_embd, n_seqs}``,
concatenates the new ``B * x`` after it on axis 0 and keeps the last ``d_conv`` columns.  The s row
is 0 values wide.  ``B * x`` is rounded to the r storage before the conv reads it
(``_ssm.conv_window``), so a sequence's output does not depend on how its tokens were split into
ubatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _args
from ..errors import ModelError
from ._arrays import Array
from ._ssm import conv_tokens, linear
from ._storage import StateStorage

__all__ = ["SHORTCONV_PRODUCTS", "ShortConvParams", "random_shortconv_weights", "short_conv",
           "shortconv_gguf_tensors", "shortconv_shapes", "shortconv_weights_from_hf"]

# The biases ``conv_bias`` adds, by field.
_BIASES = ("shortconv_in_proj_b", "shortconv_conv_b", "shortconv_out_proj_b")

# The weights ``_ssm.linear`` multiplies by (a model keeps them in its layout: ``recurrent.checked_tensor``).
SHORTCONV_PRODUCTS = frozenset({"shortconv_in_proj", "shortconv_out_proj"})

# Field -> the layer's GGUF tensor (``blk.N.`` + this), as llama.cpp's converter (conversion/lfm2.py) names them.
_GGUF_SUFFIXES = {
    "shortconv_in_proj": "shortconv.in_proj.weight",
    "shortconv_conv": "shortconv.conv.weight",
    "shortconv_out_proj": "shortconv.out_proj.weight",
}

# Field -> the tensor of a transformers checkpoint, under the layer's ``conv.`` prefix.
_HF_NAMES = {
    "shortconv_in_proj": "in_proj.weight",
    "shortconv_conv": "conv.weight",
    "shortconv_out_proj": "out_proj.weight",
    "shortconv_in_proj_b": "in_proj.bias",
    "shortconv_conv_b": "conv.bias",
    "shortconv_out_proj_b": "out_proj.bias",
}


@dataclass(frozen=True)
class ShortConvParams:
    """The sizes of one short-convolution layer: ``n_embd`` channels, ``l_cache`` taps (llama.cpp's
    ``lfm2.shortconv.l_cache``), and whether transformers' ``conv_bias`` biases are there."""

    n_embd: int
    l_cache: int
    conv_bias: bool = False

    def __post_init__(self) -> None:
        _args.count(self.n_embd, "hidden_size", 1, ModelError, int32_only=False)
        # L_cache = 1 would leave no rolling state (llama.cpp asserts n_shortconv_l_cache > 1)
        _args.count(self.l_cache, "conv_L_cache", 2, ModelError, int32_only=False)
        if not isinstance(self.conv_bias, bool):
            raise ModelError(f"conv_bias must be true or false, got {self.conv_bias!r}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ShortConvParams:
        """The sizes of a transformers ``Lfm2Config`` (``config.json``'s fields: ``hidden_size``,
        ``conv_L_cache`` (default 3), ``conv_bias`` (default false)); ``ModelError`` naming a bad one."""
        if "hidden_size" not in config:
            raise ModelError("field hidden_size is missing")
        return cls(config["hidden_size"], config.get("conv_L_cache", 3), config.get("conv_bias", False))

    @property
    def n_kept(self) -> int:
        """The inputs a conv state keeps per channel: ``l_cache - 1`` (llama.cpp's ``d_conv`` here)."""
        return self.l_cache - 1

    @property
    def n_embd_r(self) -> int:
        """Width of a cache r row: ``n_kept`` values of every channel."""
        return self.n_embd * self.n_kept

    @property
    def n_embd_s(self) -> int:
        """Width of a cache s row: 0 (no state besides the conv's)."""
        return 0


def shortconv_shapes(p: ShortConvParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each weight ``short_conv`` reads (the biases only with ``conv_bias``)."""
    shapes: dict[str, tuple[int, ...]] = {
        "shortconv_in_proj": (3 * p.n_embd, p.n_embd),
        "shortconv_conv": (p.n_embd, p.l_cache),
        "shortconv_out_proj": (p.n_embd, p.n_embd),
    }
    if p.conv_bias:
        shapes.update(shortconv_in_proj_b=(3 * p.n_embd,), shortconv_conv_b=(p.n_embd,),
                      shortconv_out_proj_b=(p.n_embd,))
    return shapes


def shortconv_gguf_tensors(p: ShortConvParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Field -> (GGUF tensor suffix, numpy shape as llama.cpp stores it): ggml's ``{L_cache, n_embd}``
    conv, ``{n_embd, 3 n_embd}`` in_proj and ``{n_embd, n_embd}`` out_proj, the numpy shapes above.
    ``ModelError`` with ``conv_bias``: llama.cpp's lfm2 has no bias, the file would be another model."""
    if p.conv_bias:
        raise ModelError("conv_bias: llama.cpp's lfm2 has no in_proj, conv or out_proj bias, so the GGUF file "
                         "would be another model")
    shapes = shortconv_shapes(p)
    return {field: (suffix, shapes[field]) for field, suffix in _GGUF_SUFFIXES.items()}


def shortconv_weights_from_hf(weight: Callable[[str, tuple[int, ...]], np.ndarray],
                              p: ShortConvParams) -> dict[str, np.ndarray]:
    """The layer's weights from a transformers checkpoint: ``weight(name, shape)`` reads the tensor
    ``name`` under the layer's ``conv.`` prefix (``conv.weight`` is stored ``[n_embd, 1, L_cache]``:
    the checkpoint reader drops the unit axis)."""
    return {field: weight(_HF_NAMES[field], shape) for field, shape in shortconv_shapes(p).items()}


def random_shortconv_weights(rng: np.random.Generator, p: ShortConvParams) -> dict[str, np.ndarray]:
    """Seeded weights of the scale transformers initialises (projections ~ 1/sqrt(n_embd), conv taps
    uniform in ±1/sqrt(L_cache)), biases too with ``conv_bias``."""
    bound = 1 / np.sqrt(p.l_cache)
    weights = {
        "shortconv_in_proj": rng.standard_normal((3 * p.n_embd, p.n_embd)) / np.sqrt(p.n_embd),
        "shortconv_conv": rng.uniform(-bound, bound, size=(p.n_embd, p.l_cache)),
        "shortconv_out_proj": rng.standard_normal((p.n_embd, p.n_embd)) / np.sqrt(p.n_embd),
    }
    for field in _BIASES if p.conv_bias else ():
        weights[field] = 0.1 * rng.standard_normal(shortconv_shapes(p)[field])
    return weights


def short_conv(xp: Any, p: ShortConvParams, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
               storage_r: StateStorage, storage_s: StateStorage, m: int
               ) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
    """One short-convolution block on ``u`` [n_seqs, n_tokens, n_embd] (already normed).

    ``conv`` [n_seqs, n_embd_r] (decoded to the compute dtype) is the conv state before the first
    token, in the r row's layout; ``ssm`` [n_seqs, 0] the empty s state.  Returns the output to add to
    the residual [n_seqs, n_tokens, n_embd], the conv state after the last token [n_seqs, n_embd_r],
    the s state [n_seqs, 0], and with ``m > 0`` the states after tokens n_tokens-1-m .. n_tokens-2
    (conv [n_seqs, m, n_embd_r], s [n_seqs, m, 0]), else None (what ``RecurrentModel.mixer`` returns).
    ``storage_s`` has nothing to round: it is taken for the mixers' one signature.
    """
    n_seqs, n_tokens = u.shape[:2]
    n_embd = p.n_embd
    bcx = linear(u, w["shortconv_in_proj"])
    if p.conv_bias:
        bcx = bcx + w["shortconv_in_proj_b"]
    b, c, x = bcx[..., :n_embd], bcx[..., n_embd:2 * n_embd], bcx[..., 2 * n_embd:]
    y, conv_after, conv_steps = conv_tokens(xp, xp.reshape(conv, (n_seqs, n_embd, p.n_kept)), b * x,
                                            w["shortconv_conv"], w["shortconv_conv_b"] if p.conv_bias else 0.0,
                                            storage_r, m, activation=False)
    out = linear(c * y, w["shortconv_out_proj"])
    if p.conv_bias:
        out = out + w["shortconv_out_proj_b"]
    steps = None if conv_steps is None else (xp.reshape(conv_steps, (n_seqs, m, p.n_embd_r)),
                                              xp.reshape(ssm, (n_seqs, m, 0)))
    return out, xp.reshape(conv_after, (n_seqs, p.n_embd_r)), ssm, steps
