"""The byte-level Mamba shipped with the package: its file, its logits, its generation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.cli.generate import generate
from recurrent_cache.models import (TRAINED_GGUF, ReferenceRun, Sampler, held_out_prompts, trained_model,
                                    training_facts)
from recurrent_cache.models.gguf_file import GGUFFile
from recurrent_cache.models.mamba import LAYER_TENSORS

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "byte_mamba_reference.npz"


@pytest.fixture(scope="module")
def model():
    return trained_model(dtype=np.float64)


def test_shipped_file_is_small_and_uses_llama_cpp_names():
    assert TRAINED_GGUF.stat().st_size <= 8 * 2**20
    gguf = GGUFFile(TRAINED_GGUF)
    n_layer = gguf.fields["mamba.block_count"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{il}.{suffix}" for il in range(n_layer) for suffix in LAYER_TENSORS.values()}
    assert set(gguf.tensors) == expected
    assert gguf.fields["general.architecture"] == "mamba"
    assert gguf.tensors["blk.0.ssm_in.weight"].type_name == "F16"      # llama.cpp's --outtype f16 layout
    assert gguf.tensors["blk.0.ssm_conv1d.weight"].type_name == "F32"


def test_logits_on_a_held_out_snippet_match_those_recorded_at_training(model):
    """The numpy forward (float64) against JAX's (float32) on the GGUF's f16 weights."""
    recorded = np.load(REFERENCE)
    tokens, expected = recorded["tokens"].tolist(), recorded["logits"]
    alone = ReferenceRun(model).feed(tokens)
    assert np.abs(alone - expected).max() <= 1e-4
    # through the cache, split into ubatches, every position an output
    cache = model.new_cache(n_seq_max=1)
    st = cache.init_batch(rc.Batch(token=tokens, seq_id=[0] * len(tokens), logits=[1] * len(tokens)), 7)
    served = model.forward(st)[np.argsort(st.out_ids)]
    assert np.abs(served - expected).max() <= 1e-4


def test_greedy_generation_is_deterministic_and_equals_a_plain_loop(model):
    prompt = model.vocab.encode("def fibonacci(n):\n")
    first, _ = generate(model, prompt, 40, Sampler(), n_ubatch=5, dtype="f32")
    second, _ = generate(model, prompt, 40, Sampler(), n_ubatch=64, dtype="f32")
    assert first == second
    run = ReferenceRun(model)
    logits = run.feed(prompt)[-1]
    plain = []
    for _ in range(40):
        plain.append(int(np.argmax(logits)))
        logits = run.feed(plain[-1:])[-1]
    assert first == plain


def test_it_writes_python_looking_text(model):
    """Trained, not random: continuations are mostly printable ASCII with newlines and indentation."""
    text = b""
    for prompt in held_out_prompts()[:4]:
        tokens, _ = generate(model, model.vocab.encode(prompt), 60, Sampler(), n_ubatch=64, dtype="f32")
        text += model.vocab.decode(tokens)
    printable = sum(32 <= b < 127 or b in b"\n" for b in text) / len(text)
    assert printable > 0.95 and b"\n" in text


def test_held_out_bits_per_byte_recorded_and_reproduced(model):
    facts = training_facts()
    assert facts["held_out_bits_per_byte"] <= 2.5
    assert facts["command"].startswith("python tools/train_byte_mamba.py")
    # the numpy model's own bits per byte on the held-out prompts (each from a zero state, so
    # worse than the training figure over 1024-byte windows, but far below a uniform model's 8)
    bits = []
    for prompt in held_out_prompts():
        data = model.vocab.encode(prompt)
        logits = ReferenceRun(model).feed(data[:-1])
        top = logits.max(axis=1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        bits.extend(-logp[np.arange(len(data) - 1), data[1:]] / np.log(2))
    assert np.mean(bits) < 3.5
