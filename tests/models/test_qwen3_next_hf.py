"""Qwen3-Next (models/qwen3_next.py) from a ``save_pretrained`` directory against transformers'
``Qwen3NextForCausalLM``: every logit the package computes through the hybrid cache equals transformers'
full-sequence forward of that sequence within 1e-4 of the largest logit, float32 and float64, numpy and torch
storage — the scenarios of tests/hybrid_scenarios.py (prompts in small ubatches, decode steps, a fork, a sequence
moved through its state bytes into a second memory and back, a rollback of drafted tokens, a prefix restored from
HybridPrefixCache and from a store).
A config the package cannot run is refused naming the field.  A GGUF file written as llama.cpp's converter writes
it (fused attn_qkv / attn_gate, or a legacy ssm_in) loads as the same model (measured 1.4e-6: f32 weights).

Measured, of the largest logit (about 8 here), numpy / torch storage: float64 6.2e-6 / 6.2e-6, float32 5.3e-6 /
7.0e-6 (transformers computes the delta rule, its norms and the router's softmax in float32 whatever the model's
dtype, and the cache keeps f32 states); the rollback 2.0e-7.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.errors import ModelError
from recurrent_cache.models import Qwen3NextModel, load_hf

from hybrid_scenarios import Recorder, memoised, run_scenarios

torch = pytest.importorskip("torch", reason="the transformers comparison needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the comparison is against transformers' Qwen3-Next")
pytest.importorskip("recurrent_cache.models.torch_forward", reason="torch storage needs array-api-compat")

PROMPTS = ([5, 17, 60, 3, 9, 41, 8], [50, 1, 2, 33], [7, 7, 21, 63, 12])
N_UBATCH = 3
TOLERANCE = 1e-4   # of the largest logit (issue 27)



@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3-Next saved by transformers: Gated DeltaNet layers 0 and 2, attention layers 1 and 3,
    experts (with the shared expert) on layers 0, 1, 3, a dense MLP on layer 2 (``mlp_only_layers``); value heads
    sharing a key head.  Every parameter is drawn at random (norm weights away from 0), A as transformers draws it."""
    config = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[2],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    torch.manual_seed(0)
    module = transformers.Qwen3NextForCausalLM(config)
    module.set_experts_implementation("eager")   # the grouped product takes no float64
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.2 if parameter.ndim == 1 else 0.5))
            if name.endswith("A_log"):
                parameter.copy_(torch.log(torch.empty_like(parameter).uniform_(0.01, 16.0)))
    directory = tmp_path_factory.mktemp("qwen3_next")
    module.save_pretrained(directory)
    return directory, module.eval()


def reference(module, tokens, dtype):
    """transformers' logits of one sequence's tokens, in ``dtype``."""
    with torch.no_grad():
        return module.to(dtype)(torch.tensor([tokens])).logits[0].double().numpy()


def host(logits):
    """Logits as a float64 numpy array (torch storage gives a torch tensor)."""
    return np.asarray(logits if isinstance(logits, np.ndarray) else logits.numpy(), dtype=np.float64)


def run(model, cache, tokens, seq_ids, positions):
    """Every token's logits through the cache, by (seq, pos)."""
    st = cache.init_batch(rc.Batch(token=tokens, pos=positions, seq_id=seq_ids, logits=[1] * len(tokens)), N_UBATCH)
    logits = host(model.forward(st))
    return {(seq_ids[i], positions[i]): logits[row] for row, i in enumerate(st.out_ids)}


def assert_close(ours, theirs):
    scale = float(np.max(np.abs(theirs)))
    error = float(np.max(np.abs(ours - theirs)))
    assert error <= TOLERANCE * scale, f"{error / scale:.2e} of the largest logit"


DTYPES = {"f64": (np.float64, torch.float64), "f32": (np.float32, torch.float32)}


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    """transformers' logits of each token sequence per dtype, computed once for both storages' tests."""
    _, module = checkpoint
    return {name: memoised(lambda tokens, torch_dtype=torch_dtype: reference(module, list(tokens), torch_dtype))
            for name, (_, torch_dtype) in DTYPES.items()}


