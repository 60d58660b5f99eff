"""LFM2 (Liquid AI): short-convolution layers and attention layers, a SwiGLU MLP after each, on a
``HybridCache`` — as transformers' ``Lfm2ForCausalLM`` and llama.cpp's ``lfm2`` compute it.

Per layer::

    u = rms_norm(x) * attn_norm                   # transformers' operator_norm
    x = x + (attention(u) if the layer is an attention layer else short_conv(u))
    x = x + ffn_down @ (silu(ffn_gate @ v) * (ffn_up @ v)),  v = rms_norm(x) * ffn_norm

then ``rms_norm(x) * output_norm`` (transformers' ``embedding_norm``) and the head, tied to the token
embedding unless the checkpoint has its own.  Attention: GQA, q and k RMS-normed per head
(``q_norm`` / ``k_norm``), neox RoPE over the whole head (base ``rope_theta``), scale
1/sqrt(head_dim), no biases.  The short convolution is ``_shortconv.short_conv`` (its docstring has
the math and the state layout): a conv state only, so the recurrent rows are
``n_embd_r = n_embd * (L_cache - 1)`` wide and the s rows 0 wide, as llama.cpp's.  ``layer_types``
("conv" / "full_attention", or ``full_attn_idxs``) says which layer is which; ``n_ff`` follows
transformers' ``block_auto_adjust_ff_dim`` rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ConfigError, ModelError
from ._arrays import Array
from ._attention import AttentionParams, Rope
from ._ffn import mlp
from ._registry import Family, register
from ._shortconv import (SHORTCONV_PRODUCTS, ShortConvParams, random_shortconv_weights, short_conv,
                         shortconv_gguf_tensors, shortconv_shapes, shortconv_weights_from_hf)
from ._ssm import random_head, rms_norm
from .gguf_io import GGUFReader
from .hf import MAX_CONFIG_INT, Checkpoint, as_float, built
from .hybrid_model import HybridModel, LayerRun
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["Lfm2HParams", "Lfm2Model", "random_lfm2_model"]

ARCH = "lfm2"

_PRODUCTS = frozenset({"wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down"}) | SHORTCONV_PRODUCTS


@dataclass(frozen=True)
class Lfm2HParams:
    """The sizes of an LFM2 model (transformers' ``Lfm2Config``; llama.cpp's ``lfm2.*`` keys)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    l_cache: int                      # conv_L_cache: the short convolution's taps
    attn_layers: tuple[int, ...]
    rope_theta: float = 1e6
    rms_eps: float = 1e-5
    conv_bias: bool = False

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff"))
        if any(not 0 <= il < self.n_layer for il in self.attn_layers):
            raise ModelError(f"attn_layers {self.attn_layers} name layers outside [0, {self.n_layer})")
        if self.n_embd % self.n_head:
            raise ModelError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        # the short convolution's and the attention's own checks (L_cache; the heads, the rope)
        _ = self.shortconv, self.attention

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if il not in self.attn_layers)

    @cached_property
    def attention(self) -> AttentionParams:
        head_dim = self.n_embd // self.n_head
        try:
            return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, head_dim,
                                   Rope("neox", head_dim, self.rope_theta), norm_eps=self.rms_eps)
        except ConfigError as exc:   # a size the attention cannot take
            raise ModelError(str(exc)) from None

    @cached_property
    def shortconv(self) -> ShortConvParams:
        return ShortConvParams(self.n_embd, self.l_cache, self.conv_bias)

    @property
    def n_embd_r(self) -> int:
        return self.shortconv.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.shortconv.n_embd_s

    def describe(self) -> str:
        return (f"LFM2, {self.n_layer} layers (attention {list(self.attn_layers)}), n_embd {self.n_embd}, "
                f"{self.n_head} heads ({self.n_head_kv} KV), n_ff {self.n_ff}, L_cache {self.l_cache}, "
                f"vocab {self.n_vocab}")


