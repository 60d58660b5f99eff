"""Bamba (IBM) and Granite-4.0-H (transformers' ``GraniteMoeHybridForCausalLM``): Mamba-2 layers and attention
layers, a dense or mixture-of-experts feed-forward after each, on a ``HybridCache`` — as transformers computes
them; llama.cpp runs both as ``granitehybrid``.

Per layer::

    u = rms_norm(x) * attn_norm
    x = x + (attention(u) if the layer attends else mamba2(u))
    x = x + ffn(rms_norm(x) * ffn_norm)

The Mamba-2 block is ``mamba2.mamba2_mixer`` (``n_group`` groups of B / C, the gated norm over each group,
``time_step_limit``).  Attention is GQA with neox rope (transformers' ``rotate_half``) over the first ``n_rot``
values of each head: Bamba rotates the first half (its ``partial_rotary_factor`` is 0.5), Granite-4.0-H the
whole head when ``position_embedding_type`` is "rope" and nothing when it is "nope" / absent.  The
feed-forward is a SwiGLU MLP (Bamba's ``feed_forward``; Granite's ``shared_mlp`` when ``num_local_experts``
is 0) or a mixture of experts plus the shared MLP (Granite: the top ``num_experts_per_tok`` router logits,
softmaxed over themselves — the softmax's top-k renormalised, ``MoeParams.norm_top_k``).

Granite's multipliers, and where they go:

* ``attention_multiplier`` is the attention's score scale (``AttentionParams.scale``; llama.cpp's
  ``attention.scale``);
* ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling`` are folded into the weights at load
  (``fold_multipliers``): the embedding rows times ``embedding_multiplier``; every projection that ends a
  block (``wo`` and ``bo``, ``ssm_out``, ``ffn_down``, ``ffn_down_exps``, ``ffn_down_shexp``) times
  ``residual_multiplier``; ``output_norm`` divided by ``logits_scaling`` (and by ``embedding_multiplier`` too
  when the output is tied to the embeddings, which carry it).  The model computes with no multiplier of its
  own, so its weights are not the checkpoint's where a multiplier is not 1.

Rounding aside, the package equals transformers; transformers itself runs its norms, router and Mamba-2 scan
in float32 even in a float64 model, which bounds the float64 agreement (docs/models.md has the figures).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ConfigError, ModelError
from ._arrays import Array
from ._attention import AttentionParams, Rope
from ._ffn import MoeParams, mlp, moe
from ._registry import Family, register
from ._ssm import rms_norm
from .hf import MAX_CONFIG_INT, Checkpoint, as_float, built
from .hybrid_model import HybridModel, LayerRun, flat_mixer
from .mamba2 import NO_TIME_STEP_LIMIT, Mamba2HParams, mamba2_mixer
from .mamba2 import layer_shapes as mamba2_layer_shapes
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["ARCH", "GGUF_KEYS", "LAYER_TENSORS", "GraniteHybridHParams", "GraniteHybridModel", "fold_multipliers"]

ARCH = "granitehybrid"

# GGUF tensor name of each layer field (``blk.N.`` + this), as llama.cpp's converter writes them.  It stores
# ssm_a / ssm_d as [n_head, 1] and ssm_norm as [n_group, d_inner / n_group] (``mamba2.gguf_layer_shapes``), and
# permutes the rows of attn_q / attn_k for llama.cpp's "normal" rope: "normal" over a file's rows is neox over
# the checkpoint's when the whole head rotates (Granite), not for Bamba's half (``_attention``'s docstring).
LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
    "ssm_in": "ssm_in.weight", "ssm_conv1d": "ssm_conv1d.weight", "ssm_conv1d_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d", "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    "ffn_gate": "ffn_gate.weight", "ffn_up": "ffn_up.weight", "ffn_down": "ffn_down.weight",
    "ffn_gate_inp": "ffn_gate_inp.weight", "ffn_gate_exps": "ffn_gate_exps.weight",
    "ffn_up_exps": "ffn_up_exps.weight", "ffn_down_exps": "ffn_down_exps.weight",
    "ffn_gate_shexp": "ffn_gate_shexp.weight", "ffn_up_shexp": "ffn_up_shexp.weight",
    "ffn_down_shexp": "ffn_down_shexp.weight",
}

# The GGUF key (after ``granitehybrid.``) each hyper-parameter comes from, as llama.cpp reads them
# (``llama_model_granite_hybrid::load_arch_hparams``).  ``attention.head_count_kv`` is an array over the
# layers, 0 on the recurrent ones (``attn_layers`` are the others); ``rope.scaling.finetuned`` false means no
# rope (``n_rot`` 0); the three ``*_scale`` keys are what ``fold_multipliers`` folds.
GGUF_KEYS = {
    "n_embd": "embedding_length", "n_layer": "block_count", "n_ff": "feed_forward_length",
    "n_head": "attention.head_count", "attn_layers": "attention.head_count_kv",
    "rms_eps": "attention.layer_norm_rms_epsilon", "attention_scale": "attention.scale",
    "d_conv": "ssm.conv_kernel", "d_inner": "ssm.inner_size", "d_state": "ssm.state_size",
    "n_ssm_head": "ssm.time_step_rank", "n_group": "ssm.group_count",
    "n_expert": "expert_count", "n_expert_used": "expert_used_count",
    "n_ff_shexp": "expert_shared_feed_forward_length",
    "n_rot": "rope.dimension_count", "rope_base": "rope.freq_base", "rope": "rope.scaling.finetuned",
    "embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
    "logits_scaling": "logit_scale",
}

_ATTENTION = ("wq", "wk", "wv", "wo")
_PRODUCTS = frozenset({"wq", "wk", "wv", "wo", "ssm_in", "ssm_out", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_inp",
                       "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"})
# The projections that end a block: what residual_multiplier scales.
_BLOCK_OUTPUTS = ("wo", "bo", "ssm_out", "ffn_down", "ffn_down_exps", "ffn_down_shexp")


@dataclass(frozen=True)
class GraniteHybridHParams:
    """The sizes of a Bamba or Granite-4.0-H model (transformers' ``BambaConfig`` / ``GraniteMoeHybridConfig``;
    llama.cpp's ``granitehybrid.*`` keys, ``GGUF_KEYS``).  ``n_expert`` 0: a dense MLP of ``n_ff`` on every
    layer; else experts of ``n_ff`` and a shared MLP of ``n_ff_shexp``.  ``n_rot`` 0: no rope."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    d_conv: int
    d_inner: int
    d_state: int
    n_ssm_head: int
    attn_layers: tuple[int, ...]
    n_group: int = 1
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_shexp: int = 0
    n_rot: int = 0
    rope_base: float = 10000.0
    attention_scale: float | None = None
    attention_bias: bool = False
    rms_eps: float = 1e-5
    time_step_limit: tuple[float, float] = field(default=NO_TIME_STEP_LIMIT)

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "d_conv",
                           "d_inner", "d_state", "n_ssm_head", "n_group"))
        if any(not 0 <= il < self.n_layer for il in self.attn_layers):
            raise ModelError(f"attn_layers {self.attn_layers} name layers outside [0, {self.n_layer})")
        if self.n_expert and self.n_ff_shexp < 1:
            raise ModelError(f"a mixture of experts has a shared MLP: n_ff_shexp must be >= 1, got {self.n_ff_shexp}")
        try:   # the parts' own checks: experts used of experts, d_inner by SSM heads, heads by groups and KV heads
            if self.n_expert:
                MoeParams(self.n_expert, self.n_expert_used, norm_top_k=True)
            _ = self.mamba2, self.attention
        except ConfigError as exc:
            raise ModelError(str(exc)) from None

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if il not in self.attn_layers)

    @cached_property
    def attention(self) -> AttentionParams:
        rope = Rope("neox", self.n_rot, self.rope_base) if self.n_rot else Rope()
        return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, self.head_dim, rope,
                               scale=self.attention_scale)

    @cached_property
    def mamba2(self) -> Mamba2HParams:
        return Mamba2HParams(self.n_vocab, self.n_embd, self.n_layer, self.d_conv, self.d_inner, self.d_state,
                             self.n_ssm_head, self.n_group, self.rms_eps, self.time_step_limit)

    @property
    def n_embd_r(self) -> int:
        return self.mamba2.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.mamba2.n_embd_s

    def describe(self) -> str:
        ffn = (f"experts {self.n_expert_used} of {self.n_expert} and a shared MLP" if self.n_expert
               else "dense MLPs")
        return (f"Granite hybrid (Bamba / Granite-4.0-H), {self.n_layer} layers (attention {list(self.attn_layers)}, "
                f"rope over {self.n_rot} of {self.head_dim}), {ffn}, n_embd {self.n_embd}, d_inner {self.d_inner}, "
                f"{self.n_ssm_head} SSM heads, {self.n_group} groups, d_state {self.d_state}, vocab {self.n_vocab}")