@pytest.mark.parametrize("storage", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_qwen3_next_equals_transformers_through_the_hybrid_memory(checkpoint, hf_logits, storage, dtype, tmp_path):
    """The scenarios of tests/hybrid_scenarios.py, against transformers in the same dtype."""
    directory, _ = checkpoint
    np_dtype, _ = DTYPES[dtype]
    model = load_hf(directory, dtype=np_dtype)
    assert isinstance(model, Qwen3NextModel)
    assert model.hparams.attn_layers == (1, 3) and model.hparams.moe_layers == (0, 1, 3)
    recorder = Recorder(hf_logits[dtype])
    run_scenarios(model, recorder, storage=storage, store_path=tmp_path / "store")
    assert set(recorder.worst) == {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache",
                                   "prefix from a store"}


@pytest.mark.parametrize(("field", "value", "named"), [
    ("layer_types", ["linear_attention", "full_attention"], "layer_types"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "layer_types"),
    ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters"),
    ("linear_num_value_heads", 3, "n_v_heads 3"),
    ("hidden_act", "gelu", "hidden_act")])
def test_a_config_the_package_cannot_run_is_refused_by_name(checkpoint, tmp_path, field, value, named):
    directory, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=named) as refused:
        load_hf(copy)
    assert "config.json" in str(refused.value)


def test_a_transformers_4_config_gives_its_rope_from_the_top_level(checkpoint, tmp_path):
    directory, _ = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    config = json.loads((copy / "config.json").read_text())
    del config["rope_parameters"]   # as transformers 4 saved the released checkpoints
    config |= {"rope_theta": 5e5, "partial_rotary_factor": 0.5, "rope_scaling": None}
    (copy / "config.json").write_text(json.dumps(config))
    p = load_hf(copy).hparams
    assert (p.rope_base, p.n_rot) == (5e5, 4)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="rope_scaling"):
        load_hf(copy)


def test_the_multi_token_prediction_head_of_a_checkpoint_is_left_unread(checkpoint, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="writing the checkpoint needs safetensors")
    directory, module = checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    tensors = safetensors_numpy.load_file(copy / "model.safetensors")
    tensors["mtp.fc.weight"] = np.ones((32, 64), np.float32)   # what the released checkpoints carry
    safetensors_numpy.save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    model = load_hf(copy)
    got = run(model, model.new_cache(n_seq_max=1, kv_size=64), PROMPTS[1], [0] * 4, list(range(4)))
    assert_close(np.stack([got[(0, pos)] for pos in range(4)]), reference(module, PROMPTS[1], torch.float64))
    tensors["model.extra.weight"] = np.ones((2, 2), np.float32)   # anything else is still another configuration's
    safetensors_numpy.save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="model.extra.weight"):
        load_hf(copy)


