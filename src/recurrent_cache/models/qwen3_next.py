"""Qwen3-Next: Gated DeltaNet layers and gated attention layers, a mixture of experts with a shared expert
(or a dense MLP) after each, on a ``HybridCache`` — as transformers' ``Qwen3NextForCausalLM`` and llama.cpp's
``qwen3next`` compute it.

Per layer::

    u = rms_norm(x) * attn_norm
    x = x + (attention(u) if the layer is full_attention else gated_deltanet(u))
    x = x + ffn(rms_norm(x) * ffn_norm)       # experts + sigmoid-gated shared expert, or a SwiGLU MLP

Every RMS norm of the model (the layers' two, the final one, attention's per-head q / k norms) multiplies
by ``1 + weight`` in transformers (``Qwen3NextRMSNorm``); the weights here are what the norm multiplies by,
``1 + weight``, as llama.cpp's converter writes them — but for the Gated DeltaNet's own gated norm, whose
weight is used as it is.  Attention: q_proj gives per head the query then an output gate (``sigmoid``
before o_proj), q / k RMS-normed per head, neox rope over the first ``partial_rotary_factor`` of each head.
The Gated DeltaNet layer is ``_deltanet.gated_deltanet`` (its module docstring has the math and the state
layout, llama.cpp's).  The router takes the softmax's top ``num_experts_per_tok`` experts, renormalised
when ``norm_topk_prob``.  Which layers attend follows ``layer_types``; which use experts, transformers'
rule: not in ``mlp_only_layers``, ``num_experts > 0`` and ``(il + 1) % decoder_sparse_step == 0``.
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
from ._deltanet import GGUF_TENSORS as DELTANET_TENSORS
from ._deltanet import PRODUCTS as DELTANET_PRODUCTS
from ._deltanet import (DeltaNetParams, deltanet_weights_from_gguf, deltanet_weights_from_hf, gated_deltanet,
                        random_deltanet_weights, weight_shapes)
from ._ffn import EXPERT_PRODUCTS, MoeParams, mlp, moe
from ._registry import Family, register
from ._ssm import random_head, rms_norm
from ._storage import StateStorage
from .gguf_io import GGUFReader
from .hf import Checkpoint, as_float, built
from .hybrid_model import HybridModel, LayerRun
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["Qwen3NextHParams", "Qwen3NextModel", "random_qwen3_next_model"]

ARCH = "qwen3next"

_ATTENTION = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
              "q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}
_MLP = {"ffn_gate": "gate_proj.weight", "ffn_up": "up_proj.weight", "ffn_down": "down_proj.weight"}
# llama.cpp's GGUF tensor of a field (``blk.N.`` + this) where it is not the field's name + ".weight"
# (``conversion/qwen.py``, ``llama-arch.cpp``); the Gated DeltaNet's are ``_deltanet.GGUF_TENSORS``
_GGUF_NAMES = {"ffn_norm": "post_attention_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
               "wv": "attn_v.weight", "wo": "attn_output.weight", "q_norm": "attn_q_norm.weight",
               "k_norm": "attn_k_norm.weight"}
_PRODUCTS = DELTANET_PRODUCTS | frozenset({"wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp",
                                           "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}) | EXPERT_PRODUCTS


@dataclass(frozen=True)
class Qwen3NextHParams:
    """The sizes of a Qwen3-Next model (transformers' ``Qwen3NextConfig``; llama.cpp's ``qwen3next.*`` keys)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int                  # rotated values of each head: head_dim * partial_rotary_factor
    deltanet: DeltaNetParams
    attn_layers: tuple[int, ...]
    moe_layers: tuple[int, ...] = ()
    n_ff: int = 1               # the dense MLP's width (intermediate_size)
    n_ff_exp: int = 1           # an expert's (moe_intermediate_size)
    n_ff_shexp: int = 1         # the shared expert's (shared_expert_intermediate_size)
    n_expert: int = 1
    n_expert_used: int = 1
    norm_top_k: bool = True
    rope_base: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "n_ff_exp",
                           "n_ff_shexp", "n_expert", "n_expert_used"))
        for name in ("attn_layers", "moe_layers"):
            layers = getattr(self, name)
            if any(not 0 <= il < self.n_layer for il in layers):
                raise ModelError(f"{name} {layers} name layers outside [0, {self.n_layer})")
        if self.deltanet.n_embd != self.n_embd:
            raise ModelError(f"the Gated DeltaNet's n_embd {self.deltanet.n_embd} is not the model's {self.n_embd}")
        try:
            self.attention   # noqa: B018 — its checks (n_rot, heads) now, not at the first forward
            if self.moe_layers:
                MoeParams(self.n_expert, self.n_expert_used, self.norm_top_k)
        except ConfigError as exc:
            raise ModelError(str(exc)) from None

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if il not in self.attn_layers)

    @cached_property
    def attention(self) -> AttentionParams:
        rope = Rope("neox", self.n_rot, self.rope_base) if self.n_rot else Rope()
        return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, self.head_dim, rope=rope,
                               norm_eps=self.rms_eps, gated=True)

    @property
    def n_embd_r(self) -> int:
        return self.deltanet.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.deltanet.n_embd_s

    def describe(self) -> str:
        d = self.deltanet
        return (f"Qwen3-Next, {self.n_layer} layers (attention {list(self.attn_layers)}, experts "
                f"{list(self.moe_layers)}: {self.n_expert_used} of {self.n_expert}), n_embd {self.n_embd}, "
                f"Gated DeltaNet {d.n_k_heads} key heads of {d.head_k_dim}, {d.n_v_heads} value heads of "
                f"{d.head_v_dim}, vocab {self.n_vocab}")


