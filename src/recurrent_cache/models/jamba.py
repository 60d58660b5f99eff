"""Jamba (AI21): Mamba-1 layers and attention layers, a dense or mixture-of-experts MLP after each, on a
``HybridCache`` — as transformers' ``JambaForCausalLM`` and llama.cpp's ``jamba`` compute it.

Per layer::

    u = rms_norm(x) * attn_norm
    x = x + (attention(u) if the layer is an attention layer else mamba(u))
    x = x + ffn(rms_norm(x) * ffn_norm)          # moe on the expert layers, else a SwiGLU MLP

Attention has no positional encoding (GQA, scale 1/sqrt(head_dim)).  The Mamba block is Mamba-1's
(``mamba.mamba_mixer``) with dt, B and C RMS-normed and multiplied by their own weights
(``ssm_dt_norm``, ``ssm_b_norm``, ``ssm_c_norm``).  The router takes the softmax's top
``num_experts_per_tok`` experts with their probabilities as they are (not renormalised).  Which layers
attend and which use experts follow ``attn_layer_period`` / ``attn_layer_offset`` and
``expert_layer_period`` / ``expert_layer_offset``.  The recurrent rows are Mamba-1's (llama.cpp's layout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ModelError
from ._arrays import Array
from ._attention import AttentionParams
from ._ffn import EXPERT_PRODUCTS, MoeParams, mlp, moe
from ._registry import Family, register
from ._ssm import random_conv, random_dt_bias, random_head, rms_norm
from .gguf_io import GGUFReader, layer_layout, write_ssm_sizes
from .hf import MAX_CONFIG_INT, Checkpoint, built
from .hybrid_model import HybridModel, LayerRun, flat_mixer
from .mamba import MambaHParams, mamba_mixer
from .recurrent import check_sizes
from .vocab import Vocabulary

__all__ = ["JambaHParams", "JambaModel", "random_jamba_model"]

ARCH = "jamba"

_ATTENTION = ("wq", "wk", "wv", "wo")
_MAMBA = ("ssm_in", "ssm_conv1d", "ssm_conv1d_b", "ssm_x", "ssm_dt", "ssm_dt_b", "ssm_a", "ssm_d", "ssm_out",
          "ssm_dt_norm", "ssm_b_norm", "ssm_c_norm")
_PRODUCTS = frozenset({"wq", "wk", "wv", "wo", "ssm_in", "ssm_x", "ssm_dt", "ssm_out", "ffn_gate", "ffn_up",
                       "ffn_down", "ffn_gate_inp"}) | EXPERT_PRODUCTS


@dataclass(frozen=True)
class JambaHParams:
    """The sizes of a Jamba model (transformers' ``JambaConfig``; llama.cpp's ``jamba.*`` keys)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    d_conv: int
    d_inner: int
    d_state: int
    dt_rank: int
    attn_layers: tuple[int, ...]
    moe_layers: tuple[int, ...] = ()
    n_expert: int = 1
    n_expert_used: int = 1
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_sizes(self, ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "d_conv", "d_inner",
                           "d_state", "dt_rank", "n_expert", "n_expert_used"))
        for name in ("attn_layers", "moe_layers"):
            layers = getattr(self, name)
            if any(not 0 <= il < self.n_layer for il in layers):
                raise ModelError(f"{name} {layers} name layers outside [0, {self.n_layer})")
        if self.moe_layers:
            MoeParams(self.n_expert, self.n_expert_used)

    @property
    def recr_layers(self) -> tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if il not in self.attn_layers)

    @cached_property
    def attention(self) -> AttentionParams:
        return AttentionParams(self.n_embd, self.n_head, self.n_head_kv, self.n_embd // self.n_head)

    @cached_property
    def mamba(self) -> MambaHParams:
        return MambaHParams(self.n_vocab, self.n_embd, self.n_layer, self.d_conv, self.d_inner, self.d_state,
                            self.dt_rank, self.rms_eps, dt_b_c_rms=True)

    @property
    def n_embd_r(self) -> int:
        return self.mamba.n_embd_r

    @property
    def n_embd_s(self) -> int:
        return self.mamba.n_embd_s

    def describe(self) -> str:
        return (f"Jamba, {self.n_layer} layers (attention {list(self.attn_layers)}, experts "
                f"{list(self.moe_layers)}: {self.n_expert_used} of {self.n_expert}), n_embd {self.n_embd}, "
                f"d_inner {self.d_inner}, d_state {self.d_state}, vocab {self.n_vocab}")


def layer_shapes(p: JambaHParams, il: int) -> dict[str, tuple[int, ...]]:
    """Layer ``il``'s weight fields and their numpy shapes (ggml's ``ne`` reversed)."""
    shapes: dict[str, tuple[int, ...]] = {"attn_norm": (p.n_embd,), "ffn_norm": (p.n_embd,)}
    if il in p.attn_layers:
        n_embd_kv = p.attention.n_embd_k
        shapes |= {"wq": (p.n_embd, p.n_embd), "wk": (n_embd_kv, p.n_embd), "wv": (n_embd_kv, p.n_embd),
                   "wo": (p.n_embd, p.n_embd)}
    else:
        shapes |= {"ssm_in": (2 * p.d_inner, p.n_embd), "ssm_conv1d": (p.d_inner, p.d_conv),
                   "ssm_conv1d_b": (p.d_inner,), "ssm_x": (p.dt_rank + 2 * p.d_state, p.d_inner),
                   "ssm_dt": (p.d_inner, p.dt_rank), "ssm_dt_b": (p.d_inner,), "ssm_a": (p.d_inner, p.d_state),
                   "ssm_d": (p.d_inner,), "ssm_out": (p.n_embd, p.d_inner), "ssm_dt_norm": (p.dt_rank,),
                   "ssm_b_norm": (p.d_state,), "ssm_c_norm": (p.d_state,)}
    if il in p.moe_layers:
        shapes |= {"ffn_gate_inp": (p.n_expert, p.n_embd), "ffn_gate_exps": (p.n_expert, p.n_ff, p.n_embd),
                   "ffn_up_exps": (p.n_expert, p.n_ff, p.n_embd), "ffn_down_exps": (p.n_expert, p.n_embd, p.n_ff)}
    else:
        shapes |= {"ffn_gate": (p.n_ff, p.n_embd), "ffn_up": (p.n_ff, p.n_embd), "ffn_down": (p.n_embd, p.n_ff)}
    return shapes


class JambaModel(HybridModel):
    """A Jamba language model on a ``HybridCache`` (``HybridModel``)."""

    hparams: JambaHParams

    def __init__(self, hparams: JambaHParams, token_embd: Any, layers: Sequence[dict[str, Any]], output_norm: Any,
                 output: Any = None, dtype: Any = np.float64, vocab: Vocabulary | None = None) -> None:
        p = hparams
        self._mixer = flat_mixer(lambda *args: mamba_mixer(args[0], p.mamba, *args[1:]),
                                 (p.d_inner, p.d_conv - 1), (p.d_inner, p.d_state))
        self._moe = MoeParams(p.n_expert, p.n_expert_used) if p.moe_layers else None
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
        return x + (moe(xp, w, u, self._moe) if self._moe is not None and il in p.moe_layers else mlp(xp, w, u))


def random_jamba_model(seed: int = 0, *, n_vocab: int = 256, n_embd: int = 64, n_layer: int = 4, n_head: int = 4,
                       n_head_kv: int = 2, n_ff: int = 128, d_state: int = 16, d_conv: int = 4,
                       attn_layers: Sequence[int] = (1,), moe_layers: Sequence[int] = (1, 3), n_expert: int = 4,
                       n_expert_used: int = 2, tied: bool = False, dtype: Any = np.float64) -> JambaModel:
    """A Jamba model with seeded random weights (the Mamba layers initialised as ``mamba_ssm`` does)."""
    d_inner, dt_rank = 2 * n_embd, math.ceil(n_embd / 16)
    p = JambaHParams(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
                     d_conv=d_conv, d_inner=d_inner, d_state=d_state, dt_rank=dt_rank, attn_layers=tuple(attn_layers),
                     moe_layers=tuple(moe_layers), n_expert=n_expert, n_expert_used=n_expert_used)
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        values: np.ndarray = rng.standard_normal(shape) / np.sqrt(shape[-1])
        return values

    layers = []
    for il in range(n_layer):
        layer: dict[str, Any] = {}
        for name, shape in layer_shapes(p, il).items():
            layer[name] = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else normal(*shape)
        if il not in p.attn_layers:
            layer["ssm_conv1d"], layer["ssm_conv1d_b"] = random_conv(rng, d_inner, d_conv)
            layer["ssm_dt_b"] = random_dt_bias(rng, d_inner)
            layer["ssm_a"] = -np.tile(np.arange(1, d_state + 1, dtype=np.float64), (d_inner, 1))
            layer["ssm_d"] = np.ones(d_inner)
        layers.append(layer)
    token_embd, output_norm, output = random_head(rng, n_vocab, n_embd, tied)
    return JambaModel(p, token_embd, layers, output_norm, output, dtype=dtype)


# -- Hugging Face checkpoints (transformers' JambaForCausalLM) ------------------------------------


def _periodic(checkpoint: Checkpoint, n_layer: int, kind: str, period: int, offset: int) -> tuple[int, ...]:
    """The layers ``il`` with ``il % {kind}_layer_period == {kind}_layer_offset`` (transformers' rule)."""
    period = checkpoint.field(f"{kind}_layer_period", int, period)
    offset = checkpoint.config.get(f"{kind}_layer_offset", offset)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise checkpoint.refuse(f"{kind}_layer_offset", f"not an integer in [0, {kind}_layer_period = {period})")
    return tuple(il for il in range(n_layer) if il % period == offset)


def _from_hf(checkpoint: Checkpoint, dtype: Any, vocab: Vocabulary | None) -> JambaModel:
    """The model of a ``JambaForCausalLM`` checkpoint directory (``load_hf``)."""
    field = checkpoint.field
    if field("hidden_act", str, "silu") != "silu":
        raise checkpoint.refuse("hidden_act", "only silu is supported (as in llama.cpp)")
    if field("mamba_proj_bias", bool, False):
        raise checkpoint.refuse("mamba_proj_bias", "in_proj / out_proj biases are not supported (llama.cpp has none)")
    n_embd, n_layer = field("hidden_size", int), field("num_hidden_layers", int)
    dt_rank = checkpoint.config.get("mamba_dt_rank", "auto")
    dt_rank = math.ceil(n_embd / 16) if dt_rank == "auto" else field("mamba_dt_rank", int)
    n_expert = field("num_experts", int, 16)
    attn_layers = _periodic(checkpoint, n_layer, "attn", 8, 4)
    moe_layers = _periodic(checkpoint, n_layer, "expert", 2, 1) if n_expert > 1 else ()
    p = built(checkpoint, JambaHParams, n_vocab=field("vocab_size", int), n_embd=n_embd, n_layer=n_layer,
              n_head=field("num_attention_heads", int), n_head_kv=field("num_key_value_heads", int),
              n_ff=field("intermediate_size", int), d_conv=field("mamba_d_conv", int, 4),
              d_inner=int(checkpoint.positive_float("mamba_expand", 2, high=MAX_CONFIG_INT) * n_embd),
              d_state=field("mamba_d_state", int, 16), dt_rank=dt_rank, attn_layers=attn_layers,
              moe_layers=moe_layers, n_expert=n_expert, n_expert_used=field("num_experts_per_tok", int, 2),
              rms_eps=checkpoint.positive_float("rms_norm_eps", 1e-6, high=1.0))
    conv_bias = field("mamba_conv_bias", bool, True)
    layers = [_hf_layer(checkpoint.layer_tensors(il, "model.layers"), p, il, conv_bias) for il in range(n_layer)]
    token_embd = checkpoint.tensor("model.embed_tokens.weight", (p.n_vocab, n_embd))
    output_norm = checkpoint.tensor("model.final_layernorm.weight", (n_embd,))
    tied = field("tie_word_embeddings", bool, False)
    if tied:
        checkpoint.unread.discard("lm_head.weight")
    output = None if tied else checkpoint.tensor("lm_head.weight", (p.n_vocab, n_embd))
    return built(checkpoint, JambaModel, hparams=p, token_embd=token_embd, layers=layers, output_norm=output_norm,
                 output=output, dtype=dtype, vocab=vocab)


def _hf_layer(weight: Callable[[str, tuple[int, ...]], np.ndarray], p: JambaHParams, il: int,
              conv_bias: bool) -> dict[str, np.ndarray]:
    shapes = layer_shapes(p, il)
    layer = {"attn_norm": weight("input_layernorm.weight", shapes["attn_norm"]),
             "ffn_norm": weight("pre_ff_layernorm.weight", shapes["ffn_norm"])}
    if il in p.attn_layers:
        for field, name in zip(_ATTENTION, ("q_proj", "k_proj", "v_proj", "o_proj")):
            layer[field] = weight(f"self_attn.{name}.weight", shapes[field])
    else:
        names = {"ssm_in": "in_proj.weight", "ssm_conv1d": "conv1d.weight", "ssm_x": "x_proj.weight",
                 "ssm_dt": "dt_proj.weight", "ssm_dt_b": "dt_proj.bias", "ssm_d": "D", "ssm_out": "out_proj.weight",
                 "ssm_dt_norm": "dt_layernorm.weight", "ssm_b_norm": "b_layernorm.weight",
                 "ssm_c_norm": "c_layernorm.weight"}
        for field, name in names.items():
            layer[field] = weight(f"mamba.{name}", shapes[field])
        layer["ssm_conv1d_b"] = (weight("mamba.conv1d.bias", shapes["ssm_conv1d_b"]) if conv_bias
                                 else np.zeros(shapes["ssm_conv1d_b"], np.float32))
        layer["ssm_a"] = -np.exp(weight("mamba.A_log", shapes["ssm_a"]).astype(np.float64))
    if il in p.moe_layers:
        layer["ffn_gate_inp"] = weight("feed_forward.router.weight", shapes["ffn_gate_inp"])
        for field, name in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
            layer[field] = np.stack([weight(f"feed_forward.experts.{e}.{name}.weight", shapes[field][1:])
                                     for e in range(p.n_expert)])
    else:
        for field, name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            layer[field] = weight(f"feed_forward.{name}.weight", shapes[field])
    return layer


# -- GGUF files (llama.cpp's jamba) ------------------------------------------------------------------------

# llama.cpp's jamba keys (after "jamba.") the hyper-parameters come from; attention.head_count_kv is per layer,
# 0 on a Mamba layer (llama.cpp's converter writes it so, and llama.cpp's loader decides a layer's kind by it)
GGUF_KEYS = {"n_embd": "embedding_length", "n_layer": "block_count", "n_head": "attention.head_count",
             "n_head_kv": "attention.head_count_kv", "n_ff": "feed_forward_length", "d_conv": "ssm.conv_kernel",
             "d_inner": "ssm.inner_size", "d_state": "ssm.state_size", "dt_rank": "ssm.time_step_rank",
             "n_expert": "expert_count", "n_expert_used": "expert_used_count",
             "rms_eps": "attention.layer_norm_rms_epsilon"}


def gguf_layout(p: JambaHParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each layer field's GGUF tensor (after ``blk.{il}.``) and shape as llama.cpp's jamba stores it."""
    return layer_layout([layer_shapes(p, il) for il in range(p.n_layer)])


def _from_gguf(read: GGUFReader, sizes: dict[str, Any], head: tuple[Any, Any, Any], dtype: Any,
               vocab: Vocabulary | None) -> JambaModel:
    """The model of a GGUF file of architecture ``jamba`` (``load_gguf``): attention where the per-layer
    ``head_count_kv`` is above 0, experts where the layer has ``ffn_gate_inp`` (llama.cpp's rules)."""
    n_layer = sizes["n_layer"]
    heads_kv = read.per_layer(GGUF_KEYS["n_head_kv"], n_layer)
    attn_layers = tuple(il for il, n in enumerate(heads_kv) if n > 0)
    widths = sorted({heads_kv[il] for il in attn_layers})
    if len(widths) > 1:
        raise ModelError(f"GGUF key {ARCH}.{GGUF_KEYS['n_head_kv']} is {list(heads_kv)}: attention layers "
                         "of different KV head counts are not supported")
    moe_layers = tuple(il for il in range(n_layer) if read.has(f"blk.{il}.ffn_gate_inp.weight"))
    n_head = read.key(GGUF_KEYS["n_head"], int)
    experts = ({"n_expert": read.key(GGUF_KEYS["n_expert"], int),
                "n_expert_used": read.key(GGUF_KEYS["n_expert_used"], int)} if moe_layers else {})
    p = JambaHParams(**sizes, **read.ssm_sizes(), n_head=n_head, n_head_kv=widths[0] if widths else n_head,
                     n_ff=read.key(GGUF_KEYS["n_ff"], int), dt_rank=read.key(GGUF_KEYS["dt_rank"], int),
                     attn_layers=attn_layers, moe_layers=moe_layers, **experts)
    layout = gguf_layout(p)
    layers = [{field: read.tensor(f"blk.{il}.{layout[field][0]}", shape) for field, shape in
               layer_shapes(p, il).items()} for il in range(n_layer)]
    token_embd, output_norm, output = head
    return JambaModel(p, token_embd, layers, output_norm, output, dtype=dtype, vocab=vocab)


def _gguf_layout(model: JambaModel) -> dict[str, tuple[str, tuple[int, ...]]]:
    p = model.hparams
    if p.d_inner != 2 * p.n_embd:
        raise ModelError(f"d_inner {p.d_inner} is not 2 * n_embd = {2 * p.n_embd}: llama.cpp's jamba runs "
                         "an expansion factor of 2 only")
    return gguf_layout(p)


def _write_gguf_keys(writer: Any, model: JambaModel) -> None:
    """Every jamba key but those all families write (``GGUF_KEYS``; head_count_kv per layer)."""
    p = model.hparams
    writer.add_feed_forward_length(p.n_ff)
    writer.add_head_count(p.n_head)
    writer.add_head_count_kv([p.n_head_kv if il in p.attn_layers else 0 for il in range(p.n_layer)])
    write_ssm_sizes(writer, p)
    writer.add_ssm_time_step_rank(p.dt_rank)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_expert_count(p.n_expert)
    writer.add_expert_used_count(p.n_expert_used)


FAMILY = register(Family(label="Jamba", gguf_arch=ARCH, hf_architecture="JambaForCausalLM", model_class=JambaModel,
                         from_hf=_from_hf, from_gguf=_from_gguf, gguf_layout=_gguf_layout,
                         write_gguf_keys=_write_gguf_keys, gguf_own_keys=True))
