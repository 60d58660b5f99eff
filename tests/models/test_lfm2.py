"""LFM2 (``models/lfm2.py``) against transformers' ``Lfm2ForCausalLM``, through the hybrid memory.

Random tiny checkpoints written by ``save_pretrained`` (conv and attention layers; one tied and
without biases, one untied with ``conv_bias`` and 4 conv taps), loaded by ``load_hf`` in float64 and
float32, served on numpy storage and on torch storage (the index path): every logit the package
computes — all prompts in one batch in small ubatches, decode steps for every sequence, a fork that
follows its parent, a sequence moved through its state bytes into a second memory and back, drafted
tokens rolled back, a prefix restored from a ``HybridPrefixCache`` — equals transformers' full forward
of that sequence within 1e-4 of the largest logit.
"""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models import Lfm2Model, ModelError, load_hf

from hybrid_scenarios import Recorder, memoised, run_scenarios
from variants import torch_storage

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import Lfm2Config, Lfm2ForCausalLM  # noqa: E402

CHECKPOINTS = {
    "tied": dict(conv_L_cache=3, conv_bias=False, tie_word_embeddings=True,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "untied-bias": dict(conv_L_cache=4, conv_bias=True, tie_word_embeddings=False,
                        layer_types=["full_attention", "conv", "conv"]),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model in float64) of a random tiny LFM2."""
    options = CHECKPOINTS[request.param]
    config = Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=96,
                        num_hidden_layers=len(options["layer_types"]), num_attention_heads=4, num_key_value_heads=2,
                        block_multiple_of=16, norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **options)
    torch.manual_seed(7)
    model = Lfm2ForCausalLM(config).double().eval()
    with torch.no_grad():   # weights of a trained model's scale: norms near 1, projections ~ 1/sqrt(fan-in)
        for param in model.parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if param.dim() == 1
                        else torch.randn_like(param) / param.shape[-1] ** 0.5)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return directory, model


def reference(hf_model, tokens: list[int]) -> np.ndarray:
    """transformers' logits after each of ``tokens`` (one full-sequence forward)."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].numpy()


@pytest.fixture(scope="module")
def hf_logits(checkpoint):
    """transformers' float64 logits of each token sequence, computed once for every dtype's and storage's test."""
    _, hf_model = checkpoint
    return memoised(lambda tokens: reference(hf_model, list(tokens)))


DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
STORAGES = pytest.mark.parametrize("storage", ["numpy", "torch"])


@STORAGES
@DTYPES
def test_lfm2_equals_transformers_through_the_hybrid_memory(checkpoint, hf_logits, dtype, storage, tmp_path):
    """The scenarios of tests/hybrid_scenarios.py; torch storage is the index path (no host access)."""
    directory, _ = checkpoint
    model = load_hf(directory, dtype=dtype)
    assert isinstance(model, Lfm2Model)
    recorder = Recorder(hf_logits)
    run_scenarios(model, recorder, storage=torch_storage() if storage == "torch" else "numpy",
                  store_path=tmp_path / "store")
    assert set(recorder.worst) == {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache",
                                   "prefix from a store"}


def test_a_checkpoint_llama_cpp_could_not_read_is_refused(checkpoint, tmp_path):
    """Bad fields name the file and the field; nothing half-loaded."""
    import json
    import shutil

    directory, _ = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    config = json.loads((bad / "config.json").read_text())
    for field, value, words in (("layer_types", ["conv"], "layer_types"),
                                ("conv_L_cache", 1, "conv_L_cache must be >= 2"),
                                ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "default rope")):
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ModelError, match=words):
            load_hf(bad)
