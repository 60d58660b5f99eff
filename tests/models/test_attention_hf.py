"""The attention layer (models/_attention.py) against transformers' own attention modules, random weights.

Three sequences of a prompt share one KV table (kv_reference.KVCells) so that their cells interleave; the
prompt runs as two ubatches, then one decode step per sequence.  Each token's output must equal what the
transformers module gives for the token's sequence run alone, whole, under a causal mask.

Tolerances, of the largest output (about 10 here), measured then rounded up: float64 compute with f32 K/V
storage 1e-7 (measured 6.8e-8: the stored keys and values are rounded to f32, 2^-24); float32 compute with f32
K/V 5e-7 (3.5e-7); f16 K/V 5e-4 (3.1e-4: 11 bits kept); bf16 K/V 5e-3 (2.9e-3: 8 bits kept).
"""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.kv_reference import KVCells
from recurrent_cache.models._attention import AttentionParams, Rope, attention
from recurrent_cache.models._storage import StateStorage

torch = pytest.importorskip("torch", reason="the transformers comparison needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the comparison is against transformers' attention")
torch_forward = pytest.importorskip("recurrent_cache.models.torch_forward",
                                    reason="the torch backend needs array-api-compat (the torch extra)")

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM = 32, 4, 2, 16
PROMPTS = (5, 4, 3)           # tokens of each sequence's prompt; each then decodes one more
# the prompt as two ubatches, the sequences' tokens taking turns (their cells interleave), then a decode step
UBATCHES = ([(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2), (2, 1)],
            [(1, 2), (0, 3), (2, 2), (1, 3), (0, 4)],
            [(0, 5), (1, 4), (2, 3)])
KV_SIZE = 16
STORAGE = {"f32": np.float32, "f16": np.float16, "bf16": StateStorage.named("bf16").dtype}
TOLERANCE = {("f64", "f32"): 1e-7, ("f32", "f32"): 5e-7, ("f32", "f16"): 5e-4, ("f32", "bf16"): 5e-3}


def inputs(dtype):
    """Each sequence's token inputs [n_tokens, n_embd]."""
    rng = np.random.default_rng(7)
    return [rng.standard_normal((n + 1, N_EMBD)).astype(dtype) for n in PROMPTS]


def cached_outputs(backend, w, params, xs, storage_name, v_trans=False):
    """Every token's output, by (seq, pos), from the layer over one KV table and cache."""
    table = KVCells(KV_SIZE, n_seq_max=len(PROMPTS))
    storage = STORAGE[storage_name]
    k_cache = np.zeros((KV_SIZE, params.n_embd_k), dtype=storage)
    v_cache = np.zeros((params.n_embd_k, KV_SIZE) if v_trans else (KV_SIZE, params.n_embd_k), dtype=storage)
    if backend == "torch":
        xp = torch_forward.TORCH_XP
        k_cache, v_cache = (torch.zeros(tuple(c.shape), dtype=getattr(torch, {"f32": "float32", "f16": "float16",
                                                                           "bf16": "bfloat16"}[storage_name]))
                            for c in (k_cache, v_cache))
        storage_k = storage_v = torch_forward.TorchStateStorage(k_cache.dtype)
        w = {name: torch.from_numpy(value) for name, value in w.items()}
    else:
        xp, storage_k, storage_v = np, StateStorage(k_cache.dtype), StateStorage(v_cache.dtype)
    outputs = {}
    for ubatch in UBATCHES:
        pos = np.array([p for _, p in ubatch], dtype=np.int32)
        seq_ids = [s for s, _ in ubatch]
        cells = table.place(pos, seq_ids)
        mask = np.empty((len(ubatch), table.n_kv()), dtype=np.float32)
        table.mask(pos, seq_ids, mask)
        x = np.stack([xs[s][p] for s, p in ubatch])
        if backend == "torch":
            x = torch.from_numpy(x)
        out = attention(xp, w, x, params, pos, cells, mask, k_cache, v_cache, storage_k, storage_v, v_trans)
        out = out.numpy() if backend == "torch" else out
        outputs.update({token: out[t] for t, token in enumerate(ubatch)})
    # the cells did interleave: the sequences' tokens are not in runs of their own
    assert [table.cell(i)[1] for i in range(3)] == [(0,), (1,), (2,)]
    return outputs


