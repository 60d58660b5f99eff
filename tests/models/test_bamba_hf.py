"""Bamba and Granite-4.0-H from transformers' checkpoints on the hybrid memory equal transformers' own forward
(issue 27): the scenarios of ``hybrid_scenarios`` in float64 and float32, numpy and torch storage — Bamba
(partial rope, grouped Mamba-2), a MoE Granite-4.0-H with rope and every multiplier, a dense Granite-4.0-H
without rope and with tied embeddings — and the configurations the loader refuses."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models import GraniteHybridModel, load_hf
from recurrent_cache.models import _registry as registry
from recurrent_cache.models.bamba import BAMBA, GRANITE

from hybrid_scenarios import Recorder, run_scenarios, shared

torch = pytest.importorskip("torch", reason="the reference is transformers' BambaForCausalLM (needs torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' BambaForCausalLM")

from test_jamba_hf import TORCH_DTYPES, perturbed  # noqa: E402  (after the skips: it needs torch too)

# Small sizes shared by the three checkpoints: 4 attention heads over 2 KV heads of 8, 4 SSM heads of 16 in
# 2 groups.  initializer_range 0.2 (not transformers' 0.02) so that attention and every block move the logits
# by more than the tolerance: a wrong rope or multiplier cannot hide.
SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=4, initializer_range=0.2)


def saved(directory: Path, model_class: Any, config: Any) -> Path:
    torch.manual_seed(0)
    model = model_class(config)
    perturbed(model, 1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bamba: attention on layers 1 and 3 (rope over the first half of each head), Mamba-2 on 0 and 2 with dt
    clamped to [0.01, 1] (transformers' time_step_limit; softplus(dt_bias) is about 1.3 here)."""
    config = transformers.BambaConfig(**SIZES, intermediate_size=48, attn_layer_indices=[1, 3],
                                      time_step_limit=(0.01, 1.0),
                                      rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    return saved(tmp_path_factory.mktemp("bamba"), transformers.BambaForCausalLM, config)


@pytest.fixture(scope="module")
def granite_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite-4.0-H with experts (2 of 4) and a shared MLP, rope over whole heads, every multiplier != 1."""
    config = transformers.GraniteMoeHybridConfig(
        **SIZES, intermediate_size=24, shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "attention"], position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": 100.0}, embedding_multiplier=3.0,
        residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5)
    return saved(tmp_path_factory.mktemp("granite-moe"), transformers.GraniteMoeHybridForCausalLM, config)


@pytest.fixture(scope="module")
def granite_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite-4.0-H without experts (the shared MLP is the feed-forward), no rope, attention biases, tied
    embeddings."""
    config = transformers.GraniteMoeHybridConfig(
        **SIZES, intermediate_size=24, shared_intermediate_size=40, num_local_experts=0,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.4,
        logits_scaling=3.0, attention_bias=True, tie_word_embeddings=True)
    return saved(tmp_path_factory.mktemp("granite-dense"), transformers.GraniteMoeHybridForCausalLM, config)


@shared
def reference_of(directory: Path, dtype: Any) -> Callable[[Any], np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype],
                                                              experts_implementation="eager").eval()

    def reference(tokens: Any) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
        return logits
    return reference


def run_against_transformers(directory: Path, dtype: Any, storage: Any) -> GraniteHybridModel:
    model = load_hf(directory, dtype=dtype)
    assert isinstance(model, GraniteHybridModel)
    recorder = Recorder(reference_of(directory, dtype))
    with tempfile.TemporaryDirectory() as store:
        run_scenarios(model, recorder, storage=storage, store_path=Path(store))
    assert set(recorder.worst) == {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache",
                                   "prefix from a store"}
    return model


DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
STORAGES = pytest.mark.parametrize("storage", ["numpy", "torch"])


@DTYPES
@STORAGES
def test_bamba_equals_transformers_through_the_hybrid_memory(bamba: Path, dtype: Any, storage: str) -> None:
    model = run_against_transformers(bamba, dtype, storage)
    p = model.hparams
    assert p.attn_layers == (1, 3) and p.n_rot == 4 and p.head_dim == 8 and p.n_expert == 0
    assert p.attention.rope.style == "neox" and p.attention.rope.freq_base == 100.0
    assert p.time_step_limit == (0.01, 1.0)


@DTYPES
@STORAGES
def test_a_moe_granite_4_h_equals_transformers_through_the_hybrid_memory(granite_moe: Path, dtype: Any,
                                                                          storage: str) -> None:
    model = run_against_transformers(granite_moe, dtype, storage)
    p = model.hparams
    assert p.attn_layers == (1, 3) and p.n_rot == 8 and (p.n_expert, p.n_expert_used) == (4, 2)
    assert (p.n_ff, p.n_ff_shexp) == (24, 40) and p.attention.kq_scale == pytest.approx(0.2)


