"""Nemotron-H (NVIDIA): a pattern of Mamba-2, attention and MLP-only layers on a ``HybridCache`` — as
transformers' ``NemotronHForCausalLM`` and llama.cpp's ``nemotron_h`` compute it.

Each layer is one block, a pre-norm and a residual::

    u = rms_norm(x) * attn_norm
    x = x + mamba2(u)            # "M": Mamba-2 with its grouped gated norm (mamba2.mamba2_mixer)
    x = x + attention(u)         # "*": GQA, no positional encoding, scale 1/sqrt(head_dim)
    x = x + ffn_down @ relu(ffn_up @ u)²    # "-": a non-gated MLP (relu², _ffn.mlp)
    x = x + moe(u) + shared(u)   # "E": a mixture of non-gated relu² experts beside a shared one (_ffn.moe)

The layer kinds come from ``hybrid_override_pattern`` (a string of M, *, -, E) or transformers'
``layers_block_type`` ("linear_attention", "full_attention", "mlp", "moe").  MLP and expert layers
hold neither K/V nor recurrent rows.  The Mamba-2 block has ``mamba_num_heads`` heads of
``mamba_head_dim`` (so d_inner need not be ``expand * hidden_size``), ``n_groups`` groups of B / C and
of the gated norm.  The experts' router is a sigmoid; the ``num_experts_per_tok`` largest of its
probabilities plus a choice bias (``e_score_correction_bias``, llama.cpp's ``exp_probs_b``) are taken,
their probabilities (without the bias) renormalised (``norm_topk_prob``) and scaled by
``routed_scaling_factor``.  Group-limited choice (``n_group`` > 1) and latent expert projections
(``moe_latent_size``) are refused by the loader, as llama.cpp computes neither.

transformers computes every RMS norm in float32 (also in a float64 model) and returns float32
logits; the package computes in the model's dtype, so a float64 model differs from transformers
by float32's rounding (within 1e-6 of the largest logit on the test's checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ConfigError, ModelError
from ._arrays import Array
from ._attention import AttentionParams
from ._ffn import MoeParams, mlp, moe
from ._registry import Family, register
from ._ssm import random_head, rms_norm
from .gguf_io import GGUFReader, layer_layout, write_ssm_sizes
from .hf import MAX_CONFIG_INT, Checkpoint, built
from .hybrid_model import HybridModel, LayerRun, flat_mixer
from .mamba2 import (NO_TIME_STEP_LIMIT, Mamba2HParams, hf_mixer_weights, hf_time_step_limit, mamba2_mixer,
                     random_layer)
from .mamba2 import layer_shapes as mamba2_layer_shapes
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["GGUF_KEYS", "GGUF_TENSORS", "LAYER_KINDS", "NemotronHHParams", "NemotronHModel",
           "random_nemotron_h_model"]

ARCH = "nemotron_h"

MAMBA, ATTENTION, MLP, EXPERTS = "M", "*", "-", "E"
LAYER_KINDS = (MAMBA, ATTENTION, MLP, EXPERTS)
# transformers' layers_block_type names of the pattern's characters
_BLOCK_TYPES = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
                "mlp": MLP, "moe": EXPERTS}

_PRODUCTS = frozenset({"wq", "wk", "wv", "wo", "ssm_in", "ssm_out", "ffn_up", "ffn_down", "ffn_gate_inp",
                       "ffn_up_shexp", "ffn_down_shexp"})

# llama.cpp's GGUF name of each layer field (``blk.N.`` + this), as its converter writes them (for GGUF I/O).
# ssm_a / ssm_d are stored [n_head, 1] and ssm_norm [n_group, d_inner / n_group] there.
GGUF_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "ssm_in": "ssm_in.weight", "ssm_conv1d": "ssm_conv1d.weight", "ssm_conv1d_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d", "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
    "ffn_up": "ffn_up.weight", "ffn_down": "ffn_down.weight",
    "ffn_gate_inp": "ffn_gate_inp.weight", "ffn_exp_probs_b": "exp_probs_b.bias",
    "ffn_up_exps": "ffn_up_exps.weight", "ffn_down_exps": "ffn_down_exps.weight",
    "ffn_up_shexp": "ffn_up_shexp.weight", "ffn_down_shexp": "ffn_down_shexp.weight",
}

# The GGUF key (``nemotron_h.`` + this) each hyper-parameter is read from (llama.cpp's llama-arch.cpp).  The
# layer kinds are per-layer arrays: attention.head_count_kv is 0 on Mamba and MLP layers, feed_forward_length
# is 0 on Mamba and attention layers (a layer with both 0 is a Mamba layer).  A model with expert layers is
# llama.cpp's ``nemotron_h_moe`` (its converter picks that architecture when the config names experts).
GGUF_KEYS = {
    "n_embd": "embedding_length", "n_head": "attention.head_count", "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length", "n_ff": "feed_forward_length", "d_conv": "ssm.conv_kernel",
    "d_inner": "ssm.inner_size", "d_state": "ssm.state_size", "n_ssm_head": "ssm.time_step_rank",
    "n_group": "ssm.group_count", "rms_eps": "attention.layer_norm_rms_epsilon",
    "n_expert": "expert_count", "n_expert_used": "expert_used_count", "n_ff_exp": "expert_feed_forward_length",
    "n_ff_shexp": "expert_shared_feed_forward_length", "norm_top_k": "expert_weights_norm",
    "expert_scale": "expert_weights_scale",
}


@dataclass(frozen=True)
class NemotronHHParams:
    """The sizes of a Nemotron-H model (transformers' ``NemotronHConfig``; llama.cpp's ``nemotron_h.*`` keys):
    ``pattern`` has one character per layer (M Mamba-2, * attention, - MLP, E experts)."""

    n_vocab: int
    n_embd: int
    pattern: str
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    d_conv: int
    d_inner: int
    d_state: int
    n_ssm_head: int
    n_group: int = 1
    rms_eps: float = 1e-5
    time_step_limit: tuple[float, float] = NO_TIME_STEP_LIMIT
    n_expert: int = 1
    n_expert_used: int = 1
    n_ff_exp: int = 1
    n_ff_shexp: int = 1
    norm_top_k: bool = True
    expert_scale: float = 1.0

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "d_conv", "d_inner",
                           "d_state", "n_ssm_head", "n_group", "n_expert", "n_expert_used", "n_ff_exp", "n_ff_shexp"))
        if not (math.isfinite(self.expert_scale) and self.expert_scale > 0):
            raise ModelError(f"expert_scale must be a positive number, got {self.expert_scale!r}")
        if not self.pattern or set(self.pattern) - set(LAYER_KINDS):
            raise ModelError(f"layer pattern {self.pattern!r} is not a non-empty string of "
                             f"{', '.join(LAYER_KINDS)}")
        try:   # their own classes check the Mamba-2, attention and expert sizes (built once, kept)
            _ = self.mamba, self.attention, self.moe
        except ConfigError as exc:
            raise ModelError(str(exc)) from None

    @property
    def n_layer(self) -> int:
        return len(self.pattern)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(il for il, kind in enumerate(self.pattern) if kind == ATTENTION)

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(il for il, kind in enumerate(self.pattern) if kind == MAMBA)

    @cached_property
    def attention(self) -> AttentionParams:
        return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, self.head_dim)

    @cached_property
    def mamba(self) -> Mamba2HParams:
        return Mamba2HParams(self.n_vocab, self.n_embd, self.n_layer, self.d_conv, self.d_inner, self.d_state,
                             self.n_ssm_head, self.n_group, self.rms_eps, self.time_step_limit)

    @cached_property
    def moe(self) -> MoeParams:
        return MoeParams(self.n_expert, self.n_expert_used, self.norm_top_k, gating="sigmoid",
                         scale=self.expert_scale, activation="relu2")

    @property
    def n_embd_r(self) -> int:
        return self.mamba.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.mamba.n_embd_s

    def describe(self) -> str:
        return (f"Nemotron-H, {self.n_layer} layers ({self.pattern}), n_embd {self.n_embd}, attention "
                f"{self.n_head}/{self.n_head_kv} heads of {self.head_dim}, MLP {self.n_ff}, Mamba-2 "
                f"{self.n_ssm_head} heads of {self.d_inner // self.n_ssm_head}, {self.n_group} groups, "
                f"d_state {self.d_state}, vocab {self.n_vocab}")


def layer_shapes(p: NemotronHHParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer ``il``'s weight fields and their numpy shapes (ggml's ``ne`` reversed)."""
    kind = p.pattern[il]
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (p.n_embd,)}
    if kind == MAMBA:
        shapes = mamba2_layer_shapes(p.mamba)
    elif kind == ATTENTION:
        n_q, n_kv = p.n_head * p.head_dim, p.attention.n_embd_k
        shapes |= {"wq": (n_q, p.n_embd), "wk": (n_kv, p.n_embd), "wv": (n_kv, p.n_embd), "wo": (p.n_embd, n_q)}
    elif kind == MLP:
        shapes |= {"ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    else:
        shapes |= {"ffn_gate_inp": (p.n_expert, p.n_embd), "ffn_exp_probs_b": (p.n_expert,),
                   "ffn_up_exps": (p.n_expert, p.n_ff_exp, p.n_embd),
                   "ffn_down_exps": (p.n_expert, p.n_embd, p.n_ff_exp),
                   "ffn_up_shexp": (p.n_ff_shexp, p.n_embd), "ffn_down_shexp": (p.n_embd, p.n_ff_shexp)}
    return shapes


class NemotronHModel(HybridModel):
    """A Nemotron-H language model on a ``HybridCache`` (``HybridModel``)."""

    hparams: NemotronHHParams

    def __init__(self, hparams: NemotronHHParams, token_embd: Any, layers: Sequence[dict[str, Any]],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        m = hparams.mamba
        self._mixer = flat_mixer(lambda *args: mamba2_mixer(args[0], m, *args[1:]),
                                 (m.conv_channels, m.d_conv - 1), (m.d_inner, m.d_state))
        super().__init__(hparams, token_embd, layers, output_norm, output, dtype, vocab)

    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        return layer_shapes(self.hparams, il)

    def products(self) -> frozenset[str]:
        return _PRODUCTS

    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        p, xp = self.hparams, run.xp
        u = rms_norm(xp, x, p.rms_eps) * w["attn_norm"]
        kind = p.pattern[il]
        if kind == MAMBA:
            return x + run.recurrent(il, self._mixer, w, u)
        if kind == ATTENTION:
            return x + run.attention(il, w, u, p.attention)
        if kind == EXPERTS:
            return x + moe(xp, w, u, p.moe)
        return x + mlp(xp, w, u, activation="relu2")


def random_nemotron_h_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, pattern: str = "M-*M-",
                            n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 128,
                            d_state: int = 16, d_conv: int = 4, n_ssm_head: int = 8, ssm_head_dim: int = 16,
                            n_group: int = 2, tied: bool = False, dtype: Any = np.float64) -> NemotronHModel:
    """A Nemotron-H model with seeded random weights (the Mamba layers initialised as ``mamba_ssm`` does)."""
    p = NemotronHHParams(n_vocab=n_vocab, n_embd=n_embd, pattern=pattern, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, n_ff=n_ff, d_conv=d_conv, d_inner=n_ssm_head * ssm_head_dim,
                         d_state=d_state, n_ssm_head=n_ssm_head, n_group=n_group)
    rng = np.random.default_rng(seed)
    layers = [random_layer(rng, layer_shapes(p, il), p.n_layer, p.mamba if kind == MAMBA else None)
              for il, kind in enumerate(pattern)]
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return NemotronHModel(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- Hugging Face checkpoints (transformers' NemotronHForCausalLM) ----------------------------------


def _pattern(checkpoint: Checkpoint) -> str:
    """The layer kinds of the config: ``layers_block_type`` (transformers >= 5) or ``hybrid_override_pattern``."""
    config = checkpoint.config
    types = config.get("layers_block_type")
    if types is None:
        pattern = checkpoint.field("hybrid_override_pattern", str)
        name, kinds = "hybrid_override_pattern", list(pattern)
    elif isinstance(types, list) and all(isinstance(t, str) for t in types):
        name, kinds = "layers_block_type", types
    else:
        raise checkpoint.refuse("layers_block_type", "not a list of layer type names")
    unknown = sorted({k for k in kinds if k not in _BLOCK_TYPES and k not in LAYER_KINDS})
    if unknown or not kinds:
        raise checkpoint.refuse(name, f"unknown layer kinds {unknown}" if unknown else "no layers")
    return "".join(_BLOCK_TYPES.get(k, k) for k in kinds)


def _expert_sizes(checkpoint: Checkpoint) -> dict[str, Any]:
    """The expert layers' sizes, after refusing what neither llama.cpp nor this package computes."""
    field = checkpoint.field
    if field("n_group", int, 1) != 1:
        raise checkpoint.refuse("n_group", "group-limited expert choice is not supported (llama.cpp has none)")
    if checkpoint.config.get("moe_latent_size") is not None:
        raise checkpoint.refuse("moe_latent_size", "latent expert projections are not supported")
    return dict(n_expert=field("n_routed_experts", int, 8), n_expert_used=field("num_experts_per_tok", int, 2),
                n_ff_exp=field("moe_intermediate_size", int),
                n_ff_shexp=field("moe_shared_expert_intermediate_size", int),
                norm_top_k=field("norm_topk_prob", bool, True),
                expert_scale=checkpoint.positive_float("routed_scaling_factor", 1.0, high=MAX_CONFIG_INT))


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> NemotronHModel:
    """The model of a ``NemotronHForCausalLM`` checkpoint directory (``load_hf``)."""
    field = checkpoint.field
    for name, default in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if field(name, str, default) != default:
            raise checkpoint.refuse(name, f"only {default} is supported (as in llama.cpp)")
    for name in ("mlp_bias", "use_bias", "attention_bias"):
        if field(name, bool, False):
            raise checkpoint.refuse(name, "biases are not supported (transformers' NemotronH has none there)")
    if field("residual_in_fp32", bool, False):
        raise checkpoint.refuse("residual_in_fp32", "a float32 residual stream is not supported")
    pattern = _pattern(checkpoint)
    n_embd, n_head = field("hidden_size", int), field("num_attention_heads", int)
    n_ssm_head = field("mamba_num_heads", int, 128)
    experts = _expert_sizes(checkpoint) if EXPERTS in pattern else {}
    p = built(checkpoint, NemotronHHParams, n_vocab=field("vocab_size", int), n_embd=n_embd, pattern=pattern,
              n_head=n_head, n_head_kv=field("num_key_value_heads", int, n_head),
              head_dim=field("head_dim", int, max(1, n_embd // n_head)), n_ff=field("intermediate_size", int),
              d_conv=field("conv_kernel", int, 4), d_inner=n_ssm_head * field("mamba_head_dim", int, 64),
              d_state=field("ssm_state_size", int, 128), n_ssm_head=n_ssm_head, n_group=field("n_groups", int, 8),
              rms_eps=checkpoint.positive_float("layer_norm_epsilon", 1e-5, high=1.0),
              time_step_limit=hf_time_step_limit(checkpoint), **experts)
    prefix = "backbone" if checkpoint.has("backbone.embeddings.weight") else "model"
    conv_bias = field("use_conv_bias", bool, True)
    # transformers writes each expert's tensors (experts.{e}.up_proj.weight); its in-memory layout stacks them
    stacked = [checkpoint.has(f"{prefix}.layers.{il}.mixer.experts.up_proj") for il in range(p.n_layer)]
    layers = [_hf_layer(checkpoint.layer_tensors(il, f"{prefix}.layers"), p, il, conv_bias, stacked[il])
              for il in range(p.n_layer)]
    token_embd = checkpoint.tensor(f"{prefix}.embeddings.weight", (p.n_vocab, n_embd))
    output_norm = checkpoint.tensor(f"{prefix}.norm_f.weight", (n_embd,))
    tied = field("tie_word_embeddings", bool, False)
    if tied:
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd))
    return built(checkpoint, NemotronHModel, hparams=p, token_embd=token_embd, layers=layers,
                 output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: NemotronHHParams, il: int,
              conv_bias: bool, stacked_experts: bool) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p, il)
    layer = {"attn_norm": weight("norm.weight", shapes["attn_norm"])}
    kind = p.pattern[il]
    if kind == MAMBA:
        layer |= hf_mixer_weights(weight, p.mamba, "mixer.", conv_bias)
    elif kind == ATTENTION:
        for field, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            layer[field] = weight(f"mixer.{name}.weight", shapes[field])
    elif kind == MLP:
        for field, name in (("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            layer[field] = weight(f"mixer.{name}.weight", shapes[field])
    else:
        names = {"ffn_gate_inp": "gate.weight", "ffn_exp_probs_b": "gate.e_score_correction_bias",
                 "ffn_up_shexp": "shared_experts.up_proj.weight", "ffn_down_shexp": "shared_experts.down_proj.weight"}
        for field, name in names.items():
            layer[field] = weight(f"mixer.{name}", shapes[field])
        for field, name in (("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            layer[field] = (weight(f"mixer.experts.{name}", shapes[field]) if stacked_experts else
                            np.stack([weight(f"mixer.experts.{e}.{name}.weight", shapes[field][1:])
                                      for e in range(p.n_expert)]))
    return layer


# -- GGUF files (llama.cpp's nemotron_h) ------------------------------------------------------------------


def gguf_shapes(p: NemotronHHParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each field as llama.cpp's GGUF stores it, where it differs from ``layer_shapes``."""
    return {"ssm_a": (p.n_ssm_head, 1), "ssm_d": (p.n_ssm_head, 1),
            "ssm_norm": (p.n_group, p.d_inner // p.n_group)}


def _gguf_layout(model: NemotronHModel) -> dict[str, tuple[str, tuple[int, ...]]]:
    p = model.hparams
    if p.mamba.limits_time_step:
        raise ModelError(f"time_step_limit {p.time_step_limit} clamps dt; llama.cpp's nemotron_h does not, "
                         "so the GGUF file would be another model")
    stored = gguf_shapes(p)
    layout = layer_layout([layer_shapes(p, il) for il in range(p.n_layer)])
    return {field: (GGUF_TENSORS[field], stored.get(field, shape)) for field, (_, shape) in layout.items()}


def _write_gguf_keys(writer: Any, model: NemotronHModel) -> None:
    """Every nemotron_h key but those all families write: the layer kinds as llama.cpp's per-layer
    ``feed_forward_length`` (> 0 on MLP layers) and ``attention.head_count_kv`` (> 0 on attention layers)."""
    p = model.hparams
    writer.add_feed_forward_length([p.n_ff if kind == MLP else 0 for kind in p.pattern])
    writer.add_head_count(p.n_head)
    writer.add_head_count_kv([p.n_head_kv if kind == ATTENTION else 0 for kind in p.pattern])
    writer.add_key_length(p.head_dim)
    writer.add_value_length(p.head_dim)
    write_ssm_sizes(writer, p)
    writer.add_ssm_time_step_rank(p.n_ssm_head)
    writer.add_ssm_group_count(p.n_group)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_layer_norm_eps(p.rms_eps)   # llama.cpp requires it (its MTP head's norm); the converter writes both


def _one_width(key: str, values: Sequence[int], layers: Sequence[int]) -> int | None:
    """The one value ``values`` hold on ``layers`` (None without such layers); ``ModelError`` when they differ."""
    widths = sorted({values[il] for il in layers})
    if len(widths) > 1:
        raise ModelError(f"GGUF key {ARCH}.{key} is {list(values)}: layers of different widths are not supported")
    return widths[0] if widths else None


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> NemotronHModel:
    """The model of a GGUF file of architecture ``nemotron_h`` (``load_gguf``): an MLP layer where the per-layer
    ``feed_forward_length`` is above 0, else attention where ``attention.head_count_kv`` is, else Mamba-2
    (llama.cpp's rules)."""
    n_layer, n_embd = sizes["n_layer"], sizes["n_embd"]
    heads_kv = read.per_layer(GGUF_KEYS["n_head_kv"], n_layer)
    n_ffs = read.per_layer(GGUF_KEYS["n_ff"], n_layer)
    pattern = "".join(MLP if ff > 0 else ATTENTION if kv > 0 else MAMBA for kv, ff in zip(heads_kv, n_ffs))
    n_head = read.key(GGUF_KEYS["n_head"], int)
    n_head_kv = _one_width(GGUF_KEYS["n_head_kv"], heads_kv, [i for i, k in enumerate(pattern) if k == ATTENTION])
    n_ff = _one_width(GGUF_KEYS["n_ff"], n_ffs, [i for i, k in enumerate(pattern) if k == MLP])
    p = NemotronHHParams(n_vocab=sizes["n_vocab"], n_embd=n_embd, pattern=pattern, n_head=n_head,
                         n_head_kv=n_head_kv or n_head, head_dim=read.key(GGUF_KEYS["head_dim"], int, n_embd // n_head),
                         n_ff=n_ff or 1, **read.ssm_sizes(), n_ssm_head=read.key(GGUF_KEYS["n_ssm_head"], int),
                         n_group=read.key(GGUF_KEYS["n_group"], int, 1), rms_eps=sizes["rms_eps"])
    stored = gguf_shapes(p)
    layers = []
    for il in range(n_layer):
        layer = {}
        for field, shape in layer_shapes(p, il).items():
            values = read.tensor(f"blk.{il}.{GGUF_TENSORS[field]}", stored.get(field, shape))
            layer[field] = values.reshape(shape) if values.shape == stored.get(field) else values
        layers.append(layer)
    token_embd, output_norm, output = head
    return NemotronHModel(p, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


FAMILY = register(Family(label="Nemotron-H", gguf_arch=ARCH, hf_architecture="NemotronHForCausalLM",
                         model_class=NemotronHModel, from_hf=_from_hf, from_gguf=_from_gguf,
                         gguf_layout=_gguf_layout, write_gguf_keys=_write_gguf_keys, gguf_own_keys=True))