def layer_shapes(p: GraniteHybridHParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer ``il``'s weight fields and their numpy shapes (``LAYER_TENSORS`` names their GGUF tensors)."""
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (p.n_embd,), "ffn_norm": (p.n_embd,)}
    if il in p.attn_layers:
        n_q, n_kv = p.n_head * p.head_dim, p.attention.n_embd_k
        shapes |= {"wq": (n_q, p.n_embd), "wk": (n_kv, p.n_embd), "wv": (n_kv, p.n_embd), "wo": (p.n_embd, n_q)}
        if p.attention_bias:
            shapes |= {"bq": (n_q,), "bk": (n_kv,), "bv": (n_kv,), "bo": (p.n_embd,)}
    else:
        shapes |= {name: shape for name, shape in mamba2_layer_shapes(p.mamba2).items() if name != "attn_norm"}
    if p.n_expert:
        shapes |= {"ffn_gate_inp": (p.n_expert, p.n_embd), "ffn_gate_exps": (p.n_expert, p.n_ff, p.n_embd),
                   "ffn_up_exps": (p.n_expert, p.n_ff, p.n_embd), "ffn_down_exps": (p.n_expert, p.n_embd, p.n_ff),
                   "ffn_gate_shexp": (p.n_ff_shexp, p.n_embd), "ffn_up_shexp": (p.n_ff_shexp, p.n_embd),
                   "ffn_down_shexp": (p.n_embd, p.n_ff_shexp)}
    else:
        shapes |= {"ffn_gate": (p.n_ff, p.n_embd), "ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    return shapes


class GraniteHybridModel(HybridModel):
    """A Bamba or Granite-4.0-H language model on a ``HybridCache`` (``HybridModel``), its multipliers folded
    into its weights (``fold_multipliers``)."""

    hparams: GraniteHybridHParams

    def __init__(self, hparams: GraniteHybridHParams, token_embd: Any, layers: Sequence[dict[str, Any]],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        p = hparams
        self._mixer = flat_mixer(lambda *args: mamba2_mixer(args[0], p.mamba2, *args[1:]),
                                 (p.mamba2.conv_channels, p.d_conv - 1), (p.d_inner, p.d_state))
        self._moe = MoeParams(p.n_expert, p.n_expert_used, norm_top_k=True) if p.n_expert else None
        super().__init__(hparams, token_embd, layers, output_norm, output, dtype, vocab)

    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        return layer_shapes(self.hparams, il)

    def products(self) -> frozenset[str]:
        return _PRODUCTS

    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        p, xp = self.hparams, run.xp
        u = rms_norm(xp, x, p.rms_eps) * w["attn_norm"]
        x = x + (run.attention(il, w, u, p.attention) if il in p.attn_layers else run.recurrent(il, self._mixer, w, u))
        u = rms_norm(xp, x, p.rms_eps) * w["ffn_norm"]
        return x + (mlp(xp, w, u) if self._moe is None else moe(xp, w, u, self._moe))


def fold_multipliers(token_embd: np.ndarray, layers: Sequence[dict[str, np.ndarray]], output_norm: np.ndarray,
                     tied: bool, *, embedding: float = 1.0, residual: float = 1.0, logits: float = 1.0
                     ) -> tuple[np.ndarray, list[dict[str, np.ndarray]], np.ndarray]:
    """Granite's ``embedding_multiplier``, ``residual_multiplier`` and ``logits_scaling`` (llama.cpp's
    ``embedding_scale``, ``residual_scale``, ``logit_scale``) folded into the weights, in float64: the
    embedding rows times ``embedding``, each block's closing projection (``wo``, ``bo``, ``ssm_out``,
    ``ffn_down*``) times ``residual``, ``output_norm`` over ``logits`` (and over ``embedding`` when ``tied``:
    the output then reads the scaled embedding rows).  Returns (token_embd, layers, output_norm)."""
    folded_layers = [{name: (np.asarray(values, np.float64) * residual if name in _BLOCK_OUTPUTS else values)
                      for name, values in layer.items()} for layer in layers]
    norm_scale = logits * (embedding if tied else 1.0)
    return (np.asarray(token_embd, np.float64) * embedding, folded_layers,
            np.asarray(output_norm, np.float64) / norm_scale)


# -- Hugging Face checkpoints (transformers' BambaForCausalLM, GraniteMoeHybridForCausalLM) ------------------

_ATTENTION_KINDS = ("attention", "full_attention")   # the legacy name, then transformers 5's
_MAMBA_KINDS = ("mamba", "linear_attention")


def _attn_layers(checkpoint: Checkpoint, n_layer: int, granite: bool) -> tuple[int, ...]:
    """Which layers attend: Granite's ``layer_types`` (all Mamba when absent), Bamba's ``attn_layer_indices``."""
    if granite:
        kinds = checkpoint.config.get("layer_types")
        if kinds is None:
            return ()
        if (not isinstance(kinds, list) or len(kinds) != n_layer
                or any(kind not in _ATTENTION_KINDS + _MAMBA_KINDS for kind in kinds)):
            raise checkpoint.refuse("layer_types", f"not a list of {n_layer} layer kinds "
                                    f"({', '.join(_ATTENTION_KINDS + _MAMBA_KINDS)})")
        return tuple(il for il, kind in enumerate(kinds) if kind in _ATTENTION_KINDS)
    indices = checkpoint.config.get("attn_layer_indices")
    if indices is None:
        return ()
    if (not isinstance(indices, list) or len(set(indices)) != len(indices)
            or any(isinstance(il, bool) or not isinstance(il, int) or not 0 <= il < n_layer for il in indices)):
        raise checkpoint.refuse("attn_layer_indices", f"not a list of distinct layer indices in [0, {n_layer})")
    return tuple(sorted(indices))


def _rope(checkpoint: Checkpoint, head_dim: int, granite: bool) -> tuple[int, float]:
    """(n_rot, rope_base): Bamba rotates ``partial_rotary_factor`` (0.5) of each head, Granite the whole head
    when ``position_embedding_type`` is "rope", nothing when it is "nope" or absent."""
    if granite:
        kind = checkpoint.config.get("position_embedding_type")
        if kind in (None, "nope"):
            return 0, 10000.0
        if kind != "rope":
            raise checkpoint.refuse("position_embedding_type", 'not "rope", "nope" or absent')
    rope = checkpoint.config.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise checkpoint.refuse("rope_parameters", "only the default rope_type is supported")
    base = as_float(rope.get("rope_theta", checkpoint.config.get("rope_theta", 10000.0)))
    factor = as_float(rope.get("partial_rotary_factor", 1.0 if granite else 0.5))
    if base is None or base <= 0 or factor is None or not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise checkpoint.refuse("rope_parameters", "rope_theta must be > 0 and partial_rotary_factor in (0, 1], "
                                "rotating an even number of values per head")
    return int(head_dim * factor), base


def _time_step_limit(checkpoint: Checkpoint) -> tuple[float, float]:
    """``time_step_limit``: a pair [low, high] of numbers, high possibly infinite."""
    limit = checkpoint.config.get("time_step_limit", NO_TIME_STEP_LIMIT)
    if limit is None:
        return NO_TIME_STEP_LIMIT
    low, high = (limit if isinstance(limit, (list, tuple)) and len(limit) == 2 else (None, None))
    low_number, high_number = as_float(low), (as_float(high) if high != float("inf") else high)
    if low_number is None or high_number is None:
        raise checkpoint.refuse("time_step_limit", "not a pair of numbers [low, high], high possibly infinite")
    return low_number, float(high_number)


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> GraniteHybridModel:
    """The model of a ``BambaForCausalLM`` or ``GraniteMoeHybridForCausalLM`` checkpoint directory (``load_hf``)."""
    field_ = checkpoint.field
    granite = checkpoint.family is GRANITE
    if field_("hidden_act", str, "silu") != "silu":
        raise checkpoint.refuse("hidden_act", "only silu is supported (as in llama.cpp)")
    if field_("mamba_proj_bias", bool, False):
        raise checkpoint.refuse("mamba_proj_bias", "in_proj / out_proj biases are not supported (llama.cpp has none)")
    if not granite and field_("mlp_bias", bool, False):
        raise checkpoint.refuse("mlp_bias", "MLP biases are not supported")
    n_embd, n_layer = field_("hidden_size", int), field_("num_hidden_layers", int)
    n_head = field_("num_attention_heads", int)
    head_dim = field_("head_dim", int, n_embd // n_head)
    d_inner = int(checkpoint.positive_float("mamba_expand", 2, high=MAX_CONFIG_INT) * n_embd)
    n_ssm_head = field_("mamba_n_heads", int, 128)
    d_head = checkpoint.config.get("mamba_d_head", "auto")
    if d_head != "auto" and field_("mamba_d_head", int) * n_ssm_head != d_inner:
        raise checkpoint.refuse("mamba_d_head", f"mamba_n_heads × mamba_d_head is not mamba_expand × hidden_size "
                                f"= {d_inner}")
    n_rot, rope_base = _rope(checkpoint, head_dim, granite)
    n_expert = checkpoint.config.get("num_local_experts", 0) if granite else 0
    if isinstance(n_expert, bool) or not isinstance(n_expert, int) or not 0 <= n_expert <= MAX_CONFIG_INT:
        raise checkpoint.refuse("num_local_experts", "not a count of experts (0: a dense MLP)")
    # Bamba's MLP is intermediate_size wide; Granite's experts are, and its shared MLP (the whole
    # feed-forward when there are no experts) is shared_intermediate_size wide
    n_ff = field_("intermediate_size", int)
    n_ff_shared = field_("shared_intermediate_size", int, 1024) if granite else 0
    if granite and not n_expert:
        n_ff, n_ff_shared = n_ff_shared, 0
    attention_scale = checkpoint.positive_float("attention_multiplier", 1.0, high=MAX_CONFIG_INT) if granite else None
    p = built(checkpoint, GraniteHybridHParams, n_vocab=field_("vocab_size", int), n_embd=n_embd, n_layer=n_layer,
              n_head=n_head, n_head_kv=field_("num_key_value_heads", int, n_head), head_dim=head_dim,
              n_ff=n_ff, d_conv=field_("mamba_d_conv", int, 4),
              d_inner=d_inner, d_state=field_("mamba_d_state", int, 256), n_ssm_head=n_ssm_head,
              attn_layers=_attn_layers(checkpoint, n_layer, granite), n_group=field_("mamba_n_groups", int, 1),
              n_expert=n_expert, n_expert_used=field_("num_experts_per_tok", int, 2) if n_expert else 0,
              n_ff_shexp=n_ff_shared, n_rot=n_rot, rope_base=rope_base,
              attention_scale=attention_scale, attention_bias=field_("attention_bias", bool, False),
              rms_eps=checkpoint.positive_float("rms_norm_eps", 1e-6 if granite else 1e-5, high=1.0),
              time_step_limit=_time_step_limit(checkpoint))
    conv_bias = field_("mamba_conv_bias", bool, True)
    layers = [_hf_layer(checkpoint.layer_tensors(il, "model.layers"), p, il, conv_bias, granite)
              for il in range(n_layer)]
    token_embd = checkpoint.tensor("model.embed_tokens.weight", (p.n_vocab, n_embd))
    output_norm = checkpoint.tensor("model.norm.weight" if granite else "model.final_layernorm.weight", (n_embd,))
    tied = field_("tie_word_embeddings", bool, False)
    if tied:
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd))
    if granite:
        token_embd, layers, output_norm = fold_multipliers(
            token_embd, layers, output_norm, tied,
            embedding=checkpoint.positive_float("embedding_multiplier", 1.0, high=MAX_CONFIG_INT),
            residual=checkpoint.positive_float("residual_multiplier", 1.0, high=MAX_CONFIG_INT),
            logits=checkpoint.positive_float("logits_scaling", 1.0, high=MAX_CONFIG_INT))
    return built(checkpoint, GraniteHybridModel, hparams=p, token_embd=token_embd, layers=layers,
                 output_norm=output_norm, output=output, dtype=dtype, vocab=vocab)


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: GraniteHybridHParams, il: int,
              conv_bias: bool, granite: bool) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p, il)
    layer = {"attn_norm": weight("input_layernorm.weight", shapes["attn_norm"]),
             "ffn_norm": weight("post_attention_layernorm.weight" if granite else "pre_ff_layernorm.weight",
                                shapes["ffn_norm"])}
    if il in p.attn_layers:
        for name, hf_name in zip(_ATTENTION, ("q_proj", "k_proj", "v_proj", "o_proj")):
            layer[name] = weight(f"self_attn.{hf_name}.weight", shapes[name])
            if p.attention_bias:
                bias = "b" + name[1]
                layer[bias] = weight(f"self_attn.{hf_name}.bias", shapes[bias])
    else:
        names = {"ssm_in": "in_proj.weight", "ssm_conv1d": "conv1d.weight", "ssm_dt_b": "dt_bias", "ssm_d": "D",
                 "ssm_norm": "norm.weight", "ssm_out": "out_proj.weight"}
        for name, hf_name in names.items():
            layer[name] = weight(f"mamba.{hf_name}", shapes[name])
        layer["ssm_conv1d_b"] = (weight("mamba.conv1d.bias", shapes["ssm_conv1d_b"]) if conv_bias
                                 else np.zeros(shapes["ssm_conv1d_b"], np.float32))
        layer["ssm_a"] = -np.exp(weight("mamba.A_log", shapes["ssm_a"]).astype(np.float64))
    if not granite:
        for name, hf_name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            layer[name] = weight(f"feed_forward.{hf_name}.weight", shapes[name])
        return layer
    # Granite's MLPs hold gate and up as the two halves of one input_linear
    suffix = "_shexp" if p.n_expert else ""
    n_ff = shapes["ffn_down" + suffix][1]
    gate_up = weight("shared_mlp.input_linear.weight", (2 * n_ff, p.n_embd))
    layer["ffn_gate" + suffix], layer["ffn_up" + suffix] = gate_up[:n_ff], gate_up[n_ff:]
    layer["ffn_down" + suffix] = weight("shared_mlp.output_linear.weight", shapes["ffn_down" + suffix])
    if p.n_expert:
        layer["ffn_gate_inp"] = weight("block_sparse_moe.router.layer.weight", shapes["ffn_gate_inp"])
        experts = weight("block_sparse_moe.input_linear.weight", (p.n_expert, 2 * p.n_ff, p.n_embd))
        layer["ffn_gate_exps"], layer["ffn_up_exps"] = experts[:, :p.n_ff], experts[:, p.n_ff:]
        layer["ffn_down_exps"] = weight("block_sparse_moe.output_linear.weight", shapes["ffn_down_exps"])
    return layer


# Granite-4.0-H first: a ``granitehybrid`` GGUF file is read (and a model written) as its family; Bamba is the
# other Hugging Face class of the same llama.cpp architecture.
GRANITE = register(Family(label="Granite-4.0-H", gguf_arch=ARCH, hf_architecture="GraniteMoeHybridForCausalLM",
                          model_class=GraniteHybridModel, from_hf=_from_hf))
BAMBA = register(Family(label="Bamba", gguf_arch=ARCH, hf_architecture="BambaForCausalLM",
                        model_class=GraniteHybridModel, from_hf=_from_hf))