@DTYPES
@STORAGES
def test_a_dense_granite_4_h_without_rope_equals_transformers_through_the_hybrid_memory(
        granite_dense: Path, dtype: Any, storage: str) -> None:
    model = run_against_transformers(granite_dense, dtype, storage)
    p = model.hparams
    assert p.attn_layers == (2,) and p.n_rot == 0 and p.n_expert == 0 and p.n_ff == 40 and p.attention_bias
    assert model.tied


def test_the_index_path_a_gpu_runs_equals_transformers(granite_moe: Path) -> None:
    """Torch rows the core may not touch itself (``host_access=False``: every row moved by index arrays)."""
    from recurrent_cache.storage import TorchStorage

    run_against_transformers(granite_moe, np.float32, TorchStorage("cpu", host_access=False))


def test_both_classes_are_llama_cpps_granitehybrid_read_and_written_as_granite(bamba: Path) -> None:
    assert registry.by_hf_architecture("BambaForCausalLM") is BAMBA
    assert registry.by_hf_architecture("GraniteMoeHybridForCausalLM") is GRANITE
    assert registry.by_gguf_arch("granitehybrid") is GRANITE
    assert registry.of_model(load_hf(bamba)) is GRANITE


def test_a_second_family_of_one_architecture_is_refused_when_it_would_read_gguf_or_repeat_a_class(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("recurrent_cache.models._registry._FAMILIES", list(registry.families()))
    families = registry.families()
    with pytest.raises(ValueError, match="'granitehybrid' is registered twice"):
        registry.register(registry.Family(label="Bamba again", gguf_arch="granitehybrid",
                                          hf_architecture="BambaForCausalLM", model_class=GraniteHybridModel,
                                          from_hf=BAMBA.from_hf))
    with pytest.raises(ValueError, match="'granitehybrid' is registered twice"):
        registry.register(registry.Family(label="Granite reader", gguf_arch="granitehybrid",
                                          hf_architecture="OtherForCausalLM", model_class=GraniteHybridModel,
                                          from_hf=BAMBA.from_hf, from_gguf=lambda *args: None))
    assert registry.families() == families


def edited(checkpoint: Path, tmp_path: Path, **changes: Any) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    config.update(changes)
    (broken / "config.json").write_text(json.dumps(config))
    return broken


@pytest.mark.parametrize(("fixture", "changes", "field"), [
    ("bamba", {"attn_layer_indices": [1, 4]}, "attn_layer_indices"),
    ("bamba", {"attn_layer_indices": [1, 1]}, "attn_layer_indices"),
    ("bamba", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0}}, "rope_parameters"),
    ("bamba", {"mlp_bias": True}, "mlp_bias"),
    ("bamba", {"mamba_d_head": 8}, "mamba_d_head"),
    ("bamba", {"time_step_limit": [0.0, "inf"]}, "time_step_limit"),
    ("granite_moe", {"layer_types": ["mamba", "attention", "mamba", "sliding_attention"]}, "layer_types"),
    ("granite_moe", {"layer_types": ["mamba", "attention"]}, "layer_types"),
    ("granite_moe", {"position_embedding_type": "alibi"}, "position_embedding_type"),
    ("granite_moe", {"num_local_experts": -1}, "num_local_experts"),
    ("granite_moe", {"residual_multiplier": 0}, "residual_multiplier"),
    ("granite_moe", {"num_key_value_heads": 3}, "n_head_kv"),
])
def test_a_config_the_model_cannot_run_is_refused_naming_its_field(fixture: str, changes: dict[str, Any],
                                                                      field: str, tmp_path: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    with pytest.raises(ModelError, match=field):
        load_hf(edited(request.getfixturevalue(fixture), tmp_path, **changes))


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_expert": 2, "n_expert_used": 3}, "cannot use 3"),
    ({"n_expert": 2, "n_expert_used": 1, "n_ff_shexp": 0}, "n_ff_shexp"),
    ({"n_head_kv": 3}, "not a multiple of n_head_kv"),
    ({"n_rot": 10}, "n_rot 10 is larger than head_dim 8"),
    ({"n_ssm_head": 3}, "d_inner 64 is not a multiple of n_head 3"),
    ({"attn_layers": (4,)}, "outside"),
])
def test_inconsistent_sizes_are_a_model_error(changes: dict[str, Any], message: str) -> None:
    from recurrent_cache.models import GraniteHybridHParams

    sizes: dict[str, Any] = dict(n_vocab=96, n_embd=32, n_layer=4, n_head=4, n_head_kv=2, head_dim=8, n_ff=24,
                                 d_conv=4, d_inner=64, d_state=8, n_ssm_head=4, attn_layers=(1,), n_ff_shexp=40)
    with pytest.raises(ModelError, match=message):
        GraniteHybridHParams(**(sizes | changes))
