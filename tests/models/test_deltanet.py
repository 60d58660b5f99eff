"""Gated DeltaNet (models/_deltanet.py) without torch: a sequence's bits do not depend on its ubatch split, the
step states are the states a shorter run ends with, f16 / bf16 states are rounded after every token, and the
sizes and weights read from a Qwen3-Next config and checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models._deltanet import (GGUF_TENSORS, HF_DEFAULTS, DeltaNetParams, deltanet_weights_from_gguf,
                                              deltanet_weights_from_hf, gated_deltanet, gguf_shapes, qkvz_split,
                                              random_deltanet_weights, weight_shapes)
from recurrent_cache.models._storage import StateStorage

PARAMS = DeltaNetParams(n_embd=24, d_conv=4, n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=6)
N_TOKENS = 9
SPLITS = ([9], [1] * 9, [2, 5, 2], [4, 1, 4], [8, 1])


def weights(p=PARAMS):
    return random_deltanet_weights(np.random.default_rng(5), p)


def tokens(n_seqs, seed=6):
    return np.random.default_rng(seed).standard_normal((n_seqs, N_TOKENS, PARAMS.n_embd))


def run(u, storage_name, sizes, m=0, w=None):
    """``u`` in ubatches of ``sizes`` tokens; the outputs, the final conv and ssm rows (as stored), the steps of
    the last ubatch."""
    storage = StateStorage.named(storage_name)
    w = weights() if w is None else w
    n_seqs = u.shape[0]
    conv = storage.encode(np.zeros((n_seqs, PARAMS.n_embd_r)))
    ssm = storage.encode(np.zeros((n_seqs, PARAMS.n_embd_s)))
    outputs, start, steps = [], 0, None
    with np.errstate(over="ignore"):
        for size in sizes:
            out, conv_f, ssm_f, steps = gated_deltanet(np, PARAMS, w, u[:, start:start + size],
                                                       storage.decode(conv, u.dtype), storage.decode(ssm, u.dtype),
                                                       storage, storage, m)
            conv, ssm = storage.encode(conv_f), storage.encode(ssm_f)
            outputs.append(out)
            start += size
    return np.concatenate(outputs, axis=1), conv, ssm, steps


@pytest.mark.parametrize("storage", ["f32", "f16", "bf16"])
def test_any_split_gives_the_same_bits(storage):
    u = tokens(1)
    whole = run(u, storage, SPLITS[0])
    for sizes in SPLITS[1:]:
        split = run(u, storage, sizes)
        for name, ours, theirs in zip(("outputs", "conv", "ssm"), split[:3], whole[:3]):
            assert np.array_equal(ours, theirs), f"{sizes}: {name} differ by {np.max(np.abs(ours - theirs)):.2e}"


def test_sequences_side_by_side_give_the_bits_each_gives_alone():
    u = tokens(3)
    together = run(u, "f32", [5, 4])
    for s in range(3):
        alone = run(u[s:s + 1], "f32", [5, 4])
        for ours, theirs in zip(together[:3], alone[:3]):
            assert np.array_equal(ours[s:s + 1], theirs)


@pytest.mark.parametrize("storage", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m", [1, 3])
def test_step_states_are_the_states_shorter_runs_end_with(storage, m):
    u = tokens(2)
    decoded = StateStorage.named(storage)
    _, conv, ssm, steps = run(u, storage, [N_TOKENS], m=m)
    conv_steps, ssm_steps = steps
    assert conv_steps.shape == (2, m, PARAMS.n_embd_r) and ssm_steps.shape == (2, m, PARAMS.n_embd_s)
    for i in range(m):
        n = N_TOKENS - m + i   # step i: the state after token N_TOKENS-1-m+i, that is after n tokens
        _, conv_n, ssm_n, _ = run(u[:, :n], storage, [n])
        assert np.array_equal(decoded.encode(conv_steps[:, i]), conv_n)
        assert np.array_equal(decoded.encode(ssm_steps[:, i]), ssm_n)
    _, conv_all, ssm_all, no_steps = run(u, storage, [N_TOKENS], m=0)
    assert no_steps is None and np.array_equal(conv_all, conv) and np.array_equal(ssm_all, ssm)


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_states_are_rounded_to_their_storage_after_every_token(storage):
    rounding = StateStorage.named(storage)
    w = weights()
    u = tokens(1)
    with np.errstate(over="ignore"):
        _, conv, ssm, (conv_steps, ssm_steps) = gated_deltanet(
            np, PARAMS, w, u, np.zeros((1, PARAMS.n_embd_r)), np.zeros((1, PARAMS.n_embd_s)), rounding, rounding, 3)
        exact = gated_deltanet(np, PARAMS, w, u, np.zeros((1, PARAMS.n_embd_r)), np.zeros((1, PARAMS.n_embd_s)),
                               StateStorage.named("f32"), StateStorage.named("f32"), 0)
    for state in (conv, ssm, conv_steps, ssm_steps):
        assert np.array_equal(rounding.round(state), state)
    # the rounding feeds back into the later tokens: the final state is not the f32 one rounded once
    assert not np.array_equal(rounding.round(exact[2]), ssm)


def test_qkvz_split_reorders_per_key_head_rows_into_q_k_v_and_z():
    p = PARAMS
    per_head = 2 * p.head_k_dim + 2 * p.heads_per_key * p.head_v_dim
    # each row names itself: key head * 1000 + index within that head's block of q, k, v, z
    labels = np.array([[h * 1000 + i] * p.n_embd for h in range(p.n_k_heads) for i in range(per_head)], float)
    wqkv, gate = qkvz_split(labels, p)
    q_rows = [h * 1000 + i for h in range(p.n_k_heads) for i in range(p.head_k_dim)]
    k_rows = [h * 1000 + p.head_k_dim + i for h in range(p.n_k_heads) for i in range(p.head_k_dim)]
    v_per_key = p.heads_per_key * p.head_v_dim
    v_rows = [h * 1000 + 2 * p.head_k_dim + i for h in range(p.n_k_heads) for i in range(v_per_key)]
    z_rows = [h * 1000 + 2 * p.head_k_dim + v_per_key + i for h in range(p.n_k_heads) for i in range(v_per_key)]
    assert wqkv[:, 0].tolist() == q_rows + k_rows + v_rows and gate[:, 0].tolist() == z_rows


def test_weights_from_a_checkpoint_have_the_layer_shapes():
    p = PARAMS
    rng = np.random.default_rng(0)
    read = []
    hf_shapes = {"in_proj_qkvz.weight": (2 * p.key_dim + 2 * p.value_dim, p.n_embd),
                 "in_proj_ba.weight": (2 * p.n_v_heads, p.n_embd), "conv1d.weight": (p.conv_channels, p.d_conv),
                 "dt_bias": (p.n_v_heads,), "A_log": (p.n_v_heads,), "norm.weight": (p.head_v_dim,),
                 "out_proj.weight": (p.n_embd, p.value_dim)}
    tensors = {name: rng.standard_normal(shape) for name, shape in hf_shapes.items()}

    def weight(name, shape):
        read.append(name)
        assert shape == hf_shapes[name]
        return tensors[name]
    w = deltanet_weights_from_hf(weight, p)
    assert sorted(read) == sorted(hf_shapes)
    assert {name: value.shape for name, value in w.items()} == weight_shapes(p) == gguf_shapes(p)
    assert set(GGUF_TENSORS) == set(w)
    np.testing.assert_array_equal(w["ssm_a"], -np.exp(tensors["A_log"]))


def test_sizes_from_a_config_and_its_defaults():
    p = DeltaNetParams.from_hf_config({"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 6,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 32, "rms_norm_eps": 1e-5})
    assert (p.n_embd, p.d_conv, p.n_k_heads, p.n_v_heads, p.head_k_dim, p.head_v_dim, p.rms_eps) == \
        (64, HF_DEFAULTS["linear_conv_kernel_dim"], 2, 6, 16, 32, 1e-5)
    # llama.cpp's widths: (d_conv-1) * (ssm_d_inner + 2 * n_group * d_state), d_state * d_inner
    assert p.n_embd_r == 3 * (6 * 32 + 2 * 2 * 16) and p.n_embd_s == 16 * 6 * 32


@pytest.mark.parametrize(("field", "value", "named"), [
    ("hidden_size", None, "hidden_size"), ("linear_num_key_heads", 0, "linear_num_key_heads"),
    ("linear_key_head_dim", 8.0, "linear_key_head_dim"), ("linear_conv_kernel_dim", True, "linear_conv_kernel_dim"),
    ("linear_conv_kernel_dim", 1, "d_conv"), ("rms_norm_eps", -1.0, "rms_norm_eps"),
    ("rms_norm_eps", "small", "rms_norm_eps"), ("hidden_act", "gelu", "hidden_act"),
    ("linear_num_value_heads", 3, "n_v_heads 3")])
def test_bad_config_fields_are_refused_by_name(field, value, named):
    config = {"hidden_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, field: value}
    if value is None:
        del config[field]
    with pytest.raises(ModelError, match=named):
        DeltaNetParams.from_hf_config(config)


LLAMA_SHAPED = DeltaNetParams(n_embd=24, d_conv=4, n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=8)


def test_gguf_keys_read_back_as_the_same_sizes():
    keys = LLAMA_SHAPED.gguf_keys()
    assert keys["ssm.inner_size"] == 32 and keys["ssm.state_size"] == 8
    read = DeltaNetParams.from_gguf(lambda name, kind: kind(keys[name]), n_embd=24, rms_eps=1e-6)
    assert read == LLAMA_SHAPED


@pytest.mark.parametrize(("params", "named"), [
    (PARAMS, "head_k_dim 8 != head_v_dim 6"),
    (DeltaNetParams(n_embd=24, d_conv=4, n_k_heads=2, n_v_heads=4, head_k_dim=8, head_v_dim=8, rms_eps=1e-5),
     "l2_eps")])
def test_gguf_keys_refuse_a_layer_llama_cpp_computes_otherwise(params, named):
    with pytest.raises(ModelError, match=named):
        params.gguf_keys()


def test_gguf_weights_read_the_fused_and_the_legacy_projections_alike():
    p = LLAMA_SHAPED
    w = random_deltanet_weights(np.random.default_rng(2), p)
    stored = {GGUF_TENSORS[field]: value for field, value in w.items()}
    # the legacy file: q, k, v, z per key head in one ssm_in (qkvz_split's inverse)
    q, k = w["wqkv"][:p.key_dim], w["wqkv"][p.key_dim:2 * p.key_dim]
    v, z = w["wqkv"][2 * p.key_dim:], w["wqkv_gate"]
    per_head = [np.concatenate([part.reshape((p.n_k_heads, -1, p.n_embd))[h] for part in (q, k, v, z)])
                for h in range(p.n_k_heads)]
    legacy = {name: value for name, value in stored.items() if name not in ("attn_qkv.weight", "attn_gate.weight")}
    legacy["ssm_in.weight"] = np.concatenate(per_head)
    for file in (stored, legacy):
        read = deltanet_weights_from_gguf(lambda name, shape, file=file: file.get(name), p)
        assert set(read) == set(w) and all(np.array_equal(read[field], w[field]) for field in w)
    del legacy["ssm_in.weight"]
    with pytest.raises(ModelError, match="neither attn_qkv.weight nor ssm_in.weight"):
        deltanet_weights_from_gguf(lambda name, shape: legacy.get(name), p)
    del stored["ssm_ba.weight"]
    with pytest.raises(ModelError, match="ssm_ba.weight"):
        deltanet_weights_from_gguf(lambda name, shape: stored.get(name), p)