def layer_shapes(p: Lfm2HParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer ``il``'s weight fields and their numpy shapes (ggml's ``ne`` reversed)."""
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (p.n_embd,), "ffn_norm": (p.n_embd,), "ffn_gate": (p.n_ff, p.n_embd),
        "ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    if il in p.attn_layers:
        head_dim, n_embd_kv = p.attention.head_dim, p.attention.n_embd_k
        shapes |= {"wq": (p.n_embd, p.n_embd), "wk": (n_embd_kv, p.n_embd), "wv": (n_embd_kv, p.n_embd),
                   "wo": (p.n_embd, p.n_embd), "q_norm": (head_dim,), "k_norm": (head_dim,)}
    else:
        shapes |= shortconv_shapes(p.shortconv)
    return shapes


class Lfm2Model(HybridModel):
    """An LFM2 language model on a ``HybridCache`` (``HybridModel``)."""

    hparams: Lfm2HParams

    def __init__(self, hparams: Lfm2HParams, token_embd: Any, layers: Sequence[dict[str, Any]], output_norm: Any,
                 output: Any = None, dtype: Any = np.float64, vocab: Vocabulary | None = None) -> None:
        shortconv = hparams.shortconv
        self._mixer = lambda xp, *rest: short_conv(xp, shortconv, *rest)
        super().__init__(hparams, token_embd, layers, output_norm, output, dtype, vocab)

    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        return layer_shapes(self.hparams, il)

    def products(self) -> frozenset[str]:
        return _PRODUCTS

    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        p, xp = self.hparams, run.xp
        u = rms_norm(xp, x, p.rms_eps) * w["attn_norm"]
        x = x + (run.attention(il, w, u, p.attention) if il in p.attn_layers else run.recurrent(il, self._mixer, w, u))
        return x + mlp(xp, w, rms_norm(xp, x, p.rms_eps) * w["ffn_norm"])


def random_lfm2_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 4, n_head: int = 4,
                      n_head_kv: int = 2, n_ff: int = 128, l_cache: int = 3, attn_layers: Sequence[int] = (1, 3),
                      conv_bias: bool = False, tied: bool = True, dtype: Any = np.float64) -> Lfm2Model:
    """An LFM2 model with seeded random weights (norm weights near 1, projections ~ 1/sqrt(fan-in))."""
    p = Lfm2HParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                    l_cache=l_cache, attn_layers=tuple(attn_layers), conv_bias=conv_bias)
    rng = np.random.default_rng(seed)
    layers = []
    for il in range(n_layer):
        layer: dict[str, Any] = {}
        for name, shape in layer_shapes(p, il).items():
            layer[name] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                           else rng.standard_normal(shape) / np.sqrt(shape[-1]))
        if il not in p.attn_layers:
            layer |= random_shortconv_weights(rng, p.shortconv)
        layers.append(layer)
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return Lfm2Model(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- Hugging Face checkpoints (transformers' Lfm2ForCausalLM) ----------------------------------------


def _n_ff(checkpoint: Checkpoint) -> int:
    """The MLP's width: transformers' ``Lfm2MLP`` rule from ``intermediate_size`` (``block_ff_dim``) and
    ``block_auto_adjust_ff_dim`` / ``block_ffn_dim_multiplier`` / ``block_multiple_of``."""
    n_ff = int(checkpoint.field("intermediate_size", int, checkpoint.config.get("block_ff_dim")))
    if not checkpoint.field("block_auto_adjust_ff_dim", bool, True):
        return n_ff
    n_ff = int(2 * n_ff / 3)
    multiplier = checkpoint.config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:   # transformers rounds to block_multiple_of only with a multiplier
        n_ff = int(checkpoint.positive_float("block_ffn_dim_multiplier", 1.0, high=MAX_CONFIG_INT) * n_ff)
        multiple = int(checkpoint.field("block_multiple_of", int, 256))
        n_ff = multiple * ((n_ff + multiple - 1) // multiple)
    return n_ff


def _attn_layers(checkpoint: Checkpoint, n_layer: int) -> tuple[int, ...]:
    """The attention layers: ``layer_types``' "full_attention" entries (the rest "conv"), or ``full_attn_idxs``."""
    types = checkpoint.config.get("layer_types")
    if types is None:
        indices = checkpoint.config.get("full_attn_idxs")
        if indices is None:
            return tuple(range(n_layer))
        if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices):
            raise checkpoint.refuse("full_attn_idxs", "not a list of layer indices")
        return tuple(il for il in range(n_layer) if il in indices)
    if not isinstance(types, list) or len(types) != n_layer or any(t not in ("conv", "full_attention") for t in types):
        raise checkpoint.refuse("layer_types", f"not a list of {n_layer} entries \"conv\" or \"full_attention\"")
    return tuple(il for il, kind in enumerate(types) if kind == "full_attention")


