"""Gated DeltaNet, the recurrent layer of Qwen3-Next, written once against an array namespace ``xp``.

One layer on ``u`` [n_seqs, n_tokens, n_embd] (already normed), per token, with
``Hk`` key heads of ``Dk`` values and ``Hv`` value heads of ``Dv`` (value head
``h`` reads key head ``h // (Hv / Hk)``, transformers' ``repeat_interleave``)::

    qkv     = wqkv @ u                               # q of every key head, k of every key head, v of every value head
    z       = wqkv_gate @ u                          # [Hv, Dv]
    b, a    = split_per_key_head(ssm_beta_alpha @ u) # per key head: Hv/Hk betas, then Hv/Hk alphas
    window  = [conv state ; qkv]                     # per channel: the last d_conv inputs
    qkv     = silu(sum_k window[:, k] * ssm_conv1d[:, k])      # no bias
    q, k, v = split(qkv)
    q, k    = q / |q|, k / |k|                       # per head: x / sqrt(sum(x*x) + l2_eps)
    g       = ssm_a * softplus(a + ssm_dt_b)         # ssm_a = -exp(A_log): log-decay, <= 0
    beta    = sigmoid(b)
    S[h]    = S[h] * exp(g[h])                       # S[h] [Dv, Dk]: the delta rule per value head
    S[h]   += ((v[h] - S[h] @ k[h]) * beta[h]) ⊗ k[h]
    y[h]    = S[h] @ q[h] / sqrt(Dk)
    y[h]    = rms_norm(y[h]) * ssm_norm * silu(z[h]) # the norm before the gate, over each head's Dv values
    out     = ssm_out @ y

**The state, as llama.cpp keeps it** (``src/models/qwen3next.cpp``,
``delta-net-base.cpp``, ``llama_hparams::n_embd_r`` / ``n_embd_s``):

* r row, n_embd_r = (d_conv-1) × conv_channels, conv_channels = 2·Hk·Dk + Hv·Dv
  (llama.cpp's ``ssm_d_inner + 2·ssm_n_group·ssm_d_state``): the last d_conv-1
  inputs of each conv channel, channel-major, oldest first,
  ``r[ch*(d_conv-1) + t]``; the channels in llama.cpp's order (and
  transformers' ``mixed_qkv``): q of key heads 0..Hk-1, then k likewise, then v
  of value heads 0..Hv-1.
* s row, n_embd_s = Hv·Dv·Dk (llama.cpp's ``ssm_d_state · ssm_d_inner``): the
  matrix ``S[h]`` with ``S[h][j, i]`` — j a value index, i a key index — at
  ``s[(h*Dv + j)*Dk + i]``: ggml's ``{Dk, Dv, Hv}`` with the key index fastest,
  as ``ggml_gated_delta_net`` stores it ("state is stored transposed":
  ``s_out[j*S_v + i] = S[i][j]``).  Transformers' ``recurrent_state``
  [Hv, Dk, Dv] is its transpose over the last two axes.

The state is rounded to its storage after every token (the package's policy,
docs/models.md), and each token's projections are computed as a product of
its own row (``_ssm.linear_rows``): on numpy a sequence's outputs and states
are the same bits whatever its ubatch split and whichever sequences share it.

**Where llama.cpp and transformers differ.**  llama.cpp's l2 norm of q and k
uses the model's ``rms_norm_eps`` (``build_gdn_l2_norm``), transformers a
constant 1e-6 (``l2_eps`` here; the same for every released Qwen3-Next,
whose ``rms_norm_eps`` is 1e-6).  llama.cpp asserts Dk == Dv (its GGUF has one
``ssm.state_size`` for both); the math here takes any two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelError
from ._arrays import Array
from ._ffn import sigmoid
from ._scan import delta_step
from ._ssm import (conv_tokens, host_step_rounding, linear_rows, random_conv, random_dt_bias, rms_norm, silu,
                   softplus)
from ._storage import StateStorage
from .hf import MAX_CONFIG_INT, as_float
from .recurrent import check_sizes

__all__ = ["GGUF_TENSORS", "HF_DEFAULTS", "PRODUCTS", "DeltaNetParams", "deltanet_weights_from_gguf",
           "deltanet_weights_from_hf", "delta_rule", "delta_rule_tokens", "gated_deltanet", "gguf_shapes",
           "qkvz_split", "random_deltanet_weights", "weight_shapes"]

# What transformers' Qwen3NextConfig takes for a field config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                               "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6,
                               "hidden_act": "silu"}
# transformers' l2norm of q and k (modeling_qwen3_next.l2norm's eps, not a config field)
HF_L2_EPS = 1e-6


@dataclass(frozen=True)
class DeltaNetParams:
    """The sizes of one Gated DeltaNet layer, with llama.cpp's GGUF key of each (``qwen3next.`` + key)."""

    n_embd: int             # embedding_length
    d_conv: int             # ssm.conv_kernel
    n_k_heads: int          # ssm.group_count
    n_v_heads: int          # ssm.time_step_rank
    head_k_dim: int         # ssm.state_size
    head_v_dim: int         # ssm.inner_size / ssm.time_step_rank (llama.cpp: = head_k_dim)
    rms_eps: float = 1e-6   # attention.layer_norm_rms_epsilon: the gated norm's
    l2_eps: float = HF_L2_EPS  # the l2 norm of q and k (llama.cpp: rms_eps)

    def __post_init__(self) -> None:
        check_sizes(self, ("n_embd", "d_conv", "n_k_heads", "n_v_heads", "head_k_dim", "head_v_dim"))
        if self.n_v_heads % self.n_k_heads:
            raise ModelError(f"n_v_heads {self.n_v_heads} is not a multiple of n_k_heads {self.n_k_heads}")
        if not self.l2_eps > 0:
            raise ModelError(f"l2_eps must be positive, got {self.l2_eps!r}")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> DeltaNetParams:
        """The sizes of transformers' ``Qwen3NextConfig`` (a ``config.json`` as a dict; a field left out takes
        transformers' default), or ``ModelError`` naming the field that is no size, or an activation other
        than silu."""
        def size(name: str) -> int:
            value = config.get(name, HF_DEFAULTS.get(name))
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONFIG_INT:
                raise ModelError(f"config field {name} is {value!r}, not an integer in [1, 2**31)")
            return value

        eps = as_float(config.get("rms_norm_eps", HF_DEFAULTS["rms_norm_eps"]))
        if eps is None or eps <= 0:
            raise ModelError(f"config field rms_norm_eps is {config.get('rms_norm_eps')!r}, not a positive number")
        if config.get("hidden_act", HF_DEFAULTS["hidden_act"]) != "silu":
            # transformers' conv activation is hidden_act; llama.cpp's qwen3next always silu
            raise ModelError(f"config field hidden_act is {config.get('hidden_act')!r}; Gated DeltaNet here "
                             "runs silu (llama.cpp's only one)")
        return cls(n_embd=size("hidden_size"), d_conv=size("linear_conv_kernel_dim"),
                   n_k_heads=size("linear_num_key_heads"), n_v_heads=size("linear_num_value_heads"),
                   head_k_dim=size("linear_key_head_dim"), head_v_dim=size("linear_value_head_dim"), rms_eps=eps)

    @classmethod
    def from_gguf(cls, key: Callable[[str, type], Any], n_embd: int, rms_eps: float) -> DeltaNetParams:
        """The sizes of llama.cpp's ``qwen3next`` GGUF keys: ``key(name, kind)`` reads ``<arch>.<name>``
        (``GGUFReader.key``); the l2 norm's epsilon is ``rms_eps``, as llama.cpp computes it."""
        n_v_heads, d_inner = key("ssm.time_step_rank", int), key("ssm.inner_size", int)
        if n_v_heads < 1 or d_inner % n_v_heads:
            raise ModelError(f"GGUF key ssm.inner_size {d_inner} is not a multiple of ssm.time_step_rank {n_v_heads}")
        return cls(n_embd=n_embd, d_conv=key("ssm.conv_kernel", int), n_k_heads=key("ssm.group_count", int),
                   n_v_heads=n_v_heads, head_k_dim=key("ssm.state_size", int), head_v_dim=d_inner // n_v_heads,
                   rms_eps=rms_eps, l2_eps=rms_eps)

    def gguf_keys(self) -> dict[str, int]:
        """llama.cpp's ``qwen3next`` GGUF keys of these sizes (``<arch>.`` + name), or ``ModelError`` for a layer
        llama.cpp would compute otherwise: Dk != Dv, or an l2 epsilon other than ``rms_eps``."""
        if self.head_k_dim != self.head_v_dim:
            raise ModelError(f"head_k_dim {self.head_k_dim} != head_v_dim {self.head_v_dim}: llama.cpp's qwen3next "
                             "has one ssm.state_size for both")
        if self.l2_eps != self.rms_eps:
            raise ModelError(f"l2_eps {self.l2_eps} != rms_eps {self.rms_eps}: llama.cpp's l2 norm of q and k "
                             "uses rms_eps, so the GGUF file would be another model")
        return {"ssm.conv_kernel": self.d_conv, "ssm.state_size": self.head_k_dim, "ssm.group_count": self.n_k_heads,
                "ssm.time_step_rank": self.n_v_heads, "ssm.inner_size": self.value_dim}

    @property
    def key_dim(self) -> int:
        """q (and k) values of every key head: Hk·Dk."""
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """v (and z, y) values of every value head: Hv·Dv (llama.cpp's ``ssm_d_inner``)."""
        return self.n_v_heads * self.head_v_dim

    @property
    def heads_per_key(self) -> int:
        """Value heads that read one key head."""
        return self.n_v_heads // self.n_k_heads

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: q, k, v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def n_embd_r(self) -> int:
        """Width of a cache r row: the conv window without its newest input."""
        return (self.d_conv - 1) * self.conv_channels

    @property
    def n_embd_s(self) -> int:
        """Width of a cache s row: the matrix ``S[h]`` [Dv, Dk] of every value head."""
        return self.n_v_heads * self.head_v_dim * self.head_k_dim