# transformers' name (under model.layers.N.) -> llama.cpp's (blk.N.), as conversion/qwen.py's Qwen3NextModel and
# gguf-py's tensor map name them; a dense MLP (mlp_only_layers, which llama.cpp's converter cannot map) as ffn_*
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "post_attention_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
              "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
              "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
              "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight",
              "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
              "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
              "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
              "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_converted_gguf(module, path, legacy_ssm_in=False, recurrent_layers=None, interval=None):
    """``module`` as llama.cpp's converter writes it (``--no-mtp``; its vocabulary left out): norms as 1 + w but
    the Gated DeltaNet's, A as -exp(A_log), the conv squeezed, in_proj_qkvz split into attn_qkv (q, k, v of every
    head) and attn_gate (z) — or kept whole as a legacy ``ssm_in`` — and the experts stacked; ``recurrent_layers``
    in place of the layer types' flags (0: no such key), ``interval`` as full_attention_interval."""
    gguf = pytest.importorskip("gguf", reason="writing a GGUF file needs gguf-py")
    c = module.config
    writer = gguf.GGUFWriter(path, "qwen3next")
    keys = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads, "key_length": c.head_dim,
            "value_length": c.head_dim, "rope_freq_base": c.rope_parameters["rope_theta"],
            "rope_dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
            "layer_norm_rms_eps": c.rms_norm_eps, "expert_count": c.num_experts,
            "expert_used_count": c.num_experts_per_tok, "expert_feed_forward_length": c.moe_intermediate_size,
            "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
            "ssm_conv_kernel": c.linear_conv_kernel_dim, "ssm_state_size": c.linear_key_head_dim,
            "ssm_group_count": c.linear_num_key_heads, "ssm_time_step_rank": c.linear_num_value_heads,
            "ssm_inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
            "full_attention_interval": 4 if interval is None else interval,
            "tokenizer_model": "no_vocab", "vocab_size": c.vocab_size}
    for key, value in keys.items():   # gguf-py's add_<key>: the converter's calls
        getattr(writer, f"add_{key}")(value)
    flags = [t == "linear_attention" for t in c.layer_types] if recurrent_layers is None else recurrent_layers
    if isinstance(flags, list):
        writer.add_array("qwen3next.attention.recurrent_layers", flags)
    elif flags:
        writer.add_uint32("qwen3next.attention.recurrent_layers", flags)
    tensors = {name: value.detach().double().numpy() for name, value in module.state_dict().items()}
    out = {"token_embd.weight": tensors.pop("model.embed_tokens.weight"),
           "output.weight": tensors.pop("lm_head.weight"), "output_norm.weight": 1.0 + tensors.pop("model.norm.weight")}
    n_k, d_k, d_v = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    v_per_key = c.linear_num_value_heads // n_k * d_v
    for il in range(c.num_hidden_layers):
        layer = {name.removeprefix(f"model.layers.{il}."): value for name, value in tensors.items()
                 if name.startswith(f"model.layers.{il}.")}
        if "mlp.experts.gate_up_proj" in layer:   # transformers' experts in memory: [E, 2*I, H] (gate, up), [E, H, I]
            gate_up = layer.pop("mlp.experts.gate_up_proj")
            out[f"blk.{il}.ffn_gate_exps.weight"] = gate_up[:, :c.moe_intermediate_size]
            out[f"blk.{il}.ffn_up_exps.weight"] = gate_up[:, c.moe_intermediate_size:]
            out[f"blk.{il}.ffn_down_exps.weight"] = layer.pop("mlp.experts.down_proj")
        qkvz = layer.pop("linear_attn.in_proj_qkvz.weight", None)
        if qkvz is not None and legacy_ssm_in:
            out[f"blk.{il}.ssm_in.weight"] = qkvz
        elif qkvz is not None:
            heads = qkvz.reshape(n_k, -1, c.hidden_size)
            q, k = heads[:, :d_k], heads[:, d_k:2 * d_k]
            v, z = heads[:, 2 * d_k:2 * d_k + v_per_key], heads[:, 2 * d_k + v_per_key:]
            out[f"blk.{il}.attn_qkv.weight"] = np.concatenate([x.reshape(-1, c.hidden_size) for x in (q, k, v)])
            out[f"blk.{il}.attn_gate.weight"] = z.reshape(-1, c.hidden_size)
        for name, value in layer.items():
            if name.endswith("norm.weight") and name != "linear_attn.norm.weight":
                value = 1.0 + value
            elif name == "linear_attn.A_log":
                value = -np.exp(value)
            out[f"blk.{il}.{GGUF_NAMES[name]}"] = value.squeeze() if "conv1d" in name else value
    for name, value in out.items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("legacy_ssm_in", [False, True])
def test_a_gguf_file_as_llama_cpps_converter_writes_it_equals_transformers(checkpoint, tmp_path, legacy_ssm_in):
    _, module = checkpoint
    path = tmp_path / "qwen3next.gguf"
    write_converted_gguf(module, path, legacy_ssm_in)
    model = rc.models.load_gguf(path)
    assert isinstance(model, Qwen3NextModel)
    assert model.hparams.attn_layers == (1, 3) and model.hparams.moe_layers == (0, 1, 3)
    cache = model.new_cache(n_seq_max=3, kv_size=64)
    got = run(model, cache, [t for p in PROMPTS for t in p], [s for s, p in enumerate(PROMPTS) for _ in p],
              [i for p in PROMPTS for i in range(len(p))])
    for seq, prompt in enumerate(PROMPTS):
        ours = np.stack([got[(seq, pos)] for pos in range(len(prompt))])
        assert_close(ours, reference(module, prompt, torch.float64))


@pytest.mark.parametrize("flags", [5, [True, False], [1, 0, 1, 0]])
def test_a_gguf_file_whose_layer_kinds_are_not_flags_is_refused(checkpoint, tmp_path, flags):
    _, module = checkpoint
    path = tmp_path / "qwen3next.gguf"
    write_converted_gguf(module, path, recurrent_layers=flags)
    with pytest.raises(ModelError, match="attention.recurrent_layers is not 4 booleans"):
        rc.models.load_gguf(path)


def test_a_gguf_file_without_layer_flags_takes_every_interval_th_layer_as_attention(checkpoint, tmp_path):
    _, module = checkpoint
    path = tmp_path / "qwen3next.gguf"
    write_converted_gguf(module, path, recurrent_layers=0, interval=2)   # layers 1 and 3 attend, as the flags said
    model = rc.models.load_gguf(path)
    assert model.hparams.attn_layers == (1, 3)
    write_converted_gguf(module, path, recurrent_layers=0, interval=0)
    with pytest.raises(ModelError, match="full_attention_interval is 0"):
        rc.models.load_gguf(path)
