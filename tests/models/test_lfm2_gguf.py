"""LFM2 in GGUF files: llama.cpp's ``lfm2`` keys and tensor names, both ways.

Without torch: a random model written and read back computes the same logits; the file holds
llama.cpp's names, shapes and keys (``head_count_kv`` 0 on the short-convolution layers, the final norm
as ``token_embd_norm``); a model with ``conv_bias`` (which llama.cpp's lfm2 cannot hold) is refused
before a file is written.  Live (``llamacpp_live``: llama-cpp-python, torch and transformers): llama.cpp
runs the file the package writes from a ``save_pretrained`` checkpoint, its logits within 2e-3 of
transformers'; with ``LLAMA_CPP_SRC`` naming llama.cpp's source, its own converter's file holds the same
tensors and keys, and the package reads it; a sequence's state bytes (a conv-only recurrent section)
cross from llama.cpp to the package and back.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import Lfm2Model, ModelError, load_gguf, load_hf, random_lfm2_model, write_gguf
from recurrent_cache.models.gguf_file import GGUFFile

TOKENS = [3, 5, 7, 11, 13, 17, 19, 23]


def logits(model: Lfm2Model, tokens: list[int] = TOKENS) -> np.ndarray:
    """The package's logits after each token, one sequence through the hybrid memory."""
    cache = model.new_cache(kv_size=64, kv_pad=1)
    batch = rc.Batch(token=tokens, seq_id=[0] * len(tokens), logits=[1] * len(tokens))
    return model.forward(cache.init_batch(batch, 3))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "own-output"])
def test_a_written_file_reads_back_to_the_same_logits(tmp_path, tied):
    model = random_lfm2_model(seed=1, n_vocab=64, n_embd=32, n_layer=4, n_ff=48, l_cache=4, attn_layers=(0, 2),
                              tied=tied)
    write_gguf(model, tmp_path / "lfm2.gguf")
    loaded = load_gguf(tmp_path / "lfm2.gguf")
    assert isinstance(loaded, Lfm2Model) and loaded.tied == tied
    assert replace(loaded.hparams, rms_eps=1e-5) == model.hparams   # the file's keys are f32
    expected = logits(model)
    np.testing.assert_allclose(logits(loaded), expected, rtol=0, atol=1e-5 * np.abs(expected).max())  # f32 weights


def test_the_file_holds_llamacpps_names_shapes_and_keys(tmp_path):
    model = random_lfm2_model(seed=2, n_vocab=64, n_embd=32, n_layer=3, n_head=4, n_head_kv=2, n_ff=48, l_cache=3,
                              attn_layers=(1,))
    write_gguf(model, tmp_path / "lfm2.gguf", file_type="f16")
    file = GGUFFile(tmp_path / "lfm2.gguf")
    fields = file.fields
    assert fields["general.architecture"] == "lfm2"
    assert fields["lfm2.attention.head_count_kv"] == [0, 2, 0] and fields["lfm2.attention.head_count"] == 4
    assert (fields["lfm2.shortconv.l_cache"], fields["lfm2.feed_forward_length"]) == (3, 48)
    assert fields["lfm2.rope.freq_base"] == 1e6 and "lfm2.ssm.conv_kernel" not in fields
    shapes = {name: info.shape for name, info in file.tensors.items()}
    assert shapes["token_embd_norm.weight"] == (32,) and "output_norm.weight" not in shapes
    assert "output.weight" not in shapes   # tied
    assert shapes["blk.0.shortconv.conv.weight"] == (32, 3) and shapes["blk.0.shortconv.in_proj.weight"] == (96, 32)
    assert shapes["blk.1.attn_q_norm.weight"] == (8,) and shapes["blk.1.attn_k.weight"] == (16, 32)
    assert "blk.1.shortconv.conv.weight" not in shapes and "blk.0.attn_q.weight" not in shapes
    # an f16 file keeps the conv taps (and every 1-D tensor) in f32, as llama.cpp's converter does
    assert file.tensors["blk.0.shortconv.conv.weight"].type_name == "F32"
    assert file.tensors["blk.0.shortconv.in_proj.weight"].type_name == "F16"


def test_conv_biases_are_refused_before_a_file_is_written(tmp_path):
    model = random_lfm2_model(seed=3, n_vocab=64, n_embd=32, n_layer=2, n_ff=48, attn_layers=(1,), conv_bias=True)
    with pytest.raises(ModelError, match="conv_bias: llama.cpp's lfm2 has no in_proj, conv or out_proj bias"):
        write_gguf(model, tmp_path / "lfm2.gguf")
    assert not (tmp_path / "lfm2.gguf").exists()


# -- live: llama.cpp runs the files ------------------------------------------------------------------