def _rope_theta(checkpoint: Checkpoint) -> float:
    """``rope_parameters``' ``rope_theta`` (transformers 5), or ``rope_theta`` (older configs); default rope only."""
    parameters = checkpoint.config.get("rope_parameters")
    if parameters is None:
        return checkpoint.positive_float("rope_theta", 1e6, high=1e30)
    if not isinstance(parameters, dict) or parameters.get("rope_type", "default") != "default":
        raise checkpoint.refuse("rope_parameters", "only the default rope (rope_type \"default\") is supported")
    theta = as_float(parameters.get("rope_theta", 1e6))
    if theta is None or not 0 < theta <= 1e30:
        raise checkpoint.refuse("rope_parameters", "rope_theta is not a number in (0, 1e30]")
    return theta


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> Lfm2Model:
    """The model of an ``Lfm2ForCausalLM`` checkpoint directory (``load_hf``)."""
    field = checkpoint.field
    n_embd, n_layer = field("hidden_size", int), field("num_hidden_layers", int)
    p = built(checkpoint, Lfm2HParams, n_vocab=field("vocab_size", int), n_embd=n_embd, n_layer=n_layer,
              n_head=field("num_attention_heads", int), n_head_kv=field("num_key_value_heads", int),
              n_ff=_n_ff(checkpoint), l_cache=checkpoint.config.get("conv_L_cache", 3),
              attn_layers=_attn_layers(checkpoint, n_layer), rope_theta=_rope_theta(checkpoint),
              rms_eps=checkpoint.positive_float("norm_eps", 1e-5, high=1.0),
              conv_bias=field("conv_bias", bool, False))
    layers = [_hf_layer(checkpoint.layer_tensors(il, "model.layers"), p, il) for il in range(n_layer)]
    token_embd = checkpoint.tensor("model.embed_tokens.weight", (p.n_vocab, n_embd))
    output_norm = checkpoint.tensor("model.embedding_norm.weight", (n_embd,))
    tied = field("tie_word_embeddings", bool, checkpoint.config.get("tie_embedding", True))
    if tied:
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd))
    return built(checkpoint, Lfm2Model, hparams=p, token_embd=token_embd, layers=layers, output_norm=output_norm,
                 output=output, dtype=dtype, vocab=vocab)


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: Lfm2HParams, il: int) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p, il)
    names = {"attn_norm": "operator_norm.weight", "ffn_norm": "ffn_norm.weight", "ffn_gate": "feed_forward.w1.weight",
             "ffn_up": "feed_forward.w3.weight", "ffn_down": "feed_forward.w2.weight"}
    if il in p.attn_layers:
        names |= {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
                  "wo": "self_attn.out_proj.weight", "q_norm": "self_attn.q_layernorm.weight",
                  "k_norm": "self_attn.k_layernorm.weight"}
    layer = {field: weight(name, shapes[field]) for field, name in names.items()}
    if il not in p.attn_layers:
        layer |= shortconv_weights_from_hf(lambda name, shape: weight(f"conv.{name}", shape), p.shortconv)
    return layer


