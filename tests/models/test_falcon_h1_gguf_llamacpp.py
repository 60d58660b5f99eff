"""Falcon-H1 GGUF files against llama.cpp (llama.cpp's ``falcon-h1``): tiny random ``FalconH1ForCausalLM``s
(every multiplier != 1, folded into the weights) converted by the package run in llama.cpp as in
transformers, without and with the Mamba norm (after the gate).  llama.cpp's own converter is not run: for
Falcon-H1 it needs a tokenizer whose BPE pre-tokenizer it recognises (a released one), which a tiny random
checkpoint has not.

Marked ``llamacpp_live``; skipped unless llama-cpp-python, torch, transformers and gguf import."""

from __future__ import annotations

from pathlib import Path

import pytest

from recurrent_cache.models import convert_hf_to_gguf

pytest.importorskip("llama_cpp", reason="runs llama.cpp through llama-cpp-python")
pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
pytest.importorskip("torch", reason="the reference is transformers' FalconH1ForCausalLM")
pytest.importorskip("transformers", reason="the reference is transformers' FalconH1ForCausalLM")

from test_falcon_h1_hf import checkpoints  # noqa: E402, F401  (after the skips: it needs torch)
from test_granite_gguf_llamacpp import expected_logits, llamacpp_logits  # noqa: E402
from test_hybrid_gguf_llamacpp import LLAMACPP_TOLERANCE, relative_error  # noqa: E402

pytestmark = pytest.mark.llamacpp_live


@pytest.mark.parametrize("variant", ["released", "norm after gate"])
def test_the_packages_falcon_h1_gguf_runs_in_llamacpp_as_transformers(
        checkpoints: dict[str, Path], variant: str, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "falcon.gguf"
    convert_hf_to_gguf(checkpoints[variant], path)
    assert relative_error(llamacpp_logits(path), expected_logits(checkpoints[variant])) <= LLAMACPP_TOLERANCE

