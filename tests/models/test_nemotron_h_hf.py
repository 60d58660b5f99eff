"""Nemotron-H from a transformers checkpoint on the hybrid memory equals transformers' own forward (issue 27):
the scenarios of ``hybrid_scenarios`` in float64 and float32, numpy and torch storage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.errors import ModelError
from recurrent_cache.models import NemotronHModel, load_hf

from hybrid_scenarios import Recorder, run_scenarios

torch = pytest.importorskip("torch", reason="the reference is transformers' NemotronHForCausalLM (needs torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' NemotronHForCausalLM")

TORCH_DTYPES = {np.float64: torch.float64, np.float32: torch.float32}
# Mamba-2, MLP, attention, Mamba-2, MLP: every layer kind, a recurrent layer after an attention layer
BLOCK_TYPES = ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]


def perturbed(model: Any, seed: int) -> None:
    """Move every norm weight, bias, A_log and D away from its initial value, so that a formula that
    forgets one cannot hide behind ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 or name.endswith(("A_log", "D")):
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Nemotron-H: attention heads of 12 (not hidden / heads = 8), Mamba-2 of 4 heads of 12
    (d_inner 48, not expand * hidden = 64) in 2 groups."""
    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=32, layers_block_type=BLOCK_TYPES, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=12, n_groups=2,
        conv_kernel=4, layer_norm_epsilon=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config)
    perturbed(model, 1)
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    return Path(directory)


def reference_of(directory: Path, dtype: Any) -> Callable[[Any], np.ndarray]:
    model = transformers.NemotronHForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype]).eval()

    def reference(tokens: Any) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
        return logits
    return reference


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("storage", ["numpy", "torch"])
def test_nemotron_h_equals_transformers_through_the_hybrid_memory(checkpoint: Path, tmp_path: Path, dtype: Any,
                                                                  storage: str) -> None:
    model = load_hf(checkpoint, dtype=dtype)
    assert isinstance(model, NemotronHModel)
    assert model.hparams.pattern == "M-*M-"
    assert model.hparams.attn_layers == (2,) and model.hparams.recr_layers == (0, 3)
    recorder = Recorder(reference_of(checkpoint, dtype))
    run_scenarios(model, recorder, storage=storage, store_path=tmp_path / "store")
    assert set(recorder.worst) == {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache",
                                   "prefix from a store"}


def _with_config(checkpoint: Path, directory: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_an_older_config_with_hybrid_override_pattern_gives_the_same_layers(checkpoint: Path,
                                                                             tmp_path: Path) -> None:
    def to_pattern(config: dict[str, Any]) -> None:
        del config["layers_block_type"]
        config["hybrid_override_pattern"] = "M-*M-"
    model = load_hf(_with_config(checkpoint, tmp_path / "pattern", to_pattern))
    assert isinstance(model, NemotronHModel) and model.hparams.pattern == "M-*M-"
    reference = load_hf(checkpoint)
    tokens = [5, 17, 3, 90, 41]
    cache_a, cache_b = model.new_cache(kv_size=16), reference.new_cache(kv_size=16)
    np.testing.assert_array_equal(model.forward(cache_a.init_batch(_batch(tokens))),
                                  reference.forward(cache_b.init_batch(_batch(tokens))))


def _batch(tokens: list[int]) -> rc.Batch:
    return rc.Batch(token=tokens, seq_id=[0] * len(tokens), pos=list(range(len(tokens))), logits=[1] * len(tokens))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("layers_block_type", ["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
     "mixture-of-experts"),
    ("layers_block_type", ["linear_attention", "conv", "full_attention", "linear_attention", "mlp"], "conv"),
    ("mlp_hidden_act", "silu", "relu2"),
    ("mlp_bias", True, "biases"),
])
def test_a_config_the_package_cannot_compute_is_refused_naming_its_field(checkpoint: Path, tmp_path: Path,
                                                                          field: str, value: Any,
                                                                          message: str) -> None:
    broken = _with_config(checkpoint, tmp_path / "broken", lambda config: config.__setitem__(field, value))
    with pytest.raises(ModelError, match=f"{field}.*{message}"):
        load_hf(broken)
