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
a decoded token costs n_expert_used experts, not n_expert.  Equal to transformers'
``JambaSparseMoeBlock`` / ``Qwen3NextSparseMoeBlock`` within rounding (tests/models/test_ffn_hf.py);
experts tied in probability are taken in index order (torch.topk's order is unspecified there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._arrays import Array
from ._ssm import linear, silu

__all__ = ["ACTIVATIONS", "GATINGS", "MoeParams", "mlp", "moe", "sigmoid"]

ACTIVATIONS = ("silu", "relu2")
GATINGS = ("softmax", "sigmoid")


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
    up = x @ xp.permute_dims(w["ffn_up_exps"][e], (1, 0))
    if "ffn_gate_exps" in w:
        hidden = _activated(xp, x @ xp.permute_dims(w["ffn_gate_exps"][e], (1, 0)), activation) * up
    else:
        hidden = _activated(xp, up, activation)
    return hidden @ xp.permute_dims(w["ffn_down_exps"][e], (1, 0))


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
    choice = probs + w["ffn_exp_probs_b"] if "ffn_exp_probs_b" in w else probs
    host = np.asarray(choice.cpu() if hasattr(choice, "cpu") else choice, dtype=np.float64)
    chosen = np.argsort(-host, axis=1, kind="stable")[:, :k]                          # [n_rows, k]
    weights = xp.take_along_axis(probs, xp.asarray(chosen, device=probs.device), axis=1)
    if params.norm_top_k:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    if params.scale != 1.0:
        weights = weights * params.scale
    # each chosen expert on its own tokens, into the token's slot; the slots summed per token
    slots = xp.zeros((n_rows * k, shape[-1]), dtype=x.dtype, device=x.device)
    flat = chosen.reshape(-1)
    for e in np.unique(flat):
        where = np.flatnonzero(flat == e)                       # slot = token * k + position
        tokens = xp.asarray(where // k, device=x.device)
        scale = xp.reshape(weights, (-1,))[xp.asarray(where, device=x.device)]
        expert = _expert(xp, w, int(e), rows[tokens], params.activation)
        slots[xp.asarray(where, device=x.device)] = expert * scale[:, None]
    out = xp.sum(xp.reshape(slots, (n_rows, k, shape[-1])), axis=1)
    if "ffn_up_shexp" in w:
        shared = mlp(xp, w, rows, params.activation, suffix="_shexp")
        if "ffn_gate_inp_shexp" in w:
            shared = shared * sigmoid(xp, rows @ xp.reshape(w["ffn_gate_inp_shexp"], (-1, 1)))
        out = out + shared
    return xp.reshape(out, shape)
