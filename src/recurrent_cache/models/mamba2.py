"""Mamba-2 in numpy, as llama.cpp (``build_mamba2_layer``) and transformers compute it, served from the cache.

Per layer, for each token, with H heads of P = d_inner / H channels and G
groups of B / C (head h reads group ``h // (H / G)``)::

    u          = rms_norm(x) * attn_norm
    z, xBC, dt = split(ssm_in @ u)                  # d_inner, d_inner + 2*G*d_state, H
    window     = [conv state ; xBC]                 # per channel: the last d_conv inputs
    xBC        = silu(sum_k window[:, k] * ssm_conv1d[:, k] + ssm_conv1d.bias)
    x, B, C    = split(xBC)                         # [H, P], [G, d_state], [G, d_state]
    dt         = clamp(softplus(dt + ssm_dt.bias), time_step_limit)   # [H]
    h[h]       = h[h] * exp(dt[h] * ssm_a[h]) + (dt[h] * x[h])[:, None] * B[g(h)][None, :]
    y[h]       = h[h] @ C[g(h)] + x[h] * ssm_d[h]
    y          = group_rms_norm(y * silu(z)) * ssm_norm   # G groups of d_inner / G channels
    x          = x + ssm_out @ y

The gate multiplies before the norm (transformers' ``norm_before_gate=False``,
llama.cpp's ``swiglu_split`` then ``build_norm``).  The cache rows are
llama.cpp's: r = (d_conv-1) × (d_inner + 2·G·d_state) — the conv over x‖B‖C —
and s = d_state × d_inner, the state ``h[head, p, n]`` at
``s[(head*P + p)*d_state + n]`` (ggml's ``{d_state, head_dim, n_head}``).
``time_step_limit`` is transformers' (llama.cpp has none: it must be the
default (0, inf) for a GGUF file).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelError
from ._arrays import Array
from ._registry import Family, register
from ._ssm import (conv_tokens, gated_rms_norm, linear, random_conv, random_dt_bias, random_head, rms_norm,
                   selective_scan, silu, softplus)
from ._storage import StateStorage
from .recurrent import MixerResult, RecurrentModel, check_sizes, checked_layers
from .gguf_io import GGUFReader
from .hf import MAX_CONFIG_INT, Checkpoint, as_float, built, common_sizes, head_tensors
from .vocab import Vocabulary

__all__ = ["ARCH", "LAYER_TENSORS", "Mamba2HParams", "Mamba2Layer", "Mamba2Model", "gated_output", "hf_mixer_weights",
           "hf_time_step_limit", "mamba2_mixer", "random_layer", "random_mamba2_model"]

ARCH = "mamba2"
NO_TIME_STEP_LIMIT = (0.0, math.inf)


@dataclass(frozen=True)
class Mamba2HParams:
    """The sizes of a Mamba-2 model (llama.cpp's ``mamba2.*`` GGUF keys)."""

    n_vocab: int
    n_embd: int             # mamba2.embedding_length
    n_layer: int            # mamba2.block_count
    d_conv: int             # mamba2.ssm.conv_kernel
    d_inner: int            # mamba2.ssm.inner_size
    d_state: int            # mamba2.ssm.state_size
    n_head: int             # mamba2.ssm.time_step_rank
    n_group: int = 1        # mamba2.ssm.group_count
    rms_eps: float = 1e-5   # mamba2.attention.layer_norm_rms_epsilon
    time_step_limit: tuple[float, float] = NO_TIME_STEP_LIMIT  # transformers' clamp of dt (no GGUF key)

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "d_conv", "d_inner", "d_state", "n_head", "n_group"))
        if self.d_inner % self.n_head:
            raise ModelError(f"d_inner {self.d_inner} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_group:
            raise ModelError(f"n_head {self.n_head} is not a multiple of n_group {self.n_group}")
        low, high = self.time_step_limit
        if not (0.0 <= low <= high):
            raise ModelError(f"time_step_limit must be (low, high) with 0 <= low <= high, got {self.time_step_limit}")

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.n_head

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: x, then B and C of every group."""
        return self.d_inner + 2 * self.n_group * self.d_state

    @property
    def d_in_proj(self) -> int:
        """Rows of ``ssm_in``: z, x‖B‖C, dt."""
        return self.d_inner + self.conv_channels + self.n_head

    @property
    def n_embd_r(self) -> int:
        """Width of a cache r row: the conv window without its newest input."""
        return (self.d_conv - 1) * self.conv_channels

    @property
    def n_embd_s(self) -> int:
        """Width of a cache s row: the SSM state of every head."""
        return self.d_state * self.d_inner

    @property
    def limits_time_step(self) -> bool:
        """True when ``time_step_limit`` clamps anything (softplus is never negative)."""
        return self.time_step_limit[0] > 0.0 or self.time_step_limit[1] < math.inf

    def describe(self) -> str:
        return (f"Mamba-2, {self.n_layer} layers, n_embd {self.n_embd}, d_inner {self.d_inner}, "
                f"{self.n_head} heads of {self.head_dim}, {self.n_group} groups, d_state {self.d_state}, "
                f"d_conv {self.d_conv}, vocab {self.n_vocab}")


@dataclass
class Mamba2Layer:
    """The weights of one layer, in numpy (C-order) shapes; per-head vectors are 1-D here
    (llama.cpp's GGUF stores ``ssm_a`` / ``ssm_d`` as [n_head, 1] and ``ssm_norm`` as [n_group, d_inner/n_group])."""

    attn_norm: np.ndarray     # [n_embd]
    ssm_in: np.ndarray        # [d_in_proj, n_embd]: z rows, x‖B‖C rows, dt rows
    ssm_conv1d: np.ndarray    # [conv_channels, d_conv]
    ssm_conv1d_b: np.ndarray  # [conv_channels]
    ssm_dt_b: np.ndarray      # [n_head]
    ssm_a: np.ndarray         # [n_head], already negative: A = -exp(A_log)
    ssm_d: np.ndarray         # [n_head]
    ssm_norm: np.ndarray      # [d_inner]
    ssm_out: np.ndarray       # [n_embd, d_inner]


# GGUF tensor name of each layer field (``blk.N.`` + this), as llama.cpp's converter writes them.
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "ssm_in": "ssm_in.weight",
    "ssm_conv1d": "ssm_conv1d.weight",
    "ssm_conv1d_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_d": "ssm_d",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
}


# The weights ``linear`` multiplies by (kept in its layout).
PRODUCTS = frozenset({"ssm_in", "ssm_out"})


def layer_shapes(p: Mamba2HParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each ``Mamba2Layer`` field."""
    return {
        "attn_norm": (p.n_embd,),
        "ssm_in": (p.d_in_proj, p.n_embd),
        "ssm_conv1d": (p.conv_channels, p.d_conv),
        "ssm_conv1d_b": (p.conv_channels,),
        "ssm_dt_b": (p.n_head,),
        "ssm_a": (p.n_head,),
        "ssm_d": (p.n_head,),
        "ssm_norm": (p.d_inner,),
        "ssm_out": (p.n_embd, p.d_inner),
    }


def gguf_layer_shapes(p: Mamba2HParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each field as llama.cpp's GGUF stores it (ggml's ne reversed)."""
    return layer_shapes(p) | {"ssm_a": (p.n_head, 1), "ssm_d": (p.n_head, 1),
                              "ssm_norm": (p.n_group, p.d_inner // p.n_group)}


class Mamba2Model(RecurrentModel):
    """A Mamba-2 language model: weights, and the forward pass over the cache (``RecurrentModel``)."""

    hparams: Mamba2HParams
    layers: list[Mamba2Layer]

    def __init__(self, hparams: Mamba2HParams, token_embd: Any, layers: Sequence[Mamba2Layer],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        super().__init__(hparams, token_embd, output_norm, output, dtype, vocab)
        self.layers = checked_layers(layers, hparams.n_layer, Mamba2Layer, LAYER_TENSORS, layer_shapes(hparams),
                                     self.dtype, PRODUCTS)

    def mixer(self, xp: Any, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
              storage_r: StateStorage, storage_s: StateStorage, m: int) -> MixerResult:
        """One Mamba-2 block on ``u`` [n_seqs, n_tokens, n_embd] (``mamba2_mixer``)."""
        return mamba2_mixer(xp, self.hparams, w, u, conv, ssm, storage_r, storage_s, m)


def mamba2_mixer(xp: Any, p: Mamba2HParams, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
                 storage_r: StateStorage, storage_s: StateStorage, m: int, *, norm_before_gate: bool = False
                 ) -> MixerResult:
    """One Mamba-2 block of sizes ``p`` on ``u`` [n_seqs, n_tokens, n_embd] (see ``RecurrentModel.mixer``).

    conv: [n_seqs, conv_channels, d_conv-1] and ssm: [n_seqs, d_inner, d_state].  The output's gate and
    norm are ``gated_output``'s (``norm_before_gate``; ``w`` without ``ssm_norm``: gated, not normed).
    """
    n_seqs, n_tokens = u.shape[:2]
    n_head, head_dim, n_group, d_state = p.n_head, p.head_dim, p.n_group, p.d_state
    zxbcdt = linear(u, w["ssm_in"])
    z = zxbcdt[..., :p.d_inner]
    # [n_seqs, n_tokens, channels], the conv states after the last token (and the step states)
    xbc, conv, conv_steps = conv_tokens(xp, conv, zxbcdt[..., p.d_inner:p.d_inner + p.conv_channels],
                                        w["ssm_conv1d"], w["ssm_conv1d_b"], storage_r, m)
    x = xbc[..., :p.d_inner].reshape((n_seqs, n_tokens, n_head, head_dim))
    # B and C per head: head h reads group h // (n_head / n_group), transformers' repeat_interleave; one group
    # broadcasts over the heads as it is
    per_group = n_head // n_group
    b = xbc[..., p.d_inner:p.d_inner + n_group * d_state].reshape((n_seqs, n_tokens, n_group, d_state))
    c = xbc[..., p.d_inner + n_group * d_state:].reshape((n_seqs, n_tokens, n_group, d_state))
    if n_group > 1 and per_group > 1:
        # [n_seqs, n_tokens, n_head, d_state]
        b, c = xp.repeat(b, per_group, axis=2), xp.repeat(c, per_group, axis=2)
    dt = softplus(xp, zxbcdt[..., p.d_inner + p.conv_channels:] + w["ssm_dt_b"])   # [n_seqs, n_tokens, n_head]
    if p.limits_time_step:
        dt = xp.clip(dt, *p.time_step_limit)

    # per head: the decay exp(dt * A) of all its channels, and the input dt * x
    state = ssm.reshape((n_seqs, n_head, head_dim, d_state))
    y, state, ssm_steps = selective_scan(xp, state, dt[..., None, None], w["ssm_a"][:, None, None],
                                         dt[..., None] * x, b, c, storage_s, m)
    y = (y + x * w["ssm_d"][:, None]).reshape((n_seqs, n_tokens, p.d_inner))
    out = linear(gated_output(xp, p, w, y, z, norm_before_gate), w["ssm_out"])
    steps = None if ssm_steps is None else (conv_steps, ssm_steps.reshape((n_seqs, m, p.d_inner, d_state)))
    return out, conv, state.reshape((n_seqs, p.d_inner, d_state)), steps


def gated_output(xp: Any, p: Mamba2HParams, w: dict[str, Array], y: Array, z: Array,
                 norm_before_gate: bool = False) -> Array:
    """``y`` [..., d_inner] gated by ``silu(z)`` and RMS-normed over each of the ``n_group`` groups times
    ``ssm_norm``: gated first (transformers' ``norm_before_gate=False``, llama.cpp's only order), or normed
    first (``norm_before_gate``: Falcon-H1's ``mamba_norm_before_gate``).  Without ``ssm_norm`` in ``w``
    only gated (Falcon-H1's ``mamba_rms_norm=False``; llama.cpp's graph without the tensor)."""
    if "ssm_norm" not in w:
        return y * silu(xp, z)
    if not norm_before_gate:
        return gated_rms_norm(xp, y, z, w["ssm_norm"], p.n_group, p.rms_eps)
    *lead, width = y.shape
    grouped = rms_norm(xp, y.reshape((*lead, p.n_group, width // p.n_group)), p.rms_eps)
    return grouped.reshape((*lead, width)) * w["ssm_norm"] * silu(xp, z)


def random_layer(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], n_layer: int,
                 mamba: Mamba2HParams | None = None) -> dict[str, np.ndarray]:
    """Seeded random weights of a hybrid family's layer of ``shapes``: vectors near 1, matrices scaled by
    ``1/sqrt(fan_in * n_layer)``; with ``mamba``, the layer's Mamba-2 block initialised as ``mamba_ssm`` does
    (conv, dt bias, A = -[1..n_head], D = 1)."""
    layer = {name: (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                    else rng.standard_normal(shape) / np.sqrt(shape[-1] * n_layer))
             for name, shape in shapes.items()}
    if mamba is not None:
        layer["ssm_conv1d"], layer["ssm_conv1d_b"] = random_conv(rng, mamba.conv_channels, mamba.d_conv)
        layer["ssm_dt_b"] = random_dt_bias(rng, mamba.n_head)
        layer["ssm_a"] = -np.arange(1, mamba.n_head + 1, dtype=np.float64)
        layer["ssm_d"] = np.ones(mamba.n_head)
    return layer


def random_mamba2_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 4,
                        d_state: int = 16, d_conv: int = 4, head_dim: int = 16, n_group: int = 1,
                        d_inner: int | None = None, rms_eps: float = 1e-5, tied: bool = False,
                        dtype: Any = np.float64) -> Mamba2Model:
    """A Mamba-2 model with seeded random weights, initialised as ``mamba_ssm`` does.

    ``d_inner = 2*n_embd`` by default, in heads of ``head_dim``; per-head
    ``A = -[1..n_head]``, ``D = 1``, ``dt`` log-uniform in [1e-3, 1e-1]
    through the softplus bias.  The output projection is scaled so that
    logits spread over a few units.
    """
    d_inner = 2 * n_embd if d_inner is None else d_inner
    if d_inner % head_dim:
        raise ModelError(f"d_inner {d_inner} is not a multiple of head_dim {head_dim}")
    p = Mamba2HParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, d_conv=d_conv, d_inner=d_inner,
                      d_state=d_state, n_head=d_inner // head_dim, n_group=n_group, rms_eps=rms_eps)
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layer):
        dt_bias = random_dt_bias(rng, p.n_head)
        attn_norm = 1.0 + 0.1 * rng.standard_normal(n_embd)
        ssm_in = rng.standard_normal((p.d_in_proj, n_embd)) / np.sqrt(n_embd)
        conv_weight, conv_bias = random_conv(rng, p.conv_channels, d_conv)
        layers.append(Mamba2Layer(
            attn_norm=attn_norm, ssm_in=ssm_in, ssm_conv1d=conv_weight, ssm_conv1d_b=conv_bias, ssm_dt_b=dt_bias,
            ssm_a=-np.arange(1, p.n_head + 1, dtype=np.float64),
            ssm_d=np.ones(p.n_head),
            ssm_norm=1.0 + 0.1 * rng.standard_normal(d_inner),
            ssm_out=rng.standard_normal((n_embd, d_inner)) / np.sqrt(d_inner * n_layer),
        ))
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return Mamba2Model(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- files: GGUF (llama.cpp's converter) and Hugging Face checkpoints (transformers' Mamba2ForCausalLM) ---------


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> Mamba2Model:
    """The model of a GGUF file of architecture ``mamba2`` (``load_gguf``)."""
    hparams = Mamba2HParams(**sizes, n_head=read.key("ssm.time_step_rank", int),
                            n_group=read.key("ssm.group_count", int, 1))
    shapes, stored = layer_shapes(hparams), gguf_layer_shapes(hparams)

    def tensor(name: str, field: str) -> np.ndarray:
        values = read.tensor(name, stored[field])
        return values.reshape(shapes[field]) if values.shape == stored[field] else values
    layers = [Mamba2Layer(**{field: tensor(f"blk.{il}.{suffix}", field) for field, suffix in LAYER_TENSORS.items()})
              for il in range(hparams.n_layer)]
    token_embd, output_norm, output = head
    return Mamba2Model(hparams, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


def _gguf_layout(model: Mamba2Model) -> dict[str, tuple[str, tuple[int, ...]]]:
    if model.hparams.limits_time_step:
        raise ModelError(f"time_step_limit {model.hparams.time_step_limit} clamps dt; llama.cpp's mamba2 "
                         "does not, so the GGUF file would be another model")
    shapes = gguf_layer_shapes(model.hparams)
    return {field: (suffix, shapes[field]) for field, suffix in LAYER_TENSORS.items()}


def _write_gguf_keys(writer: Any, model: Mamba2Model) -> None:
    writer.add_ssm_time_step_rank(model.hparams.n_head)
    writer.add_ssm_group_count(model.hparams.n_group)
    writer.add_layer_norm_rms_eps(model.hparams.rms_eps)


def hf_time_step_limit(checkpoint: Checkpoint) -> tuple[float, float]:
    """config.json's ``time_step_limit``, transformers' clamp of dt (none when absent)."""
    limit = checkpoint.config.get("time_step_limit", NO_TIME_STEP_LIMIT)
    # the upper limit may be infinite (no clamp, transformers' default); anything else must be a finite number
    if (not isinstance(limit, (list, tuple)) or len(limit) != 2 or as_float(limit[0]) is None
            or (as_float(limit[1]) is None and limit[1] != math.inf)):
        raise checkpoint.refuse("time_step_limit", "not a pair of numbers [low, high], high possibly infinite")
    return float(limit[0]), float(limit[1])


def hf_mixer_weights(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: Mamba2HParams, prefix: str,
                     conv_bias: bool, norm: bool = True) -> dict[str, np.ndarray]:
    """A transformers Mamba-2 block's tensors as the mixer's fields (every ``Mamba2Layer`` field but
    ``attn_norm``): ``weight(name, shape)`` reads a tensor of the layer, ``prefix`` names the block in it
    ("mixer.", Falcon-H1's "mamba.").  A = -exp(A_log); a zero conv bias when the config has none
    (``conv_bias``); no ``ssm_norm`` when ``norm`` is false (Falcon-H1's ``mamba_rms_norm=False``)."""
    shapes = layer_shapes(p)
    names = {"ssm_in": "in_proj.weight", "ssm_conv1d": "conv1d.weight", "ssm_dt_b": "dt_bias", "ssm_d": "D",
             "ssm_out": "out_proj.weight"} | ({"ssm_norm": "norm.weight"} if norm else {})
    fields = {field: weight(prefix + name, shapes[field]) for field, name in names.items()}
    fields["ssm_conv1d_b"] = (weight(prefix + "conv1d.bias", shapes["ssm_conv1d_b"]) if conv_bias
                              else np.zeros(shapes["ssm_conv1d_b"], np.float32))
    fields["ssm_a"] = -np.exp(weight(prefix + "A_log", shapes["ssm_a"]).astype(np.float64))
    return fields


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> Mamba2Model:
    """The model of a ``Mamba2ForCausalLM`` checkpoint directory (``load_hf``)."""
    common = common_sizes(checkpoint)
    n_embd = common["n_embd"]
    d_inner = int(checkpoint.positive_float("expand", 2, high=MAX_CONFIG_INT) * n_embd)
    n_head, head_dim = checkpoint.field("num_heads", int), checkpoint.field("head_dim", int)
    if n_head * head_dim != d_inner:
        raise checkpoint.refuse("num_heads", f"num_heads × head_dim = {n_head * head_dim}, but "
                                f"expand × hidden_size = {d_inner}")
    p = built(checkpoint, Mamba2HParams, **common, d_inner=d_inner, n_head=n_head,
                                n_group=checkpoint.field("n_groups", int, 1),
                                time_step_limit=hf_time_step_limit(checkpoint))
    use_conv_bias = checkpoint.field("use_conv_bias", bool, True)
    layers = []
    for il in range(p.n_layer):
        weight = checkpoint.layer_tensors(il)
        layers.append(Mamba2Layer(attn_norm=weight("norm.weight", (p.n_embd,)),
                                  **hf_mixer_weights(weight, p, "mixer.", use_conv_bias)))
    token_embd, output_norm, output = head_tensors(checkpoint, p.n_vocab, p.n_embd, tied_default=False)
    return built(checkpoint, Mamba2Model, hparams=p, token_embd=token_embd, layers=layers,
                    output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)


FAMILY = register(Family(label="Mamba-2", gguf_arch=ARCH, hf_architecture="Mamba2ForCausalLM",
                         model_class=Mamba2Model, from_gguf=_from_gguf, from_hf=_from_hf, gguf_layout=_gguf_layout,
                         write_gguf_keys=_write_gguf_keys))
