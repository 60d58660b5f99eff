"""Falcon-H1 GGUF files against llama.cpp (llama.cpp's ``falcon-h1``): tiny random ``FalconH1ForCausalLM``s
(every multiplier != 1, folded into the weights) converted by the package run in llama.cpp as in
transformers, without and with the Mamba norm (after the gate); llama.cpp's own converter's file is read by
the package as transformers computes it.

Marked ``llamacpp_live``; skipped unless llama-cpp-python, torch, transformers and gguf import; the
converter test also needs ``LLAMA_CPP_SRC`` (llama.cpp's source tree)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.models import FalconH1Model, convert_hf_to_gguf, load_gguf

from test_hybrid_gguf import decode

pytest.importorskip("llama_cpp", reason="runs llama.cpp through llama-cpp-python")
pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
pytest.importorskip("torch", reason="the reference is transformers' FalconH1ForCausalLM")
pytest.importorskip("transformers", reason="the reference is transformers' FalconH1ForCausalLM")

from test_falcon_h1_hf import checkpoints  # noqa: E402, F401  (after the skips: it needs torch)
from test_granite_gguf_llamacpp import (TOKENS, _expected, _llamacpp_logits,  # noqa: E402
                                        _their_conversion)
from test_hybrid_gguf_llamacpp import LLAMACPP_TOLERANCE, PACKAGE_TOLERANCE, relative_error  # noqa: E402

pytestmark = pytest.mark.llamacpp_live


@pytest.mark.parametrize("variant", ["released", "norm after gate"])
def test_the_packages_falcon_h1_gguf_runs_in_llamacpp_as_transformers(
        checkpoints: dict[str, Path], variant: str, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "falcon.gguf"
    convert_hf_to_gguf(checkpoints[variant], path)
    assert relative_error(_llamacpp_logits(path), _expected(checkpoints[variant])) <= LLAMACPP_TOLERANCE


def test_llamacpps_own_converter_gives_a_falcon_h1_file_the_package_runs_as_transformers(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    model = load_gguf(_their_conversion(checkpoints["released"], tmp_path / "theirs.gguf"))
    assert isinstance(model, FalconH1Model)
    got = decode(model, model.new_cache(kv_size=64), [(t, pos, 0) for pos, t in enumerate(TOKENS)])
    assert relative_error(np.asarray(got), _expected(checkpoints["released"])) <= PACKAGE_TOLERANCE