# -- GGUF: llama.cpp's lfm2 (keys and tensor names of its converter, conversion/lfm2.py) -------------------

# Field -> the layer's GGUF tensor (``blk.N.`` + this); the short convolution's from ``_shortconv``.
_GGUF_SUFFIXES = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight", "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight", "ffn_down": "ffn_down.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
    "wv": "attn_v.weight", "wo": "attn_output.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
}


def _gguf_tensors(p: Lfm2HParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every field any layer has -> (GGUF suffix, shape as stored: the numpy shapes, ggml's ``ne`` reversed).
    ``ModelError`` for ``conv_bias``: llama.cpp's lfm2 has no such bias."""
    layout = shortconv_gguf_tensors(p.shortconv)
    for il in range(p.n_layer):
        layout |= {field: (_GGUF_SUFFIXES[field], shape) for field, shape in layer_shapes(p, il).items()
                   if field in _GGUF_SUFFIXES}
    return layout


def _gguf_layout(model: Lfm2Model) -> dict[str, tuple[str, tuple[int, ...]]]:
    return _gguf_tensors(model.hparams)


def _write_gguf_keys(writer: Any, model: Lfm2Model) -> None:
    p = model.hparams
    writer.add_feed_forward_length(p.n_ff)
    writer.add_head_count(p.n_head)
    # llama.cpp tells the layers apart by this: 0 KV heads is a short-convolution layer
    writer.add_head_count_kv([p.n_head_kv if il in p.attn_layers else 0 for il in range(p.n_layer)])
    writer.add_rope_freq_base(p.rope_theta)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_shortconv_l_cache(p.l_cache)


def _per_layer(read: GGUFReader, name: str, n_layer: int) -> list[int]:
    """GGUF key ``name``: one integer, or one per layer."""
    value = read.file.fields.get(f"{read.arch}.{name}")
    values = list(value) if isinstance(value, (list, tuple)) else [read.key(name, int)] * n_layer
    if len(values) != n_layer or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ModelError(f"GGUF key {read.arch}.{name} is {value!r}, not one count or {n_layer} of them")
    return values


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> Lfm2Model:
    """The model of a GGUF file of architecture ``lfm2`` (``load_gguf``)."""
    n_layer = sizes["n_layer"]
    heads_kv = _per_layer(read, "attention.head_count_kv", n_layer)
    n_ffs = set(_per_layer(read, "feed_forward_length", n_layer))
    attn_layers = tuple(il for il, n in enumerate(heads_kv) if n > 0)
    if len(n_ffs) != 1 or len({heads_kv[il] for il in attn_layers}) > 1:
        raise ModelError(f"GGUF keys {ARCH}.feed_forward_length / attention.head_count_kv differ between layers: "
                         "this package reads one width for every layer")
    hparams = Lfm2HParams(**sizes, n_head=read.key("attention.head_count", int),
                          n_head_kv=heads_kv[attn_layers[0]] if attn_layers else 1, n_ff=n_ffs.pop(),
                          l_cache=read.key("shortconv.l_cache", int), attn_layers=attn_layers,
                          rope_theta=read.key("rope.freq_base", float, 10000.0))
    layout = _gguf_tensors(hparams)
    layers = [{field: read.tensor(f"blk.{il}.{layout[field][0]}", shape)
               for field, shape in layer_shapes(hparams, il).items()} for il in range(n_layer)]
    token_embd, output_norm, output = head
    return Lfm2Model(hparams, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


FAMILY = register(Family(label="LFM2", gguf_arch=ARCH, hf_architecture="Lfm2ForCausalLM", model_class=Lfm2Model,
                         from_hf=_from_hf, from_gguf=_from_gguf, gguf_layout=_gguf_layout,
                         write_gguf_keys=_write_gguf_keys, gguf_own_keys=True,
                         gguf_output_norm="token_embd_norm.weight"))
