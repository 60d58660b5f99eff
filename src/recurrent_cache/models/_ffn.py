"""The feed-forward blocks of the hybrid families, on an array namespace ``xp``: a dense MLP and a
mixture of experts (with an optional shared expert).

Weights are named as llama.cpp's GGUF tensors (``blk.N.`` + name + ``.weight``)::

    mlp:  ffn_gate [n_ff, n_embd] (absent: not gated), ffn_up [n_ff, n_embd], ffn_down [n_embd, n_ff]
          out = ffn_down @ (act(ffn_gate @ x) * (ffn_up @ x))      gated (SwiGLU: act = silu)
          out = ffn_down @ act(ffn_up @ x)                          not gated (Nemotron-H: act = relu²)
    moe:  ffn_gate_inp [n_expert, n_embd]                          the router
          ffn_gate_exps / ffn_up_exps [n_expert, n_ff, n_embd], ffn_down_exps [n_expert, n_embd, n_ff]
          p = softmax(ffn_gate_inp @ x) (``gating`` "sigmoid": sigmoid(...), Nemotron-H); the
          n_expert_used largest (of p + ffn_exp_probs_b when that choice bias exists), renormalised
          to sum 1 when ``norm_top_k``, times ``scale``; out = sum over them of p_e * expert_e(x)
          (each expert a gated MLP; without ffn_gate_exps a non-gated one, Nemotron-H's relu²)
          shared expert (ffn_*_shexp, optional): its MLP added, times sigmoid(ffn_gate_inp_shexp @ x)
          when that gate exists (Qwen3-Next), else as is (Granite-4.0-H's shared MLP)

Which experts a token uses is decided on the host (one transfer of the router's probabilities per
layer): each chosen expert then multiplies only its own tokens, as transformers and llama.cpp do, so
a decoded token costs n_expert_used experts, not n_expert; one token (decoding one sequence) runs its experts in
turn, without gathers or slots.  Equal to the mixture written out densely (tests/models/test_moe_paths.py) and to
transformers' ``JambaSparseMoeBlock`` / ``Qwen3NextSparseMoeBlock`` within rounding (the families' hf tests);
experts tied in probability are taken in index order (torch.topk's order is unspecified there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._arrays import Array
from ._ssm import linear, silu

__all__ = ["ACTIVATIONS", "EXPERT_PRODUCTS", "GATINGS", "MoeParams", "mlp", "moe", "sigmoid"]

ACTIVATIONS = ("silu", "relu2")
GATINGS = ("softmax", "sigmoid")

# The experts' stacked weights: a model keeps each expert's in ``_ssm.product_weight``'s layout (``products()``),
# which BLAS streams once per product (at 130m shapes an expert's product ~1.4x faster than on [out, in] rows)
EXPERT_PRODUCTS = frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})


def sigmoid(xp: Any, v: Array) -> Array:
    """``1 / (1 + exp(-v))``."""
    return 1.0 / (1.0 + xp.exp(-v))


def _activated(xp: Any, v: Array, activation: str) -> Array:
    if activation == "silu":
        return silu(xp, v)
    relu = xp.maximum(v, 0.0)
    return relu * relu


def mlp(xp: Any, w: dict[str, Array], x: Array, activation: str = "silu", suffix: str = "") -> Array:
    """The dense MLP of ``w``'s ``ffn_gate{suffix}`` (optional), ``ffn_up{suffix}``, ``ffn_down{suffix}`` on
    ``x`` [..., n_embd] (see the module's docstring)."""
    up = linear(x, w["ffn_up" + suffix])
    gate = w.get("ffn_gate" + suffix)
    hidden = _activated(xp, up, activation) if gate is None else _activated(xp, linear(x, gate), activation) * up
    return linear(hidden, w["ffn_down" + suffix])


@dataclass(frozen=True)
class MoeParams:
    """A mixture of ``n_expert`` experts of which each token uses ``n_expert_used``; ``norm_top_k``: the chosen
    probabilities renormalised to sum 1 (Qwen3-Next's ``norm_topk_prob``; Jamba's are not); ``gating``: the
    router's "softmax" or "sigmoid"; ``scale``: the chosen weights' factor (transformers' ``routed_scaling_factor``);
    ``activation``: the experts' and the shared expert's (``mlp``)."""

    n_expert: int
    n_expert_used: int
    norm_top_k: bool = False
    gating: str = "softmax"
    scale: float = 1.0
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.n_expert < 1 or not 1 <= self.n_expert_used <= self.n_expert:
            raise ConfigError(f"a mixture of {self.n_expert} experts cannot use {self.n_expert_used} per token")
        if self.gating not in GATINGS or self.activation not in ACTIVATIONS:
            raise ConfigError(f"gating {self.gating!r} / activation {self.activation!r}: not one of "
                              f"{', '.join(GATINGS)} / {', '.join(ACTIVATIONS)}")


def _expert(xp: Any, w: dict[str, Array], e: int, x: Array, activation: str) -> Array:
    """Expert ``e``'s MLP on rows ``x`` [n, n_embd]: gated (SwiGLU) when ``w`` has ``ffn_gate_exps``."""
    up = linear(x, w["ffn_up_exps"][e])
    if "ffn_gate_exps" in w:
        hidden = _activated(xp, linear(x, w["ffn_gate_exps"][e]), activation) * up
    else:
        hidden = _activated(xp, up, activation)
    return linear(hidden, w["ffn_down_exps"][e])


def moe(xp: Any, w: dict[str, Array], x: Array, params: MoeParams) -> Array:
    """The mixture of experts of ``w`` on ``x`` [..., n_embd] (see the module's docstring)."""
    shape = x.shape
    rows = xp.reshape(x, (-1, shape[-1]))
    n_rows, k = rows.shape[0], params.n_expert_used
    logits = linear(rows, w["ffn_gate_inp"])
    if params.gating == "sigmoid":
        probs = sigmoid(xp, logits)
    else:
        probs = xp.exp(logits - xp.max(logits, axis=-1, keepdims=True))
        probs = probs / xp.sum(probs, axis=-1, keepdims=True)
    # the routing on the host, in the model's dtype (a CPU tensor's memory is not copied)
    host = np.asarray(probs.cpu() if hasattr(probs, "cpu") else probs)
    if "ffn_exp_probs_b" in w:   # the choice bias picks the experts; their weights are the probabilities
        choice = probs + w["ffn_exp_probs_b"]
        host_choice = np.asarray(choice.cpu() if hasattr(choice, "cpu") else choice)
    else:
        host_choice = host
    chosen = np.argsort(-host_choice, axis=1, kind="stable")[:, :k]                   # [n_rows, k]
    weights = np.take_along_axis(host, chosen, axis=1)
    if params.norm_top_k:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    if params.scale != 1.0:
        weights = weights * params.scale
    if n_rows == 1:   # one token (decoding one sequence): its experts in turn, no gathers or scatters
        out = _expert(xp, w, int(chosen[0, 0]), rows, params.activation) * float(weights[0, 0])
        for e, weight in zip(chosen[0, 1:], weights[0, 1:]):
            out = out + _expert(xp, w, int(e), rows, params.activation) * float(weight)
    else:   # each chosen expert on its own tokens, into the token's slot; the slots summed per token
        slots = xp.zeros((n_rows * k, shape[-1]), dtype=x.dtype, device=x.device)
        flat, scales = chosen.reshape(-1), xp.asarray(weights.reshape((-1, 1)), device=x.device)
        for e in np.unique(flat):
            where = np.flatnonzero(flat == e)                   # slot = token * k + position
            slot = xp.asarray(where, device=x.device)
            expert = _expert(xp, w, int(e), rows[xp.asarray(where // k, device=x.device)], params.activation)
            slots[slot] = expert * scales[slot]
        out = xp.sum(xp.reshape(slots, (n_rows, k, shape[-1])), axis=1)
    if "ffn_up_shexp" in w:
        shared = mlp(xp, w, rows, params.activation, suffix="_shexp")
        if "ffn_gate_inp_shexp" in w:
            shared = shared * sigmoid(xp, rows @ xp.reshape(w["ffn_gate_inp_shexp"], (-1, 1)))
        out = out + shared
    return xp.reshape(out, shape)
