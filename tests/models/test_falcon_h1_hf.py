"""Falcon-H1 from a transformers checkpoint on the hybrid memory equals transformers' own forward (issue 27):
the scenarios of ``hybrid_scenarios`` in float64 and float32, numpy and torch storage, every multiplier of the
config away from 1 (folded into the weights at load)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.errors import ModelError
from recurrent_cache.models import FalconH1Model, load_hf, random_falcon_h1_model
from recurrent_cache.storage import TorchStorage

from hybrid_scenarios import Recorder, host, run_scenarios, shared

torch = pytest.importorskip("torch", reason="the reference is transformers' FalconH1ForCausalLM (needs torch)")
transformers = pytest.importorskip("transformers", reason="the reference is transformers' FalconH1ForCausalLM")

TORCH_DTYPES = {np.float64: torch.float64, np.float32: torch.float32}
SCENARIOS = {"prompt", "decode", "fork", "state bytes", "rollback", "prefix cache", "prefix from a store"}

# every multiplier a different factor, none 1, so that one folded into the wrong weight (or forgotten) shows
MULTIPLIERS = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, attention_in_multiplier=0.8,
                   attention_out_multiplier=1.3, key_multiplier=0.7, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                   ssm_multipliers=[0.5, 1.5, 0.3, 3.0, 0.7], mlp_multipliers=[0.9, 1.4])
# the Mamba block's options beside the released checkpoints' (mamba_rms_norm off, untied, no attention bias)
VARIANTS = {
    "released": {},
    "norm before gate, biases, tied": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True,
                                           tie_word_embeddings=True),
    "norm after gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
}


def perturbed(model: Any, seed: int) -> None:
    """Move every norm weight, bias, A_log and D away from its initial value, so that a formula that
    forgets one cannot hide behind ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1 or name.endswith(("A_log", "D")):
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Falcon-H1s, one per variant: 3 layers, attention heads of 12 (not hidden / heads = 8), Mamba-2
    of 4 heads of 12 in 2 groups (d_inner = mamba_d_ssm = 48, not mamba_expand * hidden = 64), rope base 500."""
    directories = {}
    for name, options in VARIANTS.items():
        config = transformers.FalconH1Config(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head="auto",
            mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, **MULTIPLIERS, **options)
        torch.manual_seed(0)
        model = transformers.FalconH1ForCausalLM(config)
        perturbed(model, 1)
        directory = tmp_path_factory.mktemp("falcon_h1")
        model.save_pretrained(directory)
        directories[name] = Path(directory)
    return directories


@shared
def reference_of(directory: Path, dtype: Any) -> Callable[[Any], np.ndarray]:
    model = transformers.FalconH1ForCausalLM.from_pretrained(directory, dtype=TORCH_DTYPES[dtype]).eval()

    def reference(tokens: Any) -> np.ndarray:
        with torch.no_grad():
            logits: np.ndarray = model(torch.tensor([list(tokens)])).logits[0].double().numpy()
        return logits
    return reference


def _run(directory: Path, dtype: Any, storage: Any) -> FalconH1Model:
    model = load_hf(directory, dtype=dtype)
    assert isinstance(model, FalconH1Model)
    recorder = Recorder(reference_of(directory, dtype))
    with tempfile.TemporaryDirectory() as store:
        run_scenarios(model, recorder, storage=storage, store_path=Path(store))
    assert set(recorder.worst) == SCENARIOS
    return model


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("storage", ["numpy", "torch", "torch-index"])
def test_falcon_h1_equals_transformers_through_the_hybrid_memory(checkpoints: dict[str, Path], dtype: Any,
                                                                 storage: Any) -> None:
    """torch-index: torch storage without host access, the path a GPU's rows take (on the CPU here)."""
    if storage == "torch-index":
        storage = TorchStorage("cpu", host_access=False)
    model = _run(checkpoints["released"], dtype, storage)
    p = model.hparams
    assert p.attn_layers == p.recr_layers == (0, 1, 2)
    assert not p.ssm_norm and "ssm_norm" not in model.layers[0]


