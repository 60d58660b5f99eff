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
from recurrent_cache.models import NemotronHModel, load_hf, random_nemotron_h_model
from recurrent_cache.storage import TorchStorage

from hybrid_scenarios import Recorder, host, run_scenarios, shared

torch = pytest.importorskip("torch", reason="the reference is transformers' NemotronHForCausalLM (needs torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' NemotronHForCausalLM")

TORCH_DTYPES = {np.float64: torch.float64, np.float32: torch.float32}
# Mamba-2, experts, attention, Mamba-2, MLP: every layer kind, a recurrent layer after an attention layer
BLOCK_TYPES = ["linear_attention", "moe", "full_attention", "linear_attention", "mlp"]
PATTERN = "ME*M-"


def perturbed(model: Any, seed: int) -> None:
    """Move every norm weight, bias, A_log, D and the experts' choice bias away from its initial value, so that
    a formula that forgets one cannot hide behind ones and zeros; the router and the experts get weights large
    enough that the router's choice and each expert matter (their init is 0.02-small)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.ndim == 1 or name.endswith(("A_log", "D")):
                tensor.add_(0.2 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
            if name.endswith(("experts.up_proj", "experts.down_proj", "gate.weight")):
                tensor.normal_(0.0, 0.2, generator=generator)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Nemotron-H: attention heads of 12 (not hidden / heads = 8), Mamba-2 of 4 heads of 12
    (d_inner 48, not expand * hidden = 64) in 2 groups, 2 of 6 experts beside a shared one, scaled by 1.5."""
    config = transformers.NemotronHConfig(
        vocab_size=96, hidden_size=32, layers_block_type=BLOCK_TYPES, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=48, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=12, n_groups=2,
        conv_kernel=4, layer_norm_epsilon=1e-5, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=40, routed_scaling_factor=1.5, norm_topk_prob=True,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config)
    perturbed(model, 1)
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    return Path(directory)


@shared
def reference_of(directory: Path, dtype: Any) -> Callable[[Any], np.ndarray]:
    model = transformers.NemotronHForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype],
                                                              experts_implementation="eager").eval()

    def reference(tokens: Any) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
        return logits
    return reference


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("storage", ["numpy", "torch", "torch-index"])
def test_nemotron_h_equals_transformers_through_the_hybrid_memory(checkpoint: Path, tmp_path: Path, dtype: Any,
                                                                  storage: Any) -> None:
    """torch-index: torch storage without host access, the path a GPU's rows take (on the CPU here)."""
    if storage == "torch-index":
        storage = TorchStorage("cpu", host_access=False)
    model = load_hf(checkpoint, dtype=dtype)
    assert isinstance(model, NemotronHModel)
    assert model.hparams.pattern == PATTERN
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
        config["hybrid_override_pattern"] = PATTERN
    model = load_hf(_with_config(checkpoint, tmp_path / "pattern", to_pattern))
    assert isinstance(model, NemotronHModel) and model.hparams.pattern == PATTERN
    reference = load_hf(checkpoint)
    tokens = [5, 17, 3, 90, 41]
    cache_a, cache_b = model.new_cache(kv_size=16), reference.new_cache(kv_size=16)
    np.testing.assert_array_equal(model.forward(cache_a.init_batch(_batch(tokens))),
                                  reference.forward(cache_b.init_batch(_batch(tokens))))


def _batch(tokens: list[int]) -> rc.Batch:
    return rc.Batch(token=tokens, seq_id=[0] * len(tokens), pos=list(range(len(tokens))), logits=[1] * len(tokens))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n_group", 2, "group-limited"),
    ("moe_latent_size", 16, "latent"),
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


def test_a_random_nemotron_h_computes_the_same_on_numpy_and_torch_storage() -> None:
    model = random_nemotron_h_model(seed=3, n_vocab=64, n_embd=32, pattern="M-*ME", n_ff=48, head_dim=8,
                                    ssm_head_dim=8, d_state=8)
    tokens = [1, 5, 9, 33, 2, 60]
    logits = []
    for storage in ("numpy", "torch"):
        cache = model.new_cache(kv_size=16, storage=storage)
        logits.append(host(model.forward(cache.init_batch(_batch(tokens)))))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-10 * np.abs(logits[0]).max())


def test_a_checkpoint_in_the_in_memory_layout_loads_the_same_model(checkpoint: Path, tmp_path: Path) -> None:
    """transformers' in-memory names (``model.`` rather than the saved ``backbone.``, every expert's weights
    stacked in one tensor) read as the saved layout does."""
    from safetensors.numpy import load_file, save_file

    directory = _with_config(checkpoint, tmp_path / "in_memory", lambda config: None)
    saved = load_file(directory / "model.safetensors")
    renamed = {name.replace("backbone.", "model.", 1): values for name, values in saved.items()}
    for projection in ("up_proj", "down_proj"):
        per_expert = [n for n in renamed if ".experts." in n and n.endswith(f".{projection}.weight")]
        per_expert.sort(key=lambda n: int(n.split(".")[-3]))          # by expert index, 10 after 9
        layer = per_expert[0].split(".experts.")[0]
        renamed[f"{layer}.experts.{projection}"] = np.stack([renamed.pop(n) for n in per_expert])
    save_file(renamed, directory / "model.safetensors")
    tokens = [5, 17, 3, 90, 41]
    logits = [model.forward(model.new_cache(kv_size=16).init_batch(_batch(tokens)))
              for model in (load_hf(directory), load_hf(checkpoint))]
    np.testing.assert_array_equal(logits[0], logits[1])
