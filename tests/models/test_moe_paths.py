"""The mixture of experts (models/_ffn.py's ``moe``) by its two paths — one token (decoding one sequence: its
experts in turn) and several (each expert on its own tokens) — against the mixture written out densely, and
the experts' weights kept in the products' layout by a hybrid model."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models import random_jamba_model
from recurrent_cache.models._ffn import MoeParams, moe, silu
from recurrent_cache.models._ssm import product_weight

N_EMBD, N_FF, N_EXPERT = 12, 10, 5


def weights(shared: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"ffn_gate_inp": rng.standard_normal((N_EXPERT, N_EMBD)),
         "ffn_gate_exps": rng.standard_normal((N_EXPERT, N_FF, N_EMBD)),
         "ffn_up_exps": rng.standard_normal((N_EXPERT, N_FF, N_EMBD)),
         "ffn_down_exps": rng.standard_normal((N_EXPERT, N_EMBD, N_FF))}
    if shared:
        w |= {"ffn_gate_shexp": rng.standard_normal((N_FF, N_EMBD)),
              "ffn_up_shexp": rng.standard_normal((N_FF, N_EMBD)),
              "ffn_down_shexp": rng.standard_normal((N_EMBD, N_FF)),
              "ffn_gate_inp_shexp": rng.standard_normal(N_EMBD)}
    return {name: product_weight(a) if a.ndim > 1 else a for name, a in w.items()}


def dense(w: dict[str, np.ndarray], x: np.ndarray, params: MoeParams) -> np.ndarray:
    """Every expert on every token, weighted by its probability where it is among the token's top k, else 0."""
    def swiglu(gate, up, down, rows):
        return (silu(np, rows @ gate.T) * (rows @ up.T)) @ down.T
    probs = np.exp(x @ w["ffn_gate_inp"].T)
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :params.n_expert_used]
    kept = np.zeros_like(probs)
    np.put_along_axis(kept, top, np.take_along_axis(probs, top, axis=-1), axis=-1)
    if params.norm_top_k:
        kept /= kept.sum(axis=-1, keepdims=True)
    out = sum(kept[:, e:e + 1] * swiglu(w["ffn_gate_exps"][e], w["ffn_up_exps"][e], w["ffn_down_exps"][e], x)
              for e in range(N_EXPERT))
    if "ffn_up_shexp" in w:
        gate = 1.0 / (1.0 + np.exp(-(x @ w["ffn_gate_inp_shexp"])))
        out = out + gate[:, None] * swiglu(w["ffn_gate_shexp"], w["ffn_up_shexp"], w["ffn_down_shexp"], x)
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("params", [MoeParams(N_EXPERT, 2), MoeParams(N_EXPERT, 3, norm_top_k=True)])
def test_one_token_and_several_equal_the_dense_mixture(shared, params):
    w = weights(shared)
    x = np.random.default_rng(1).standard_normal((7, N_EMBD))
    expected = dense(w, x, params)
    np.testing.assert_allclose(moe(np, w, x, params), expected, rtol=1e-12, atol=1e-12)
    for row in range(7):   # one token alone: the one-token path
        np.testing.assert_allclose(moe(np, w, x[row:row + 1], params), expected[row:row + 1], rtol=1e-12, atol=1e-12)


def test_a_model_keeps_each_expert_in_the_products_layout():
    """``weight[e].T`` C-contiguous: BLAS streams it once (the values are the hf tests')."""
    model = random_jamba_model(0)
    il = model.hparams.moe_layers[0]
    for field in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        stacked = model.layers[il][field]
        assert all(stacked[e].T.flags.c_contiguous for e in range(stacked.shape[0])), field


def test_one_token_equals_its_row_of_several_with_a_choice_bias_sigmoid_router_and_relu2_experts():
    """Nemotron-H's mixture (sigmoid router, a choice bias, a routed scale, non-gated relu² experts): the
    one-token path gives each row as the several-token path does."""
    w = {name: a for name, a in weights(shared=False, seed=2).items() if name != "ffn_gate_exps"}
    w["ffn_exp_probs_b"] = np.random.default_rng(3).uniform(-0.5, 0.5, N_EXPERT)
    params = MoeParams(N_EXPERT, 2, norm_top_k=True, gating="sigmoid", scale=2.5, activation="relu2")
    x = np.random.default_rng(4).standard_normal((6, N_EMBD))
    together = moe(np, w, x, params)
    for row in range(6):
        np.testing.assert_allclose(moe(np, w, x[row:row + 1], params), together[row:row + 1], rtol=1e-12, atol=1e-12)