def reference_outputs(module, xs, rotary=None):
    """Each sequence alone through the transformers module, under a causal mask: by (seq, pos)."""
    outputs = {}
    for s, x in enumerate(xs):
        n = len(x)
        hidden = torch.from_numpy(x)[None]
        causal = torch.full((n, n), float("-inf"), dtype=hidden.dtype).triu(1)[None, None]
        kwargs = {}
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(hidden, torch.arange(n)[None])
        with torch.no_grad():
            out = module(hidden, attention_mask=causal, **kwargs)[0][0].numpy()
        outputs.update({(s, p): out[p] for p in range(n)})
    return outputs


PROJECTIONS = {"wq": "q_proj.weight", "wk": "k_proj.weight", "wv": "v_proj.weight", "wo": "o_proj.weight",
               "bq": "q_proj.bias", "bk": "k_proj.bias", "bv": "v_proj.bias", "bo": "o_proj.bias"}


def module_weights(module, dtype, names=PROJECTIONS):
    """The module's weights by our names (ours -> transformers' dotted attribute), as numpy arrays of ``dtype``."""
    out = {}
    for ours, theirs in names.items():
        value = module
        for part in theirs.split("."):
            value = getattr(value, part, None)
        if value is not None:
            out[ours] = value.detach().numpy().astype(dtype)
    return out


def randomized(module, seed):
    """``module`` with every parameter drawn at random (norm weights away from 1, biases away from 0)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    return module


def permuted(weight, n_head):
    """q / k rows in llama.cpp's order for "normal" rope: each head's halves interleaved
    (convert_hf_to_gguf's LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def llama(dtype, bias=True):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding
    config = LlamaConfig(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                         head_dim=HEAD_DIM, attention_bias=bias,
                         rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attn_implementation="eager")
    module = randomized(LlamaAttention(config, layer_idx=0), 1).to(dtype)
    return module, LlamaRotaryEmbedding(config).to(dtype)


TORCH_DTYPE = {"f64": torch.float64, "f32": torch.float32}
NP_DTYPE = {"f64": np.float64, "f32": np.float32}
CASES = [("f64", "f32"), ("f32", "f32"), ("f32", "f16"), ("f32", "bf16")]


def assert_matches(ours, theirs, compute, storage):
    error = max(float(np.max(np.abs(ours[t].astype(np.float64) - theirs[t]))) for t in theirs)
    scale = max(float(np.max(np.abs(out))) for out in theirs.values())
    assert error <= TOLERANCE[(compute, storage)] * scale, (error, scale)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("compute", "storage"), CASES)
def test_neox_rope_matches_llama_attention(backend, compute, storage):
    module, rotary = llama(TORCH_DTYPE[compute])
    xs = inputs(NP_DTYPE[compute])
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, Rope("neox", HEAD_DIM, 500.0))
    ours = cached_outputs(backend, module_weights(module, NP_DTYPE[compute]), params, xs, storage)
    assert_matches(ours, reference_outputs(module, xs, rotary), compute, storage)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_normal_rope_on_permuted_weights_matches_llama_attention(backend):
    """llama.cpp's llama: q / k rows permuted by the converter, "normal" rope — the same outputs."""
    module, rotary = llama(torch.float64)
    xs = inputs(np.float64)
    w = module_weights(module, np.float64)
    w["wq"], w["bq"] = permuted(w["wq"], N_HEAD), permuted(w["bq"][:, None], N_HEAD)[:, 0]
    w["wk"], w["bk"] = permuted(w["wk"], N_HEAD_KV), permuted(w["bk"][:, None], N_HEAD_KV)[:, 0]
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, Rope("normal", HEAD_DIM, 500.0))
    assert_matches(cached_outputs(backend, w, params, xs, "f32"), reference_outputs(module, xs, rotary), "f64", "f32")
    # and the permutation matters: neox on the same weights is another layer
    wrong = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, Rope("neox", HEAD_DIM, 500.0))
    with pytest.raises(AssertionError):
        assert_matches(cached_outputs(backend, w, wrong, xs, "f32"), reference_outputs(module, xs, rotary),
                       "f64", "f32")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("compute", "storage"), CASES)
