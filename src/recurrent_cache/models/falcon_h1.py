"""Falcon-H1 (TII): attention and Mamba-2 in parallel in every layer, then a SwiGLU MLP, on a ``HybridCache``
— as transformers' ``FalconH1ForCausalLM`` and llama.cpp's ``falcon-h1`` compute it.

Per layer (every layer holds K / V rows and recurrent rows)::

    u = rms_norm(x) * attn_norm
    x = x + attention(u) + mamba2(u)      # neox rope over the whole head; Mamba-2 (mamba2.mamba2_mixer)
    x = x + ffn_down @ (silu(ffn_gate @ v) * (ffn_up @ v)),  v = rms_norm(x) * ffn_norm

transformers scales activations by the config's multipliers; each is a constant factor of a linear map,
so the loader folds every one into the weights it multiplies (as llama.cpp's converter does), and the
forward has none:

    embedding_multiplier        token_embd          lm_head_multiplier          output (the head)
    attention_in_multiplier     wq, wk, wv          key_multiplier              wk and bk
    attention_out_multiplier    wo and bo           ssm_in_multiplier           ssm_in
    ssm_multipliers[0..4]       ssm_in's z, x, B, C, dt rows (transformers' mup_vector)
    ssm_out_multiplier          ssm_out             mlp_multipliers             ffn_gate, ffn_down

With tied embeddings the head is the embedding times ``lm_head_multiplier`` and the input embedding the
embedding times ``embedding_multiplier``: two tensors.  Folding rounds each weight once more (float32
weights: 6e-8 relative), well inside the tolerance.

The Mamba-2 block has ``mamba_n_heads`` heads of ``mamba_d_head`` (d_inner = ``mamba_d_ssm``, which need not
be ``mamba_expand * hidden_size``).  ``mamba_rms_norm`` off (the released checkpoints): its output is only
gated, ``y * silu(z)`` (no ``ssm_norm``, as llama.cpp without the tensor); on: the grouped RMS norm, after the
gate (``mamba_norm_before_gate`` false, llama.cpp's order) or before it (true: transformers' default, which
llama.cpp does not compute).  Biases of the attention projections are read; in / out projection biases
(``mamba_proj_bias``, ``projectors_bias``) and MLP biases are refused.
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
from ._attention import AttentionParams, Rope
from ._ffn import mlp
from ._registry import Family, register
from ._ssm import random_head, rms_norm
from .hf import MAX_CONFIG_INT, Checkpoint, as_float, built
from .hybrid_model import HybridModel, LayerRun, flat_mixer
from .mamba2 import (NO_TIME_STEP_LIMIT, Mamba2HParams, hf_mixer_weights, hf_time_step_limit, mamba2_mixer,
                     random_layer)
from .mamba2 import layer_shapes as mamba2_layer_shapes
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["GGUF_KEYS", "GGUF_TENSORS", "FalconH1HParams", "FalconH1Model", "random_falcon_h1_model"]

ARCH = "falcon-h1"

_ATTENTION_BIASES = ("bq", "bk", "bv", "bo")
_PRODUCTS = frozenset({"wq", "wk", "wv", "wo", "ssm_in", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"})

# llama.cpp's GGUF name of each layer field (``blk.N.`` + this), as its converter writes them, the multipliers
# folded in (for GGUF I/O).  ffn_norm has no ".weight" there (the converter maps the whole name); ssm_a / ssm_d
# are stored [n_head, 1] and ssm_norm [n_group, d_inner / n_group].  llama.cpp reads bq / bk / bv but not bo.
GGUF_TENSORS = {
    "attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
    "ssm_in": "ssm_in.weight", "ssm_conv1d": "ssm_conv1d.weight", "ssm_conv1d_b": "ssm_conv1d.bias",
    "ssm_dt_b": "ssm_dt.bias", "ssm_a": "ssm_a", "ssm_d": "ssm_d", "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    "ffn_gate": "ffn_gate.weight", "ffn_up": "ffn_up.weight", "ffn_down": "ffn_down.weight",
}

# The GGUF key (``falcon-h1.`` + this) each hyper-parameter is read from (llama.cpp's llama-arch.cpp).
GGUF_KEYS = {
    "n_embd": "embedding_length", "n_layer": "block_count", "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv", "head_dim": "attention.key_length", "n_ff": "feed_forward_length",
    "d_conv": "ssm.conv_kernel", "d_inner": "ssm.inner_size", "d_state": "ssm.state_size",
    "n_ssm_head": "ssm.time_step_rank", "n_group": "ssm.group_count", "rms_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
}


@dataclass(frozen=True)
class FalconH1HParams:
    """The sizes of a Falcon-H1 model (transformers' ``FalconH1Config``; llama.cpp's ``falcon-h1.*`` keys).
    ``ssm_norm``: the Mamba block's grouped RMS norm (``mamba_rms_norm``), ``norm_before_gate`` its order;
    ``attention_bias``: q / k / v / o biases."""

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
    n_group: int = 1
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    ssm_norm: bool = False
    norm_before_gate: bool = False
    attention_bias: bool = False
    time_step_limit: tuple[float, float] = NO_TIME_STEP_LIMIT

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "d_conv",
                           "d_inner", "d_state", "n_ssm_head", "n_group"))
        try:   # their own classes check the Mamba-2, attention and rope sizes (built once, kept)
            _ = self.mamba, self.attention
        except ConfigError as exc:
            raise ModelError(str(exc)) from None

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layer))

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(range(self.n_layer))

    @cached_property
    def attention(self) -> AttentionParams:
        return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, self.head_dim,
                               rope=Rope("neox", self.head_dim, self.rope_theta))

    @cached_property
    def mamba(self) -> Mamba2HParams:
        return Mamba2HParams(self.n_vocab, self.n_embd, self.n_layer, self.d_conv, self.d_inner, self.d_state,
                             self.n_ssm_head, self.n_group, self.rms_eps, self.time_step_limit)

    @property
    def n_embd_r(self) -> int:
        return self.mamba.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.mamba.n_embd_s

    def describe(self) -> str:
        norm = ("normed then gated" if self.norm_before_gate else "gated then normed") if self.ssm_norm else "gated"
        return (f"Falcon-H1, {self.n_layer} layers of attention ({self.n_head}/{self.n_head_kv} heads of "
                f"{self.head_dim}, neox rope) beside Mamba-2 ({self.n_ssm_head} heads of "
                f"{self.d_inner // self.n_ssm_head}, {self.n_group} groups, d_state {self.d_state}, {norm}), "
                f"n_embd {self.n_embd}, MLP {self.n_ff}, vocab {self.n_vocab}")


def layer_shapes(p: FalconH1HParams) -> dict[str, tuple[int, ...]]:
    """A layer's weight fields and their numpy shapes (ggml's ``ne`` reversed)."""
    n_q, n_kv = p.n_head * p.head_dim, p.attention.n_embd_k
    shapes = mamba2_layer_shapes(p.mamba) | {
        "ffn_norm": (p.n_embd,),
        "wq": (n_q, p.n_embd), "wk": (n_kv, p.n_embd), "wv": (n_kv, p.n_embd), "wo": (p.n_embd, n_q),
        "ffn_gate": (p.n_ff, p.n_embd), "ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    if not p.ssm_norm:
        del shapes["ssm_norm"]
    if p.attention_bias:
        shapes |= {"bq": (n_q,), "bk": (n_kv,), "bv": (n_kv,), "bo": (p.n_embd,)}
    return shapes


class FalconH1Model(HybridModel):
    """A Falcon-H1 language model on a ``HybridCache`` (``HybridModel``), its multipliers folded into its weights."""

    hparams: FalconH1HParams

    def __init__(self, hparams: FalconH1HParams, token_embd: Any, layers: Sequence[dict[str, Any]],
                 output_norm: Any, output: Any = None, dtype: Any = np.float64,
                 vocab: Vocabulary | None = None) -> None:
        m, before = hparams.mamba, hparams.norm_before_gate
        self._mixer = flat_mixer(lambda *args: mamba2_mixer(args[0], m, *args[1:], norm_before_gate=before),
                                 (m.conv_channels, m.d_conv - 1), (m.d_inner, m.d_state))
        self._shapes = layer_shapes(hparams)
        super().__init__(hparams, token_embd, layers, output_norm, output, dtype, vocab)

    def layer_shapes(self, il: int) -> dict[str, tuple[int, ...]]:
        return self._shapes

    def products(self) -> frozenset[str]:
        return _PRODUCTS

    def block(self, run: LayerRun, il: int, w: dict[str, Array], x: Array) -> Array:
        p, xp = self.hparams, run.xp
        u = rms_norm(xp, x, p.rms_eps) * w["attn_norm"]
        x = x + run.attention(il, w, u, p.attention) + run.recurrent(il, self._mixer, w, u)
        return x + mlp(xp, w, rms_norm(xp, x, p.rms_eps) * w["ffn_norm"])


def random_falcon_h1_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 3, n_head: int = 4,
                           n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 128, d_state: int = 16, d_conv: int = 4,
                           n_ssm_head: int = 8, ssm_head_dim: int = 16, n_group: int = 2, ssm_norm: bool = False,
                           tied: bool = False, dtype: Any = np.float64) -> FalconH1Model:
    """A Falcon-H1 model with seeded random weights (the Mamba blocks initialised as ``mamba_ssm`` does)."""
    p = FalconH1HParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                        head_dim=head_dim, n_ff=n_ff, d_conv=d_conv, d_inner=n_ssm_head * ssm_head_dim,
                        d_state=d_state, n_ssm_head=n_ssm_head, n_group=n_group, ssm_norm=ssm_norm)
    rng = np.random.default_rng(seed)
    layers = [random_layer(rng, layer_shapes(p), n_layer, p.mamba) for _ in range(n_layer)]
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return FalconH1Model(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- Hugging Face checkpoints (transformers' FalconH1ForCausalLM) -----------------------------------


def _multiplier(checkpoint: Checkpoint, name: str) -> float:
    """A scalar multiplier of the config: a finite number (1 when absent)."""
    value = as_float(checkpoint.config.get(name, 1.0))
    if value is None:
        raise checkpoint.refuse(name, "not a finite number")
    return value


def _multipliers(checkpoint: Checkpoint, name: str, count: int) -> list[float]:
    """A list of ``count`` multipliers of the config (all 1 when absent or null, as transformers)."""
    values = checkpoint.config.get(name)
    if values is None:
        return [1.0] * count
    numbers = [as_float(v) for v in values] if isinstance(values, list) else []
    if len(numbers) != count or any(n is None for n in numbers):
        raise checkpoint.refuse(name, f"not a list of {count} finite numbers")
    return [float(n) for n in numbers if n is not None]


def _rope_theta(checkpoint: Checkpoint) -> float:
    """The rope's frequency base: ``rope_parameters`` (transformers >= 5) or ``rope_theta``; only the default
    rope over the whole head (no scaling, no partial rotary)."""
    parameters = checkpoint.config.get("rope_parameters")
    if parameters is None:
        if checkpoint.config.get("rope_scaling") is not None:
            raise checkpoint.refuse("rope_scaling", "only the default rope is supported")
        return checkpoint.positive_float("rope_theta", 10000.0, high=math.inf)
    if not isinstance(parameters, dict) or parameters.get("rope_type", "default") != "default":
        raise checkpoint.refuse("rope_parameters", "only the default rope (rope_type 'default') is supported")
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise checkpoint.refuse("rope_parameters", "a partial rotary factor is not supported")
    theta = as_float(parameters.get("rope_theta", 10000.0))
    if theta is None or theta <= 0:
        raise checkpoint.refuse("rope_parameters", "rope_theta is not a positive number")
    return theta


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> FalconH1Model:
    """The model of a ``FalconH1ForCausalLM`` checkpoint directory (``load_hf``), its multipliers folded."""
    field = checkpoint.field
    if field("hidden_act", str, "silu") != "silu":
        raise checkpoint.refuse("hidden_act", "only silu is supported (as in llama.cpp)")
    for name in ("mamba_proj_bias", "projectors_bias", "mlp_bias"):
        if field(name, bool, False):
            raise checkpoint.refuse(name, "these biases are not supported (llama.cpp has none)")
    n_embd, n_head = field("hidden_size", int), field("num_attention_heads", int)
    n_ssm_head = field("mamba_n_heads", int, 128)
    d_inner = (field("mamba_d_ssm", int) if checkpoint.config.get("mamba_d_ssm") is not None
               else int(checkpoint.positive_float("mamba_expand", 2, high=MAX_CONFIG_INT) * n_embd))
    d_head = checkpoint.config.get("mamba_d_head", "auto")
    if d_head != "auto" and field("mamba_d_head", int) * n_ssm_head != d_inner:
        raise checkpoint.refuse("mamba_d_head", f"mamba_d_head × mamba_n_heads is not d_inner = {d_inner}")
    ssm_norm = field("mamba_rms_norm", bool, False)
    p = built(checkpoint, FalconH1HParams, n_vocab=field("vocab_size", int), n_embd=n_embd,
              n_layer=field("num_hidden_layers", int), n_head=n_head,
              n_head_kv=field("num_key_value_heads", int, n_head),
              head_dim=field("head_dim", int, max(1, n_embd // n_head)), n_ff=field("intermediate_size", int),
              d_conv=field("mamba_d_conv", int, 4), d_inner=d_inner, d_state=field("mamba_d_state", int, 256),
              n_ssm_head=n_ssm_head, n_group=field("mamba_n_groups", int, 1),
              rms_eps=checkpoint.positive_float("rms_norm_eps", 1e-5, high=1.0), rope_theta=_rope_theta(checkpoint),
              ssm_norm=ssm_norm, norm_before_gate=ssm_norm and field("mamba_norm_before_gate", bool, True),
              attention_bias=field("attention_bias", bool, False), time_step_limit=hf_time_step_limit(checkpoint))
    factors = _Factors(checkpoint, p)
    conv_bias = field("mamba_conv_bias", bool, True)
    layers = [_hf_layer(checkpoint.layer_tensors(il, "model.layers"), p, factors, conv_bias)
              for il in range(p.n_layer)]
    embedding = checkpoint.tensor("model.embed_tokens.weight", (p.n_vocab, n_embd)).astype(np.float64)
    output_norm = checkpoint.tensor("model.final_layernorm.weight", (n_embd,))
    if field("tie_word_embeddings", bool, False):
        checkpoint.unread.discard("lm_head.weight")
        head = embedding
    else:
        head = checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd)).astype(np.float64)
    return built(checkpoint, FalconH1Model, hparams=p, token_embd=embedding * factors.embedding,
                 layers=layers, output_norm=output_norm, output=head * factors.lm_head, dtype=dtype, vocab=vocab)


class _Factors:
    """The config's multipliers, as the factors of the weights they fold into."""

    def __init__(self, checkpoint: Checkpoint, p: FalconH1HParams) -> None:
        self.embedding = _multiplier(checkpoint, "embedding_multiplier")
        self.lm_head = _multiplier(checkpoint, "lm_head_multiplier")
        attention_in = _multiplier(checkpoint, "attention_in_multiplier")
        key = _multiplier(checkpoint, "key_multiplier")
        attention_out = _multiplier(checkpoint, "attention_out_multiplier")
        gate, down = _multipliers(checkpoint, "mlp_multipliers", 2)
        # weight field -> (factor of the weight, factor of its bias)
        self.weights = {"wq": (attention_in, 1.0), "wk": (attention_in * key, key), "wv": (attention_in, 1.0),
                        "wo": (attention_out, attention_out), "ffn_gate": (gate, 1.0), "ffn_down": (down, 1.0),
                        "ssm_out": (_multiplier(checkpoint, "ssm_out_multiplier"), 1.0)}
        # transformers' mup_vector: one factor per row of in_proj's z, x, B, C, dt blocks; times ssm_in_multiplier
        z, x, b, c, dt = _multipliers(checkpoint, "ssm_multipliers", 5)
        groups = p.n_group * p.d_state
        self.ssm_in = _multiplier(checkpoint, "ssm_in_multiplier") * np.concatenate(
            [np.full(p.d_inner, z), np.full(p.d_inner, x), np.full(groups, b), np.full(groups, c),
             np.full(p.n_ssm_head, dt)])


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: FalconH1HParams, factors: _Factors,
              conv_bias: bool) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p)

    def read(field: str, name: str) -> np.ndarray:
        return weight(name, shapes[field]).astype(np.float64)

    layer = {"attn_norm": read("attn_norm", "input_layernorm.weight"),
             "ffn_norm": read("ffn_norm", "pre_ff_layernorm.weight")}
    for field, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        layer[field] = read(field, f"self_attn.{name}.weight")
    if p.attention_bias:
        for field, name in zip(_ATTENTION_BIASES, ("q_proj", "k_proj", "v_proj", "o_proj")):
            layer[field] = read(field, f"self_attn.{name}.bias")
    for field, name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
        layer[field] = read(field, f"feed_forward.{name}.weight")
    mixer = hf_mixer_weights(weight, p.mamba, "mamba.", conv_bias, norm=p.ssm_norm)
    layer |= {field: values.astype(np.float64) for field, values in mixer.items()}
    for field, (scale, bias_scale) in factors.weights.items():
        layer[field] = layer[field] * scale
        bias = "b" + field[1:] if field.startswith("w") else None
        if bias in layer:
            layer[bias] = layer[bias] * bias_scale
    layer["ssm_in"] = layer["ssm_in"] * factors.ssm_in[:, None]
    return layer


FAMILY = register(Family(label="Falcon-H1", gguf_arch=ARCH, hf_architecture="FalconH1ForCausalLM",
                         model_class=FalconH1Model, from_hf=_from_hf))