# The layer's weights (numpy shapes, ``weight_shapes``) and llama.cpp's GGUF tensor of each, ``blk.N.`` + this
# (``conversion/qwen.py``'s Qwen3NextModel; ``llama-arch.cpp``).  GGUF stores each in the same numpy shape
# (ggml's ne reversed); the values are the same but for ``ssm_a``, which the converter writes as -exp(A_log) too.
GGUF_TENSORS = {
    "wqkv": "attn_qkv.weight",
    "wqkv_gate": "attn_gate.weight",
    "ssm_beta_alpha": "ssm_ba.weight",
    "ssm_conv1d": "ssm_conv1d.weight",
    "ssm_dt_b": "ssm_dt.bias",
    "ssm_a": "ssm_a",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
}

# The weights the layer multiplies rows by (a model keeps them in ``_ssm.product_weight``'s layout).
PRODUCTS = frozenset({"wqkv", "wqkv_gate", "ssm_beta_alpha", "ssm_out"})


def weight_shapes(p: DeltaNetParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each weight."""
    return {
        "wqkv": (p.conv_channels, p.n_embd),          # rows: q of every key head, k likewise, v of every value head
        "wqkv_gate": (p.value_dim, p.n_embd),         # z
        "ssm_beta_alpha": (2 * p.n_v_heads, p.n_embd),   # per key head: its value heads' b, then their a
        "ssm_conv1d": (p.conv_channels, p.d_conv),
        "ssm_dt_b": (p.n_v_heads,),
        "ssm_a": (p.n_v_heads,),                      # -exp(A_log)
        "ssm_norm": (p.head_v_dim,),
        "ssm_out": (p.n_embd, p.value_dim),
    }


def gguf_shapes(p: DeltaNetParams) -> dict[str, tuple[int, ...]]:
    """The numpy shape of each weight as llama.cpp's GGUF stores it (by field; the same as ``weight_shapes``)."""
    return weight_shapes(p)


def qkvz_split(qkvz: np.ndarray, p: DeltaNetParams) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``in_proj_qkvz.weight`` (also llama.cpp's legacy ``ssm_in.weight``) [2·Hk·Dk + 2·Hv·Dv, n_embd],
    whose rows go per key head (its q, its k, its value heads' v, their z), as ``wqkv`` and ``wqkv_gate``
    (what llama.cpp's converter writes)."""
    v_per_key = p.heads_per_key * p.head_v_dim
    per_head = qkvz.reshape((p.n_k_heads, 2 * p.head_k_dim + 2 * v_per_key, p.n_embd))
    q = per_head[:, :p.head_k_dim]
    k = per_head[:, p.head_k_dim:2 * p.head_k_dim]
    v = per_head[:, 2 * p.head_k_dim:2 * p.head_k_dim + v_per_key]
    z = per_head[:, 2 * p.head_k_dim + v_per_key:]
    wqkv = np.concatenate([part.reshape((-1, p.n_embd)) for part in (q, k, v)])
    return wqkv, np.ascontiguousarray(z.reshape((p.value_dim, p.n_embd)))


def deltanet_weights_from_hf(weight: Callable[[str, tuple[int, ...]], np.ndarray],
                             p: DeltaNetParams) -> dict[str, np.ndarray]:
    """The weights of transformers' ``Qwen3NextGatedDeltaNet``: ``weight(name, shape)`` reads the layer's tensor
    ``linear_attn.<name>`` (``Checkpoint.layer_tensors``)."""
    wqkv, wqkv_gate = qkvz_split(weight("in_proj_qkvz.weight", (2 * p.key_dim + 2 * p.value_dim, p.n_embd)), p)
    return {
        "wqkv": wqkv,
        "wqkv_gate": wqkv_gate,
        "ssm_beta_alpha": weight("in_proj_ba.weight", (2 * p.n_v_heads, p.n_embd)),
        "ssm_conv1d": weight("conv1d.weight", (p.conv_channels, p.d_conv)),
        "ssm_dt_b": weight("dt_bias", (p.n_v_heads,)),
        "ssm_a": -np.exp(weight("A_log", (p.n_v_heads,)).astype(np.float64)),
        "ssm_norm": weight("norm.weight", (p.head_v_dim,)),
        "ssm_out": weight("out_proj.weight", (p.n_embd, p.value_dim)),
    }


def deltanet_weights_from_gguf(tensor: Callable[[str, tuple[int, ...]], np.ndarray | None],
                               p: DeltaNetParams) -> dict[str, np.ndarray]:
    """The weights of one layer of a llama.cpp GGUF file: ``tensor(suffix, shape)`` reads ``blk.N.<suffix>``, None
    when the file has no such tensor.  A legacy file's ``ssm_in.weight`` (transformers' ``in_proj_qkvz``) stands
    for ``attn_qkv`` and ``attn_gate``."""
    shapes = gguf_shapes(p)

    def required(field: str) -> np.ndarray:
        values = tensor(GGUF_TENSORS[field], shapes[field])
        if values is None:
            raise ModelError(f"tensor {GGUF_TENSORS[field]} of a Gated DeltaNet layer is missing")
        return values
    fused = tensor("attn_qkv.weight", shapes["wqkv"])
    if fused is None:
        legacy = tensor("ssm_in.weight", (2 * p.key_dim + 2 * p.value_dim, p.n_embd))
        if legacy is None:
            raise ModelError("a Gated DeltaNet layer has neither attn_qkv.weight nor ssm_in.weight")
        wqkv, wqkv_gate = qkvz_split(legacy, p)
    else:
        wqkv, wqkv_gate = fused, required("wqkv_gate")
    return {"wqkv": wqkv, "wqkv_gate": wqkv_gate} | {field: required(field) for field in GGUF_TENSORS
                                                      if field not in ("wqkv", "wqkv_gate")}


def random_deltanet_weights(rng: np.random.Generator, p: DeltaNetParams) -> dict[str, np.ndarray]:
    """Seeded random weights of one layer (float64), spread as transformers initialises them: ``A`` uniform in
    [0.01, 16], ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1], the projections ~ 1/sqrt(fan-in)."""
    shapes = weight_shapes(p)
    weights = {name: rng.standard_normal(shapes[name]) / math.sqrt(shapes[name][1])
               for name in ("wqkv", "wqkv_gate", "ssm_beta_alpha", "ssm_out")}
    conv_weight, _ = random_conv(rng, p.conv_channels, p.d_conv)
    return weights | {
        "ssm_conv1d": conv_weight,
        "ssm_dt_b": random_dt_bias(rng, p.n_v_heads),
        "ssm_a": -rng.uniform(0.01, 16.0, size=p.n_v_heads),
        "ssm_norm": 1.0 + 0.1 * rng.standard_normal(p.head_v_dim),
    }


# -- the layer ---------------------------------------------------------------------------------------


def _l2_normed(xp: Any, x: Array, eps: float) -> Array:
    """``x / sqrt(sum(x*x) + eps)`` over the last axis."""
    return x / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule(xp: Any, state: Array, q: Array, k: Array, v: Array, g: Array, beta: Array,
               storage_s: StateStorage, m: int) -> tuple[Array, Array, Array | None]:
    """The gated delta rule, token by token, per value head.

    ``state`` [n, Hv, Dv, Dk] is the state before the first token; ``q``, ``k``
    [n, T, Hk, Dk] (q already scaled; value head h reads key head
    h // (Hv / Hk)), ``v`` [n, T, Hv, Dv], ``g`` (log-decay) and ``beta``
    [n, T, Hv].  The state is rounded to its storage after every token; a
    token's output reads the state before that rounding.  Returns ``y``
    [n, T, Hv, Dv], the state after the last token, and (``m > 0``) the states
    after tokens T-1-m .. T-2, [n, m, Hv, Dv, Dk].

    In host memory (numpy, torch on the CPU; float32 / float64, a state stored
    as its dtype or f32) every token runs the compiled step
    (``_scan.delta_step``: one pass over the state where the array-API math
    makes several), however many tokens the ubatch has, so a sequence's bits
    still do not depend on its split; elsewhere, and as the reference the
    kernel is tested against, ``delta_rule_tokens``.
    """
    round_f32 = host_step_rounding(xp, state, storage_s)
    if round_f32 is None:
        return delta_rule_tokens(xp, state, q, k, v, g, beta, storage_s, m)
    n_tokens = q.shape[1]
    first_step = n_tokens - 1 - m
    # host views (a CPU tensor's memory through __array__, no copy), token-major: each token's inputs C-contiguous
    # (one token's already are)
    host = {name: np.ascontiguousarray(np.moveaxis(np.asarray(a), 1, 0)) for name, a in
            (("q", q), ("k", k), ("v", v), ("decay", xp.exp(g)), ("beta", beta))}
    current = np.ascontiguousarray(np.asarray(state))
    y = np.empty(host["v"].shape, current.dtype)
    steps = []
    for t in range(n_tokens):
        new = np.empty_like(current)
        delta_step(current, host["decay"][t], host["q"][t], host["k"][t], host["v"][t], host["beta"][t], new, y[t],
                   round_f32)
        current = new
        if first_step <= t < n_tokens - 1:
            steps.append(current)
    return (xp.asarray(np.moveaxis(y, 0, 1)), xp.asarray(current),
            xp.asarray(np.stack(steps, axis=1)) if m else None)


def delta_rule_tokens(xp: Any, state: Array, q: Array, k: Array, v: Array, g: Array, beta: Array,
                      storage_s: StateStorage, m: int) -> tuple[Array, Array, Array | None]:
    """``delta_rule`` in the array API, token by token (any device, any storage)."""
    heads_per_key = v.shape[2] // q.shape[2]
    if heads_per_key > 1:   # value head h reads key head h // heads_per_key
        q, k = xp.repeat(q, heads_per_key, axis=2), xp.repeat(k, heads_per_key, axis=2)
    n_tokens = q.shape[1]
    first_step = n_tokens - 1 - m
    ys, steps = [], []
    for t in range(n_tokens):
        k_t = k[:, t, :, :, None]                                   # [n, Hv, Dk, 1]
        s = state * xp.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - (s @ k_t)[..., 0]) * beta[:, t, :, None]   # [n, Hv, Dv]
        s = s + delta[..., :, None] * k[:, t, :, None, :]
        ys.append((s @ q[:, t, :, :, None])[..., 0])
        state = storage_s.round(s)
        if first_step <= t < n_tokens - 1:
            steps.append(state)
    y = ys[0][:, None] if n_tokens == 1 else xp.stack(ys, axis=1)
    return y, state, xp.stack(steps, axis=1) if m else None


def gated_deltanet(xp: Any, p: DeltaNetParams, w: dict[str, Array], u: Array, conv: Array, ssm: Array,
                   storage_r: StateStorage, storage_s: StateStorage, m: int
                   ) -> tuple[Array, Array, Array, tuple[Array, Array] | None]:
    """One Gated DeltaNet layer on ``u`` [n_seqs, n_tokens, n_embd] (already normed), with the layer's weights
    ``w`` (by ``weight_shapes``' names) in namespace ``xp``.

    ``conv`` [n_seqs, n_embd_r] and ``ssm`` [n_seqs, n_embd_s] are the states
    before the first token, decoded to the compute dtype (the module
    docstring gives their layout).  Returns the output to add to the residual
    [n_seqs, n_tokens, n_embd], the states after the last token (flat rows as
    they came), and with ``m > 0`` the states after tokens
    n_tokens-1-m .. n_tokens-2 — (conv [n_seqs, m, n_embd_r], ssm [n_seqs, m,
    n_embd_s]) — else None.
    """
    n_seqs, n_tokens = u.shape[:2]
    n_v, d_k, d_v = p.n_v_heads, p.head_k_dim, p.head_v_dim
    qkv = linear_rows(u, w["wqkv"])
    z = linear_rows(u, w["wqkv_gate"]).reshape((n_seqs, n_tokens, n_v, d_v))
    ba = linear_rows(u, w["ssm_beta_alpha"]).reshape((n_seqs, n_tokens, p.n_k_heads, 2 * p.heads_per_key))
    b = ba[..., :p.heads_per_key].reshape((n_seqs, n_tokens, n_v))
    a = ba[..., p.heads_per_key:].reshape((n_seqs, n_tokens, n_v))

    # Qwen3-Next's conv has no bias.  Its output over several tokens may be channel-major in memory; flattened, it
    # is token-major like a single token's, so the sums over a head below run in one order whatever the split
    mixed, conv_after, conv_steps = conv_tokens(xp, conv.reshape((n_seqs, p.conv_channels, p.d_conv - 1)), qkv,
                                                w["ssm_conv1d"], 0.0, storage_r, m)
    mixed = mixed.reshape((-1,)).reshape((n_seqs, n_tokens, p.conv_channels))
    q = _l2_normed(xp, mixed[..., :p.key_dim].reshape((n_seqs, n_tokens, p.n_k_heads, d_k)), p.l2_eps)
    k = _l2_normed(xp, mixed[..., p.key_dim:2 * p.key_dim].reshape((n_seqs, n_tokens, p.n_k_heads, d_k)), p.l2_eps)
    v = mixed[..., 2 * p.key_dim:].reshape((n_seqs, n_tokens, n_v, d_v))
    g = w["ssm_a"] * softplus(xp, a + w["ssm_dt_b"])
    beta = sigmoid(xp, b)

    state = ssm.reshape((n_seqs, n_v, d_v, d_k))
    y, state, ssm_steps = delta_rule(xp, state, q * (1.0 / math.sqrt(d_k)), k, v, g, beta, storage_s, m)
    gated = rms_norm(xp, y, p.rms_eps) * w["ssm_norm"] * silu(xp, z)
    out = linear_rows(gated.reshape((n_seqs, n_tokens, p.value_dim)), w["ssm_out"])
    steps = (None if conv_steps is None or ssm_steps is None
             else (conv_steps.reshape((n_seqs, m, p.n_embd_r)), ssm_steps.reshape((n_seqs, m, p.n_embd_s))))
    return out, conv_after.reshape((n_seqs, p.n_embd_r)), state.reshape((n_seqs, p.n_embd_s)), steps