def test_jamba_attention_has_no_rope(backend, compute, storage):
    from transformers.models.jamba.modeling_jamba import JambaAttention, JambaConfig
    config = JambaConfig(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                         attn_implementation="eager")
    module = randomized(JambaAttention(config, layer_idx=0), 2).to(TORCH_DTYPE[compute])
    xs = inputs(NP_DTYPE[compute])
    head_dim = N_EMBD // N_HEAD
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, head_dim)
    ours = cached_outputs(backend, module_weights(module, NP_DTYPE[compute]), params, xs, storage)
    assert_matches(ours, reference_outputs(module, xs), compute, storage)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bamba_attention_partial_rotary(backend):
    """Bamba: neox over the first half of each head (partial_rotary_factor 0.5), the rest not rotated."""
    from transformers.models.bamba.modeling_bamba import BambaAttention, BambaConfig, BambaRotaryEmbedding
    config = BambaConfig(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                         mamba_n_heads=8, attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, attn_implementation="eager")
    module = randomized(BambaAttention(config, layer_idx=0), 3).to(torch.float64)
    rotary = BambaRotaryEmbedding(config).to(torch.float64)
    head_dim = N_EMBD // N_HEAD
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    xs = inputs(np.float64)
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, head_dim, Rope("neox", head_dim // 2, 1000.0))
    ours = cached_outputs(backend, module_weights(module, np.float64), params, xs, "f32")
    assert_matches(ours, reference_outputs(module, xs, rotary), "f64", "f32")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("compute", "storage"), CASES)
def test_qwen3_next_attention_norms_gate_partial_rotary(backend, compute, storage):
    """Qwen3-Next: q / k RMS norm per head times (1 + weight), neox over a quarter of each head, and
    the sigmoid output gate that q_proj gives beside the queries."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention, Qwen3NextConfig,
                                                                    Qwen3NextRotaryEmbedding)
    config = Qwen3NextConfig(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                             head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.25}, attn_implementation="eager")
    module = randomized(Qwen3NextAttention(config, layer_idx=0), 4).to(TORCH_DTYPE[compute])
    rotary = Qwen3NextRotaryEmbedding(config).to(TORCH_DTYPE[compute])
    xs = inputs(NP_DTYPE[compute])
    w = module_weights(module, NP_DTYPE[compute])
    w["q_norm"] = 1 + module.q_norm.weight.detach().numpy().astype(NP_DTYPE[compute])
    w["k_norm"] = 1 + module.k_norm.weight.detach().numpy().astype(NP_DTYPE[compute])
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, Rope("neox", HEAD_DIM // 4, 10000.0),
                             norm_eps=1e-6, gated=True)
    ours = cached_outputs(backend, w, params, xs, storage)
    assert_matches(ours, reference_outputs(module, xs, rotary), compute, storage)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_lfm2_attention_norms(backend):
    """LFM2: q / k RMS norm per head times its weight, full neox rope, out_proj."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2Attention, Lfm2Config, Lfm2RotaryEmbedding
    config = Lfm2Config(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                        norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                        attn_implementation="eager")
    module = randomized(Lfm2Attention(config, layer_idx=0), 5).to(torch.float64)
    rotary = Lfm2RotaryEmbedding(config).to(torch.float64)
    head_dim = N_EMBD // N_HEAD
    xs = inputs(np.float64)
    w = module_weights(module, np.float64, {**PROJECTIONS, "wo": "out_proj.weight",
                                            "q_norm": "q_layernorm.weight", "k_norm": "k_layernorm.weight"})
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, head_dim, Rope("neox", head_dim, 1e6), norm_eps=1e-5)
    assert_matches(cached_outputs(backend, w, params, xs, "f32"), reference_outputs(module, xs, rotary), "f64", "f32")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_falcon_h1_attention_key_multiplier_folded_into_wk(backend):
    """Falcon-H1: full neox rope, keys times key_multiplier — the same layer with wk and bk scaled by it."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import (FalconH1Attention, FalconH1Config,
                                                                  FalconH1RotaryEmbedding)
    config = FalconH1Config(hidden_size=N_EMBD, num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD_KV,
                            head_dim=HEAD_DIM, attention_bias=True, key_multiplier=0.37,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e5}, attn_implementation="eager")
    module = randomized(FalconH1Attention(config, layer_idx=0), 6).to(torch.float64)
    rotary = FalconH1RotaryEmbedding(config).to(torch.float64)
    xs = inputs(np.float64)
    w = module_weights(module, np.float64)
    w["wk"], w["bk"] = w["wk"] * config.key_multiplier, w["bk"] * config.key_multiplier
    params = AttentionParams(N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, Rope("neox", HEAD_DIM, 1e5))
    assert_matches(cached_outputs(backend, w, params, xs, "f32"), reference_outputs(module, xs, rotary), "f64", "f32")