def layer_shapes(p: Qwen3NextHParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer ``il``'s weight fields and their numpy shapes (ggml's ``ne`` reversed)."""
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (p.n_embd,), "ffn_norm": (p.n_embd,)}
    if il in p.attn_layers:
        n_q, n_kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
        shapes |= {"wq": (2 * n_q, p.n_embd), "wk": (n_kv, p.n_embd), "wv": (n_kv, p.n_embd),
                   "wo": (p.n_embd, n_q), "q_norm": (p.head_dim,), "k_norm": (p.head_dim,)}
    else:
        shapes |= weight_shapes(p.deltanet)
    if il in p.moe_layers:
        shapes |= {"ffn_gate_inp": (p.n_expert, p.n_embd), "ffn_gate_exps": (p.n_expert, p.n_ff_exp, p.n_embd),
                   "ffn_up_exps": (p.n_expert, p.n_ff_exp, p.n_embd),
                   "ffn_down_exps": (p.n_expert, p.n_embd, p.n_ff_exp),
                   "ffn_gate_shexp": (p.n_ff_shexp, p.n_embd), "ffn_up_shexp": (p.n_ff_shexp, p.n_embd),
                   "ffn_down_shexp": (p.n_embd, p.n_ff_shexp), "ffn_gate_inp_shexp": (p.n_embd,)}
    else:
        shapes |= {"ffn_gate": (p.n_ff, p.n_embd), "ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    return shapes


class Qwen3NextModel(HybridModel):
    """A Qwen3-Next language model on a ``HybridCache`` (``HybridModel``)."""

    hparams: Qwen3NextHParams

    def __init__(self, hparams: Qwen3NextHParams, token_embd: Any, layers: Sequence[dict[str, Any]],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        self._moe = (MoeParams(hparams.n_expert, hparams.n_expert_used, hparams.norm_top_k)
                     if hparams.moe_layers else None)
        super().__init__(hparams, token_embd, layers, output_norm, output, dtype, vocab)

    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        return layer_shapes(self.hparams, il)

    def products(self) -> frozenset[str]:
        return _PRODUCTS

    def _deltanet(self, xp: Any, w: dict[str, Array], u: Array, conv: Array, ssm: Array, storage_r: StateStorage,
                  storage_s: StateStorage, m: int) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
        """``gated_deltanet`` of this model's sizes (a ``FlatMixer``)."""
        return gated_deltanet(xp, self.hparams.deltanet, w, u, conv, ssm, storage_r, storage_s, m)

    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        p, xp = self.hparams, run.xp
        u = rms_norm(xp, x, p.rms_eps) * w["attn_norm"]
        x = x + (run.attention(il, w, u, p.attention) if il in p.attn_layers
                 else run.recurrent(il, self._deltanet, w, u))
        u = rms_norm(xp, x, p.rms_eps) * w["ffn_norm"]
        return x + (moe(xp, w, u, self._moe) if self._moe is not None and il in p.moe_layers else mlp(xp, w, u))


