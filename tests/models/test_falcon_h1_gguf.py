"""Falcon-H1 GGUF files (llama.cpp's ``falcon-h1``) without llama.cpp at hand: a model written reads back as
the same model, and what llama.cpp would run differently is refused before anything is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models import FalconH1Model, load_gguf, random_falcon_h1_model, write_gguf

from test_hybrid_gguf import decode

pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")

ENTRIES = [(token, pos, 0) for pos, token in enumerate([5, 17, 42, 3, 60, 33, 7])]


def logits(model: Any) -> np.ndarray:
    return decode(model, model.new_cache(kv_size=32), ENTRIES)


@pytest.mark.parametrize("ssm_norm", [False, True])
def test_a_falcon_h1_written_as_gguf_reads_back_as_the_same_model(tmp_path: Path, ssm_norm: bool) -> None:
    model = random_falcon_h1_model(seed=3, n_vocab=64, n_embd=32, head_dim=12, n_ff=48, d_state=8, n_ssm_head=4,
                                   ssm_head_dim=12, ssm_norm=ssm_norm)
    write_gguf(model, tmp_path / "falcon.gguf")
    back = load_gguf(tmp_path / "falcon.gguf")
    assert isinstance(back, FalconH1Model)
    assert dataclasses.replace(back.hparams, rms_eps=model.hparams.rms_eps) == model.hparams
    for written, read in zip(model.layers, back.layers):
        assert written.keys() == read.keys()
        for name in written:
            np.testing.assert_allclose(read[name], written[name], rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(logits(back), logits(model), rtol=1e-5, atol=1e-5)


def _changed(model: FalconH1Model, **changes: Any) -> FalconH1Model:
    p = dataclasses.replace(model.hparams, **changes)
    layers = [dict(layer) for layer in model.layers]
    if p.attention_bias:
        rng = np.random.default_rng(0)
        for layer in layers:
            for name, width in (("bq", p.n_head * p.head_dim), ("bk", p.attention.n_embd_k),
                                ("bv", p.attention.n_embd_k), ("bo", p.n_embd)):
                layer[name] = rng.standard_normal(width)
    if p.ssm_norm and "ssm_norm" not in layers[0]:
        for layer in layers:
            layer["ssm_norm"] = np.ones(p.d_inner)
    return FalconH1Model(p, model.token_embd, layers, model.output_norm, model.output)


@pytest.mark.parametrize(("changes", "message"), [
    ({"time_step_limit": (0.0, 0.1)}, r"time_step_limit \(0.0, 0.1\) clamps dt"),
    ({"ssm_norm": True, "norm_before_gate": True}, r"mamba_norm_before_gate: llama.cpp's falcon-h1 gates before"),
    ({"attention_bias": True}, r"attention output bias \(bo\): llama.cpp's falcon-h1 does not add it"),
])
def test_a_falcon_h1_llamacpp_would_run_differently_is_refused_before_anything_is_written(
        tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    model = _changed(random_falcon_h1_model(seed=3, n_vocab=64, n_embd=32), **changes)
    path = tmp_path / "refused.gguf"
    with pytest.raises(ModelError, match=message):
        write_gguf(model, path)
    assert not path.exists()