@pytest.mark.parametrize(("variant", "dtype", "storage"), [
    ("norm before gate, biases, tied", np.float64, "numpy"),
    ("norm before gate, biases, tied", np.float32, "torch"),
    ("norm after gate", np.float32, "numpy"),
])
def test_the_mamba_norm_options_biases_and_tied_embeddings_equal_transformers(checkpoints: dict[str, Path],
                                                                              variant: str, dtype: Any,
                                                                              storage: str) -> None:
    model = _run(checkpoints[variant], dtype, storage)
    assert model.hparams.ssm_norm and model.hparams.norm_before_gate == (variant != "norm after gate")


def test_each_multiplier_is_folded_into_the_weight_it_scales(checkpoints: dict[str, Path]) -> None:
    """The folded weights against transformers' own tensors times the multipliers, the Mamba input's per-row
    factors from transformers' mup_vector (its z, x, B, C, dt blocks: a B / C swap hides in the logits' 1e-4)."""
    directory = checkpoints["released"]
    model = load_hf(directory)
    reference = transformers.FalconH1ForCausalLM.from_pretrained(directory, dtype=torch.float64)
    m = MULTIPLIERS
    for il, block in enumerate(reference.model.layers):
        mamba, attention, mlp = block.mamba, block.self_attn, block.feed_forward
        expected = {
            "ssm_in": mamba.in_proj.weight * mamba.mup_vector[0, 0][:, None] * m["ssm_in_multiplier"],
            "ssm_out": mamba.out_proj.weight * m["ssm_out_multiplier"],
            "wq": attention.q_proj.weight * m["attention_in_multiplier"],
            "wk": attention.k_proj.weight * m["attention_in_multiplier"] * m["key_multiplier"],
            "wv": attention.v_proj.weight * m["attention_in_multiplier"],
            "wo": attention.o_proj.weight * m["attention_out_multiplier"],
            "ffn_gate": mlp.gate_proj.weight * m["mlp_multipliers"][0],
            "ffn_up": mlp.up_proj.weight,
            "ffn_down": mlp.down_proj.weight * m["mlp_multipliers"][1],
        }
        for field, weight in expected.items():
            # rtol: transformers keeps mup_vector in float32 (0.3 is 0.30000001)
            np.testing.assert_allclose(model.layers[il][field], weight.detach().numpy(), rtol=1e-7,
                                       err_msg=f"layer {il}'s {field}")
    embedding = reference.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_allclose(model.token_embd, embedding * m["embedding_multiplier"], rtol=1e-12)
    np.testing.assert_allclose(model.output, reference.lm_head.weight.detach().numpy() * m["lm_head_multiplier"],
                               rtol=1e-12)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mlp_bias", True, "biases"),
    ("projectors_bias", True, "biases"),
    ("ssm_multipliers", [1.0, 1.0, 1.0, 1.0], "5 finite numbers"),
    ("key_multiplier", "large", "finite number"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}, "default rope"),
])
def test_a_config_the_package_cannot_compute_is_refused_naming_its_field(checkpoints: dict[str, Path],
                                                                          tmp_path: Path, field: str, value: Any,
                                                                          message: str) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["released"], broken)
    config = json.loads((broken / "config.json").read_text())
    config[field] = value
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"{field}.*{message}"):
        load_hf(broken)


def test_a_random_falcon_h1_computes_the_same_on_numpy_and_torch_storage() -> None:
    model = random_falcon_h1_model(seed=3, n_vocab=64, n_embd=32, n_ff=48, head_dim=8, ssm_head_dim=8, d_state=8,
                                   ssm_norm=True)
    tokens = [1, 5, 9, 33, 2, 60]
    batch = rc.Batch(token=tokens, seq_id=[0] * len(tokens), pos=list(range(len(tokens))), logits=[1] * len(tokens))
    logits = []
    for storage in ("numpy", "torch"):
        cache = model.new_cache(kv_size=16, storage=storage)
        logits.append(host(model.forward(cache.init_batch(batch))))
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-10 * np.abs(logits[0]).max())