def random_qwen3_next_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 4,
                            n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16, n_k_heads: int = 2,
                            n_v_heads: int = 4, head_k_dim: int = 16, head_v_dim: int = 16, d_conv: int = 4,
                            attn_layers: Sequence[int] = (3,), moe_layers: Sequence[int] = (0, 1, 3),
                            n_expert: int = 4, n_expert_used: int = 2, n_ff: int = 128, n_ff_exp: int = 32,
                            tied: bool = False, dtype: Any = np.float64) -> Qwen3NextModel:
    """A Qwen3-Next model with seeded random weights (a quarter of each attention head rotated)."""
    deltanet = DeltaNetParams(n_embd=n_embd, d_conv=d_conv, n_k_heads=n_k_heads, n_v_heads=n_v_heads,
                              head_k_dim=head_k_dim, head_v_dim=head_v_dim)
    p = Qwen3NextHParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, n_rot=head_dim // 4, deltanet=deltanet, attn_layers=tuple(attn_layers),
                         moe_layers=tuple(moe_layers), n_ff=n_ff, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_exp,
                         n_expert=n_expert, n_expert_used=n_expert_used)
    rng = np.random.default_rng(seed)
    layers = []
    for il in range(n_layer):
        layer: dict[str, Any] = {}
        for name, shape in layer_shapes(p, il).items():
            layer[name] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
                           else rng.standard_normal(shape) / np.sqrt(shape[-1]))
        if il not in p.attn_layers:
            layer |= random_deltanet_weights(rng, deltanet)
        layers.append(layer)
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return Qwen3NextModel(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- Hugging Face checkpoints (transformers' Qwen3NextForCausalLM) --------------------------------------


def _layer_kinds(checkpoint: Checkpoint, n_layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The attention layers (``layer_types``) and the expert layers (transformers' rule)."""
    layer_types = checkpoint.config.get("layer_types")
    if layer_types is None:   # transformers' default: every full_attention_interval-th layer attends
        interval = checkpoint.field("full_attention_interval", int, 4)
        layer_types = ["full_attention" if (il + 1) % interval == 0 else "linear_attention" for il in range(n_layer)]
    if (not isinstance(layer_types, list) or len(layer_types) != n_layer
            or any(kind not in ("full_attention", "linear_attention") for kind in layer_types)):
        raise checkpoint.refuse("layer_types", f"not a list of {n_layer} 'full_attention' / 'linear_attention'")
    mlp_only = checkpoint.config.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(isinstance(il, bool) or not isinstance(il, int) for il in mlp_only):
        raise checkpoint.refuse("mlp_only_layers", "not a list of layer numbers")
    n_expert = checkpoint.config.get("num_experts", 512)
    step = checkpoint.field("decoder_sparse_step", int, 1)
    experts = isinstance(n_expert, int) and n_expert > 0
    return (tuple(il for il, kind in enumerate(layer_types) if kind == "full_attention"),
            tuple(il for il in range(n_layer) if experts and il not in mlp_only and (il + 1) % step == 0))


def _rope(checkpoint: Checkpoint, head_dim: int) -> tuple[int, float]:
    """n_rot and the frequency base: transformers 5's ``rope_parameters``, or the top-level ``rope_theta`` /
    ``partial_rotary_factor`` of a config saved by transformers 4 (the released checkpoints'); the default rope
    type only."""
    config = checkpoint.config
    rope = config.get("rope_parameters")
    if rope is None:
        if config.get("rope_scaling") is not None:
            raise checkpoint.refuse("rope_scaling", "only the default rope type is supported")
        rope = {key: config[key] for key in ("rope_theta", "partial_rotary_factor") if key in config}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise checkpoint.refuse("rope_parameters", "only the default rope type is supported")
    base, factor = as_float(rope.get("rope_theta", 10000.0)), as_float(rope.get("partial_rotary_factor", 0.25))
    if base is None or base <= 0 or factor is None or not 0 <= factor <= 1:
        raise checkpoint.refuse("rope_parameters", "rope_theta must be positive, partial_rotary_factor in [0, 1]")
    return int(head_dim * factor), base


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> Qwen3NextModel:
    """The model of a ``Qwen3NextForCausalLM`` checkpoint directory (``load_hf``)."""
    field = checkpoint.field
    if field("attention_bias", bool, False):
        raise checkpoint.refuse("attention_bias", "attention biases are not supported (llama.cpp's qwen3next has none)")
    n_embd, n_layer = field("hidden_size", int), field("num_hidden_layers", int)
    head_dim = field("head_dim", int, 256)
    n_rot, rope_base = _rope(checkpoint, head_dim)
    attn_layers, moe_layers = _layer_kinds(checkpoint, n_layer)
    deltanet = built(checkpoint, DeltaNetParams.from_hf_config, config=checkpoint.config)
    p = built(checkpoint, Qwen3NextHParams, n_vocab=field("vocab_size", int), n_embd=n_embd, n_layer=n_layer,
              n_head=field("num_attention_heads", int), n_head_kv=field("num_key_value_heads", int),
              head_dim=head_dim, n_rot=n_rot, deltanet=deltanet, attn_layers=attn_layers, moe_layers=moe_layers,
              n_ff=field("intermediate_size", int, 5632), n_ff_exp=field("moe_intermediate_size", int, 512),
              n_ff_shexp=field("shared_expert_intermediate_size", int, 512),
              n_expert=field("num_experts", int, 512) if moe_layers else 1,
              n_expert_used=field("num_experts_per_tok", int, 10) if moe_layers else 1,
              norm_top_k=field("norm_topk_prob", bool, True), rope_base=rope_base,
              rms_eps=checkpoint.positive_float("rms_norm_eps", 1e-6, high=1.0))
    layers = [_hf_layer(checkpoint.layer_tensors(il, "model.layers"), p, il) for il in range(n_layer)]
    # the multi-token-prediction head of the released checkpoints (mtp.*): a draft model's, not the forward's
    # (llama.cpp's converter keeps it as extra layers its main pass does not run)
    checkpoint.unread -= {name for name in checkpoint.unread if name.startswith("mtp.")}
    token_embd = checkpoint.tensor("model.embed_tokens.weight", (p.n_vocab, n_embd))
    output_norm = 1.0 + checkpoint.tensor("model.norm.weight", (n_embd,)).astype(np.float64)
    tied = field("tie_word_embeddings", bool, False)
    if tied:
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd))
    return built(checkpoint, Qwen3NextModel, hparams=p, token_embd=token_embd, layers=layers, output_norm=output_norm,
                 output=output, dtype=dtype, vocab=vocab)


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: Qwen3NextHParams,
              il: int) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p, il)

    def norm(name: str, field: str) -> np.ndarray:   # Qwen3NextRMSNorm multiplies by 1 + weight
        return 1.0 + weight(name, shapes[field]).astype(np.float64)

    layer = {"attn_norm": norm("input_layernorm.weight", "attn_norm"),
             "ffn_norm": norm("post_attention_layernorm.weight", "ffn_norm")}
    if il in p.attn_layers:
        for field, name in _ATTENTION.items():
            layer[field] = (norm(f"self_attn.{name}", field) if field.endswith("_norm")
                            else weight(f"self_attn.{name}", shapes[field]))
    else:
        layer |= deltanet_weights_from_hf(lambda name, shape: weight(f"linear_attn.{name}", shape), p.deltanet)
    if il in p.moe_layers:
        layer["ffn_gate_inp"] = weight("mlp.gate.weight", shapes["ffn_gate_inp"])
        for field, name in _MLP.items():
            layer[f"{field}_exps"] = np.stack([weight(f"mlp.experts.{e}.{name}", shapes[f"{field}_exps"][1:])
                                               for e in range(p.n_expert)])
            layer[f"{field}_shexp"] = weight(f"mlp.shared_expert.{name}", shapes[f"{field}_shexp"])
        layer["ffn_gate_inp_shexp"] = weight("mlp.shared_expert_gate.weight", shapes["ffn_gate_inp_shexp"])
    else:
        for field, name in _MLP.items():
            layer[field] = weight(f"mlp.{name}", shapes[field])
    return layer


