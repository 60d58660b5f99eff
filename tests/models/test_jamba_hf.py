"""Jamba from a transformers checkpoint on the hybrid memory equals transformers' own forward (issue 27):
the scenarios of ``hybrid_scenarios`` in float64 and float32, numpy and torch storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models import JambaModel, load_hf
from recurrent_cache.storage import TorchStorage

from hybrid_scenarios import Recorder, run_scenarios, shared

torch = pytest.importorskip("torch", reason="the reference is transformers' JambaForCausalLM (needs torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' JambaForCausalLM")

TORCH_DTYPES = {np.float64: torch.float64, np.float32: torch.float32}


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
    """A tiny random Jamba: attention on layers 1 and 3, experts (2 of 4) on layers 1 and 3, dense MLPs on 0 and 2."""
    config = transformers.JambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(config)
    perturbed(model, 1)
    directory = tmp_path_factory.mktemp("jamba")
    model.save_pretrained(directory)
    return Path(directory)


@shared
def reference_of(directory: Path, dtype: Any) -> Any:
    model = transformers.JambaForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype],
                                                          experts_implementation="eager").eval()

    def reference(tokens: Any) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
        return logits
    return reference


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("storage", ["numpy", "torch", "torch-index"])
def test_jamba_equals_transformers_through_the_hybrid_memory(checkpoint: Path, tmp_path: Path, dtype: Any,
                                                             storage: Any) -> None:
    """torch-index: torch storage without host access, the path a GPU's rows take (on the CPU here)."""
    if storage == "torch-index":
        storage = TorchStorage("cpu", host_access=False)
    model = load_hf(checkpoint, dtype=dtype)
    assert isinstance(model, JambaModel)
    assert model.hparams.attn_layers == (1, 3) and model.hparams.moe_layers == (1, 3)
    recorder = Recorder(reference_of(checkpoint, dtype))
    run_scenarios(model, recorder, storage=storage, store_path=tmp_path / "store")
    assert set(recorder.worst) == {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache",
                                   "prefix from a store"}


def test_a_jamba_config_with_an_attention_offset_beyond_its_period_is_refused(checkpoint: Path,
                                                                               tmp_path: Path) -> None:
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config["attn_layer_offset"] = 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="attn_layer_offset"):
        load_hf(broken)
