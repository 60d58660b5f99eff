"""Granite-4.0-H and Bamba GGUF files against llama.cpp (issue 27's second bullet, llama.cpp's
``granitehybrid``): a tiny random ``GraniteMoeHybridForCausalLM`` (experts and a shared MLP, rope over whole
heads, every multiplier != 1) converted by the package runs in llama.cpp as in transformers; llama.cpp's own
converter's file of a Granite-4.0-H without rope is read by the package as transformers computes it, and its
file of a Bamba (rope over half of each head in transformers, over all of it in that file) as llama.cpp runs it.

Marked ``llamacpp_live`` as the other live GGUF tests; skipped unless llama-cpp-python, torch, transformers
and gguf import; the converter tests also need ``LLAMA_CPP_SRC`` (llama.cpp's source tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.models import GraniteHybridModel, convert_hf_to_gguf, load_gguf

from test_hybrid_gguf import decode

pytest.importorskip("llama_cpp", reason="runs llama.cpp through llama-cpp-python")
pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
torch = pytest.importorskip("torch", reason="the reference is transformers' GraniteMoeHybridForCausalLM")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' GraniteMoeHybrid")

# granite_moe: Granite-4.0-H with experts and a shared MLP, rope over whole heads, every multiplier != 1
from test_bamba_hf import SIZES, granite_moe, saved  # noqa: E402, F401  (after the skips: it needs torch)
from test_hybrid_gguf_llamacpp import (LLAMACPP_TOLERANCE, PACKAGE_TOLERANCE, LlamaModel, Setting,  # noqa: E402
                                       llama, relative_error)

pytestmark = pytest.mark.llamacpp_live

TOKENS = [5, 17, 42, 3, 60, 33, 7, 8, 24, 40]


def expected_logits(directory: Path) -> np.ndarray:
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        values: np.ndarray = reference(torch.tensor([TOKENS])).logits[0].double().numpy()
    return values


def llamacpp_logits(path: Path) -> np.ndarray:
    with LlamaModel(path) as model, llama.Context(model, Setting(n_seq_max=1)) as ctx:
        return np.asarray(ctx.decode([(token, pos, 0, True) for pos, token in enumerate(TOKENS)]))


def _their_conversion(checkpoint: Path, path: Path) -> Path:
    source = Path(os.environ.get("LLAMA_CPP_SRC", "/nonexistent"))
    if not (source / "convert_hf_to_gguf.py").is_file():
        pytest.skip("LLAMA_CPP_SRC does not name llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile", str(path),
                    "--outtype", "f32"], check=True, capture_output=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(source / "gguf-py")})
    return path


@pytest.fixture(scope="module")
def granite_nope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite-4.0-H as llama.cpp's converter writes it (no rope), dense, every multiplier != 1; no tokenizer
    files (the converter then writes its built-in GPT-NeoX vocabulary).  ``intermediate_size`` equals
    ``shared_intermediate_size``: the converter writes the former as ``feed_forward_length``, the width
    llama.cpp expects of the dense MLP, which is the latter's."""
    config = transformers.GraniteMoeHybridConfig(
        **SIZES, intermediate_size=40, shared_intermediate_size=40, num_local_experts=0,
        layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type="nope",
        embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.4, logits_scaling=3.0)
    directory = saved(tmp_path_factory.mktemp("granite-nope"), transformers.GraniteMoeHybridForCausalLM, config)
    # transformers 5 saves "full_attention" / "linear_attention", which llama.cpp's converter takes for Mamba
    # layers (it looks for "attention"): the legacy names, which transformers reads too
    config_file = directory / "config.json"
    saved_config = json.loads(config_file.read_text())
    saved_config["layer_types"] = ["mamba", "attention", "mamba", "mamba"]
    config_file.write_text(json.dumps(saved_config))
    return directory


def test_the_packages_granite_gguf_runs_in_llamacpp_as_transformers(granite_moe: Path,  # noqa: F811
                                                                    tmp_path: Path) -> None:
    """The multipliers folded into the weights (scales of 1 in the file), the q / k rows permuted for
    llama.cpp's "normal" rope."""
    path = tmp_path / "granite.gguf"
    convert_hf_to_gguf(granite_moe, path)
    assert relative_error(llamacpp_logits(path), expected_logits(granite_moe)) <= LLAMACPP_TOLERANCE


def test_the_packages_f16_granite_gguf_runs_in_llamacpp_as_transformers(granite_moe: Path,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    path = tmp_path / "granite-f16.gguf"
    convert_hf_to_gguf(granite_moe, path, file_type="f16")
    assert relative_error(llamacpp_logits(path), expected_logits(granite_moe)) <= LLAMACPP_TOLERANCE


def test_llamacpps_own_converter_gives_a_granite_file_the_package_runs_as_transformers(
        granite_nope: Path, tmp_path: Path) -> None:
    """llama.cpp's file keeps the multipliers as keys (and Granite's unpermuted-equivalent q / k rows): the
    package folds them on reading."""
    model = load_gguf(_their_conversion(granite_nope, tmp_path / "theirs.gguf"))
    assert isinstance(model, GraniteHybridModel) and model.hparams.attn_layers == (1,)
    got = decode(model, model.new_cache(kv_size=64), [(t, pos, 0) for pos, t in enumerate(TOKENS)])
    assert relative_error(got, expected_logits(granite_nope)) <= PACKAGE_TOLERANCE


def test_llamacpps_file_of_a_bamba_is_read_as_llamacpp_runs_it_whole_head_rope(tmp_path: Path) -> None:
    """llama.cpp's converter writes a transformers 5 Bamba (rope over half of each head) with
    ``rope.dimension_count`` = the head size: llama.cpp runs another model than transformers, and the
    package reads the file as llama.cpp runs it."""
    config = transformers.BambaConfig(**SIZES, intermediate_size=48, attn_layer_indices=[1, 3],
                                      rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    directory = saved(tmp_path / "bamba", transformers.BambaForCausalLM, config)
    path = _their_conversion(directory, tmp_path / "bamba.gguf")
    model = load_gguf(path)
    assert model.hparams.n_rot == model.hparams.head_dim
    got = decode(model, model.new_cache(kv_size=64), [(t, pos, 0) for pos, t in enumerate(TOKENS)])
    theirs = llamacpp_logits(path)
    assert relative_error(got, theirs) <= LLAMACPP_TOLERANCE
    assert relative_error(theirs, expected_logits(directory)) > 10 * LLAMACPP_TOLERANCE