# -- GGUF files (llama.cpp's qwen3next, as its converter writes them) -------------------------------------


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> Qwen3NextModel:
    """The model of a GGUF file of architecture ``qwen3next`` (``load_gguf``).

    The attention layers are those ``attention.recurrent_layers`` marks False (else every
    ``full_attention_interval``-th, as llama.cpp falls back); a layer uses experts where the file has its
    ``ffn_gate_inp`` (llama.cpp's converter writes experts on every layer); the chosen experts' weights are
    renormalised, as llama.cpp always does for qwen3next.
    """
    n_layer, n_embd = sizes["n_layer"], sizes["n_embd"]
    recurrent = read.file.fields.get(f"{read.arch}.attention.recurrent_layers")
    if recurrent is not None:
        if (not isinstance(recurrent, list) or len(recurrent) < n_layer
                or any(not isinstance(flag, bool) for flag in recurrent[:n_layer])):
            raise ModelError(f"GGUF key {read.arch}.attention.recurrent_layers is not {n_layer} booleans")
        attn_layers = tuple(il for il in range(n_layer) if not recurrent[il])
    else:
        interval = read.key("full_attention_interval", int, 4)
        if interval < 1:
            raise ModelError(f"GGUF key {read.arch}.full_attention_interval is {interval}, not a positive interval")
        attn_layers = tuple(il for il in range(n_layer) if (il + 1) % interval == 0)
    moe_layers = tuple(il for il in range(n_layer) if f"blk.{il}.ffn_gate_inp.weight" in read.file.tensors)
    try:
        deltanet = DeltaNetParams.from_gguf(read.key, n_embd, sizes["rms_eps"])
    except ModelError as exc:
        raise ModelError(f"GGUF {read.arch}: {exc}") from None
    p = Qwen3NextHParams(n_vocab=sizes["n_vocab"], n_embd=n_embd, n_layer=n_layer,
                         n_head=read.key("attention.head_count", int),
                         n_head_kv=read.key("attention.head_count_kv", int),
                         head_dim=read.key("attention.key_length", int), n_rot=read.key("rope.dimension_count", int),
                         deltanet=deltanet, attn_layers=attn_layers, moe_layers=moe_layers,
                         n_ff=read.key("feed_forward_length", int, 1),
                         n_ff_exp=read.key("expert_feed_forward_length", int, 1),
                         n_ff_shexp=read.key("expert_shared_feed_forward_length", int, 1),
                         n_expert=read.key("expert_count", int, 1) if moe_layers else 1,
                         n_expert_used=read.key("expert_used_count", int, 1) if moe_layers else 1,
                         norm_top_k=True, rope_base=read.key("rope.freq_base", float, 10000.0),
                         rms_eps=sizes["rms_eps"])
    layers = []
    for il in range(n_layer):
        def tensor(suffix: str, shape: tuple[int, ...], il: int = il) -> np.ndarray | None:
            name = f"blk.{il}.{suffix}"
            return read.tensor(name, shape) if name in read.file.tensors else None
        shapes = layer_shapes(p, il)
        layer = {} if il in p.attn_layers else deltanet_weights_from_gguf(tensor, deltanet)
        for field, shape in shapes.items():
            if field not in layer:
                layer[field] = read.tensor(f"blk.{il}.{_GGUF_NAMES.get(field, field + '.weight')}", shape)
        layers.append(layer)
    token_embd, output_norm, output = head
    return Qwen3NextModel(p, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


def _gguf_layout(model: Qwen3NextModel) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each layer field's tensor and shape in llama.cpp's qwen3next; ``ModelError`` for a model llama.cpp
    would not run as the package does: a dense MLP layer (llama.cpp's qwen3next has experts on every layer),
    experts' weights not renormalised, a Gated DeltaNet that ``DeltaNetParams.gguf_keys`` refuses."""
    p = model.hparams
    dense = [il for il in range(p.n_layer) if il not in p.moe_layers]
    if dense:
        raise ModelError(f"layers {dense} have a dense MLP: llama.cpp's qwen3next runs experts on every layer")
    if not p.norm_top_k:
        raise ModelError("the chosen experts' weights are not renormalised (norm_topk_prob false): llama.cpp's "
                         "qwen3next always renormalises them")
    p.deltanet.gguf_keys()
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for il in range(p.n_layer):
        for field, shape in layer_shapes(p, il).items():
            name = DELTANET_TENSORS.get(field) or _GGUF_NAMES.get(field, f"{field}.weight")
            layout.setdefault(field, (name, shape))
    return layout


def _write_gguf_keys(writer: Any, model: Qwen3NextModel) -> None:
    """Every qwen3next key but those all families write; the attention layers as llama.cpp's per-layer
    ``attention.recurrent_layers`` (False where a layer attends)."""
    p = model.hparams
    keys = {"feed_forward_length": p.n_ff, "attention.head_count": p.n_head, "attention.head_count_kv": p.n_head_kv,
            "attention.key_length": p.head_dim, "attention.value_length": p.head_dim,
            "rope.dimension_count": p.n_rot, "expert_count": p.n_expert, "expert_used_count": p.n_expert_used,
            "expert_feed_forward_length": p.n_ff_exp, "expert_shared_feed_forward_length": p.n_ff_shexp,
            **p.deltanet.gguf_keys()}
    for key, value in keys.items():
        writer.add_uint32(f"{ARCH}.{key}", value)
    writer.add_rope_freq_base(p.rope_base)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_array(f"{ARCH}.attention.recurrent_layers", [il not in p.attn_layers for il in range(p.n_layer)])


FAMILY = register(Family(label="Qwen3-Next", gguf_arch=ARCH, hf_architecture="Qwen3NextForCausalLM",
                         model_class=Qwen3NextModel, from_hf=_from_hf, from_gguf=_from_gguf,
                         gguf_layout=_gguf_layout, write_gguf_keys=_write_gguf_keys, gguf_own_keys=True))