def save_checkpoint(directory: Path) -> object:
    """A random tiny LFM2 saved by transformers; returns the transformers model (float64)."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, block_multiple_of=16,
                        layer_types=["conv", "full_attention", "conv", "full_attention"])
    torch.manual_seed(0)
    model = Lfm2ForCausalLM(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if param.dim() == 1
                        else torch.randn_like(param) / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    return model


def llamacpp_logits(path: Path) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(TOKENS)
    return np.array(llm.scores[:len(TOKENS)])


@pytest.mark.llamacpp_live
@pytest.mark.needs_torch
def test_llamacpp_runs_the_file_the_package_writes(tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf_model = save_checkpoint(tmp_path / "hf")
    write_gguf(load_hf(tmp_path / "hf"), tmp_path / "lfm2.gguf")
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0].numpy()
    error = np.abs(llamacpp_logits(tmp_path / "lfm2.gguf") - expected).max() / np.abs(expected).max()
    assert error < 2e-3, error   # measured 3.1e-4: llama.cpp's own converter's file gives the same logits


# llama.cpp's converter, with LFM2's vocabulary replaced by no_vocab (its BPE pre-tokenizer check knows no
# tokenizer of a random checkpoint); the weights and keys are the converter's own.
CONVERT = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import convert_hf_to_gguf
from conversion.lfm2 import LFM2Model
LFM2Model.set_vocab = lambda self: self.gguf_writer.add_tokenizer_model("no_vocab")
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", "f32"]
convert_hf_to_gguf.main()
"""


@pytest.mark.llamacpp_live
@pytest.mark.needs_torch
def test_llamacpps_own_converter_writes_the_same_file(tmp_path):
    source = os.environ.get("LLAMA_CPP_SRC")
    if not source or not (Path(source) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("set LLAMA_CPP_SRC to llama.cpp's source directory (its convert_hf_to_gguf.py)")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    save_checkpoint(tmp_path / "hf")
    subprocess.run([sys.executable, "-c", CONVERT, source, str(tmp_path / "hf"), str(tmp_path / "theirs.gguf")],
                   check=True, capture_output=True)
    model = load_hf(tmp_path / "hf")
    write_gguf(model, tmp_path / "ours.gguf")
    ours, theirs = GGUFFile(tmp_path / "ours.gguf"), GGUFFile(tmp_path / "theirs.gguf")
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, info in ours.tensors.items():
        np.testing.assert_array_equal(ours.floats(info), theirs.floats(theirs.tensors[name]), err_msg=name)
    keys = {k for k in ours.fields if k.startswith("lfm2.")} | {k for k in theirs.fields if k.startswith("lfm2.")}
    # the context length is the converter's max_position_embeddings; the package writes its placeholder
    assert {k for k in keys if ours.fields.get(k) != theirs.fields.get(k)} == {"lfm2.context_length"}
    expected = logits(model)
    np.testing.assert_allclose(logits(load_gguf(tmp_path / "theirs.gguf")), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


def recorder():
    """tools/record_llamacpp.py: its llama.cpp model and context wrappers (the state calls)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "tools" / "record_llamacpp.py"
    spec = importlib.util.spec_from_file_location("record_llamacpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Setting:
    """What the recorder's ``Context`` reads: no flash attention (V transposed), one KV stream."""

    flash_attn: bool = False
    kv_unified: bool = True
    n_seq_max: int = 2
    n_ctx: int = 256


@pytest.mark.llamacpp_live
def test_a_sequences_state_bytes_cross_between_llamacpp_and_the_package(tmp_path):
    """llama.cpp's LFM2 state bytes (each s section: the type and a row size of 0) read into the package's
    memory and continued, and the package's read back by llama.cpp, to the same next logits."""
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
    lc = recorder()
    model = random_lfm2_model(seed=5, n_vocab=64, n_embd=32, n_layer=4, n_ff=48, attn_layers=(1, 3),
                              dtype=np.float32)
    write_gguf(model, tmp_path / "lfm2.gguf")
    prompt, following = [3, 5, 7, 11, 13], 17
    llama = lc.Model(tmp_path / "lfm2.gguf")
    try:
        with lc.Context(llama, Setting()) as ctx:
            ctx.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
            theirs, theirs_partial = ctx.state_seq_get_data(0), ctx.state_seq_get_data(0, lc.PARTIAL_ONLY)
            expected = np.array(ctx.decode([(following, len(prompt), 0, True)])[0])
        own = model.new_cache(n_seq_max=2, kv_size=256, dtype_kv="f16")
        model.forward(own.init_batch(rc.Batch(token=prompt, seq_id=[0] * len(prompt))))
        ours, ours_partial = own.state_write(0, framing="llama"), own.state_write(0, framing="llama", partial_only=True)
        assert (len(ours), len(ours_partial)) == (len(theirs), len(theirs_partial))
        s_sections = struct.pack("<iQ", 0, 0) * 2   # f32, 0 bytes a row, for each of the 2 conv layers
        assert theirs_partial.endswith(s_sections) and ours_partial.endswith(s_sections)
        with lc.Context(llama, Setting()) as ctx:
            assert ctx.state_seq_set_data(ours, 1) == len(ours)
            from_ours = np.array(ctx.decode([(following, len(prompt), 1, True)])[0])
    finally:
        llama.close()
    cache = model.new_cache(n_seq_max=2, kv_size=256, dtype_kv="f16")
    assert cache.state_read(theirs, 1) == len(theirs)
    from_theirs = model.forward(cache.init_batch(rc.Batch(token=[following], pos=[len(prompt)], seq_id=[1])))[0]
    scale = np.abs(expected).max()
    # measured 1.8e-4 and 9.3e-5: the two compute K (f16) and the conv state in their own order
    assert np.abs(from_theirs - expected).max() < 5e-4 * scale
    assert np.abs(from_ours - expected).max() < 5e-4 * scale
