"""Small valid Hugging Face Mamba checkpoints written with numpy alone: config.json, model.safetensors (or
shards with an index) and a byte-level tokenizer.json laid out as transformers' save_pretrained lays them
out, so tests that need a checkpoint run without torch or transformers."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np

from recurrent_cache.models.vocab import gpt2_byte_decoder

N_VOCAB, N_EMBD, N_LAYER, D_STATE, D_CONV = 260, 16, 2, 4, 4

CONFIGS = {
    "mamba1": {"architectures": ["MambaForCausalLM"], "vocab_size": N_VOCAB, "hidden_size": N_EMBD,
               "state_size": D_STATE, "num_hidden_layers": N_LAYER, "conv_kernel": D_CONV, "expand": 2,
               "intermediate_size": 2 * N_EMBD, "time_step_rank": "auto", "layer_norm_epsilon": 1e-5,
               "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": True,
               "eos_token_id": 256},
    "mamba2": {"architectures": ["Mamba2ForCausalLM"], "vocab_size": N_VOCAB, "hidden_size": N_EMBD,
               "state_size": D_STATE, "num_hidden_layers": N_LAYER, "conv_kernel": D_CONV, "expand": 2,
               "num_heads": 4, "head_dim": 8, "n_groups": 2, "layer_norm_epsilon": 1e-5,
               "time_step_limit": [0.0, math.inf], "use_bias": False, "use_conv_bias": True,
               "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 256},
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for ``config`` (MambaForCausalLM / Mamba2ForCausalLM)."""
    n_embd, d_state, d_conv = config["hidden_size"], config["state_size"], config["conv_kernel"]
    d_inner = config["expand"] * n_embd
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (config["vocab_size"], n_embd),
                                          "backbone.norm_f.weight": (n_embd,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], n_embd)
    for il in range(config["num_hidden_layers"]):
        prefix = f"backbone.layers.{il}."
        shapes[prefix + "norm.weight"] = (n_embd,)
        shapes[prefix + "mixer.out_proj.weight"] = (n_embd, d_inner)
        if config["architectures"] == ["MambaForCausalLM"]:
            dt_rank = math.ceil(n_embd / 16)
            shapes |= {prefix + "mixer.in_proj.weight": (2 * d_inner, n_embd),
                       prefix + "mixer.conv1d.weight": (d_inner, 1, d_conv), prefix + "mixer.conv1d.bias": (d_inner,),
                       prefix + "mixer.x_proj.weight": (dt_rank + 2 * d_state, d_inner),
                       prefix + "mixer.dt_proj.weight": (d_inner, dt_rank), prefix + "mixer.dt_proj.bias": (d_inner,),
                       prefix + "mixer.A_log": (d_inner, d_state), prefix + "mixer.D": (d_inner,)}
        else:
            n_head, n_group = config["num_heads"], config["n_groups"]
            channels = d_inner + 2 * n_group * d_state
            shapes |= {prefix + "mixer.in_proj.weight": (channels + d_inner + n_head, n_embd),
                       prefix + "mixer.conv1d.weight": (channels, 1, d_conv), prefix + "mixer.conv1d.bias": (channels,),
                       prefix + "mixer.dt_bias": (n_head,), prefix + "mixer.A_log": (n_head,),
                       prefix + "mixer.D": (n_head,), prefix + "mixer.norm.weight": (d_inner,)}
    return shapes


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """``tensors`` as an F32 safetensors file, laid out one after another as the format's writer does."""
    header: dict = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, values in tensors.items():
        raw = np.ascontiguousarray(values, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(values.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json: the 256 bytes as GPT-2 characters, and <|endoftext|> as id 256."""
    vocab = {char: byte for char, byte in gpt2_byte_decoder().items()}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": []}}


def write_checkpoint(directory: Path, arch: str, sharded: bool = False) -> Path:
    """A valid checkpoint of ``arch`` in ``directory``: random weights (A_log and norms kept tame)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[arch]
    (directory / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {name: 0.3 * rng.standard_normal(shape) for name, shape in tensor_shapes(config).items()}
    if sharded:
        names = list(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for shard, members in shards.items():
            write_safetensors(directory / shard, {name: tensors[name] for name in members})
        weight_map = {name: shard for shard, members in shards.items() for name in members}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        write_safetensors(directory / "model.safetensors", tensors)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    return directory
