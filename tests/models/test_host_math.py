"""Torch storage on the CPU computed by the numpy forward over the tensors' memory (models/_host.py).

``model.forward`` on a cache whose rows are float32 / float16 / float64 CPU tensors runs the numpy math on
numpy views of them: the logits (a torch tensor) and every row the cache holds must then be bit for bit
what a numpy cache gives for the same script — on the host path and on the index path a GPU takes, for a
recurrent model and for hybrids (attention K/V rows, rollback step states).  bfloat16 rows, which numpy
cannot view, and ``native=True`` run torch's own ops (the torch math, checked against numpy within
tolerance by tests/models/test_torch_forward.py): here, that they do.
"""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import random_mamba2_model, random_model
from recurrent_cache.models.jamba import random_jamba_model
from recurrent_cache.models.qwen3_next import random_qwen3_next_model
from recurrent_cache.storage import TorchStorage

torch = pytest.importorskip("torch")
torch_forward = pytest.importorskip("recurrent_cache.models.torch_forward")

MODELS = {
    "mamba1": lambda dtype: random_model(3, n_vocab=64, n_embd=32, n_layer=2, d_state=8, dtype=dtype),
    "mamba2": lambda dtype: random_mamba2_model(4, n_vocab=64, n_embd=32, n_layer=2, d_state=8, head_dim=8,
                                                n_group=2, dtype=dtype),
    "jamba": lambda dtype: random_jamba_model(5, n_vocab=64, n_embd=32, dtype=dtype),
    "qwen3-next": lambda dtype: random_qwen3_next_model(6, n_vocab=64, n_embd=32, dtype=dtype),
}
STORAGES = {
    "torch": lambda: "torch",
    "torch-index-path": lambda: TorchStorage("cpu", host_access=False),
}


def new_cache(model, storage, dtype="f32"):
    hybrid = hasattr(model.hparams, "attn_layers")
    extra = {"kv_size": 64} if hybrid else {}
    return model.new_cache(n_seq_max=3, dtype=dtype, n_rollback=2, storage=storage, **extra)


def host(tensor) -> np.ndarray:
    return tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


def rows(cache) -> list[np.ndarray]:
    """Every state tensor the cache holds, as host arrays (K and V too for a hybrid)."""
    tensors = [t for t in (*cache.r, *cache.s) if t is not None]
    if hasattr(cache, "kv_tensors"):
        tensors += list(cache.kv_tensors)
    return [host(t) for t in tensors]


def script(model, cache, forward) -> list[np.ndarray]:
    """Prompts in ubatches of 2, decode steps, a draft of 3 taken back by 2, a fork; the logits of each batch."""
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(0, 64, n).tolist()   # noqa: E731
    lengths = {0: 5, 1: 3}
    out = []

    def run(tokens, pos, seqs, n_ubatch):
        st = cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seqs, logits=[1] * len(tokens)), n_ubatch)
        out.append(forward(st))

    run(draw(8), [p for s in (0, 1) for p in range(lengths[s])], [s for s in (0, 1) for _ in range(lengths[s])], 2)
    for _ in range(2):
        run(draw(2), [lengths[0], lengths[1]], [0, 1], 4)
        lengths = {s: n + 1 for s, n in lengths.items()}
    run(draw(3), [lengths[0] + k for k in range(3)], [0] * 3, 8)
    assert cache.seq_rm(0, lengths[0] + 1, -1)
    lengths[0] += 1
    cache.seq_cp(1, 2, -1, -1)
    lengths[2] = lengths[1]
    run(draw(3), [lengths[s] for s in range(3)], [0, 1, 2], 4)
    return out


@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("model_dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("architecture", list(MODELS))
def test_torch_cpu_rows_give_what_numpy_rows_give_bit_for_bit(architecture, model_dtype, storage):
    model = MODELS[architecture](model_dtype)
    on_numpy, on_torch = new_cache(model, "numpy"), new_cache(model, STORAGES[storage]())
    expected = script(model, on_numpy, model.forward)
    got = script(model, on_torch, model.forward)
    for want, have in zip(expected, got, strict=True):
        assert isinstance(have, torch.Tensor) and have.device.type == "cpu"
        np.testing.assert_array_equal(have.numpy(), want)
    for want, have in zip(rows(on_numpy), rows(on_torch), strict=True):
        np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("architecture", ["mamba1", "jamba"])
def test_f16_state_rows_are_viewed_too(architecture):
    model = MODELS[architecture](np.float32)
    on_numpy, on_torch = new_cache(model, "numpy", "f16"), new_cache(model, "torch", "f16")
    for want, have in zip(script(model, on_numpy, model.forward), script(model, on_torch, model.forward), strict=True):
        np.testing.assert_array_equal(have.numpy(), want)


class TorchCalls:
    """Counts the torch backend's forwards (each fetches the model's weights on the device once)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = torch_forward.TORCH.weights

        def counted(model, device):
            self.count += 1
            return original(model, device)

        monkeypatch.setattr(torch_forward.TORCH, "weights", counted)


@pytest.mark.parametrize("architecture", ["mamba2", "qwen3-next"])
def test_native_runs_torch_ops_and_host_views_do_not(architecture, monkeypatch):
    model = MODELS[architecture](np.float64)
    calls = TorchCalls(monkeypatch)
    script(model, new_cache(model, "torch"), model.forward)
    assert calls.count == 0
    expected = script(model, new_cache(model, "numpy"), model.forward)
    got = script(model, new_cache(model, "torch"), lambda st: model.forward(st, native=True))
    assert calls.count > 0
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have.numpy(), want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_bf16_rows_run_torch_ops(monkeypatch):
    model = MODELS["mamba1"](np.float32)
    calls = TorchCalls(monkeypatch)
    logits = script(model, new_cache(model, "torch", "bf16"), model.forward)
    assert calls.count > 0 and all(isinstance(batch, torch.Tensor) for batch in logits)


def test_a_bad_token_is_refused_through_the_views_too():
    model = MODELS["jamba"](np.float32)
    cache = new_cache(model, "torch")
    before = rows(cache)
    with pytest.raises(rc.ModelError, match="outside the vocabulary"):
        model.forward(cache.init_batch(rc.Batch(token=[1, 99], seq_id=[0, 0])))
    for want, have in zip(before, rows(cache), strict=True):
        np.testing.assert_array_equal(have, want)
