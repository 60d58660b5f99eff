"""Exactness with the numpy Mamba model: a sequence restored from a snapshot and continued
produces what a cold run produces, for f32, f16 and bf16 states.

The model rounds its state to the storage type after every token, so where a
prefill is cut does not change the result: a restored run (cut where the
snapshots were taken) equals a cold run in one piece, and the solo
``ReferenceRun`` token by token.
"""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import ReferenceRun, random_model

# Largest relative logits difference from the token-by-token ReferenceRun (as the demo's).
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2}
N_GENERATE = 4


@pytest.fixture(scope="module")
def model():
    return random_model(seed=3, n_vocab=64, n_embd=16, n_layer=2, d_state=4)


def feed(model, cache, seq: int, tokens, start: int, end: int, n_ubatch: int = 512) -> np.ndarray:
    """Run tokens[start:end] on seq; the logits after the last one."""
    batch = rc.Batch(token=list(tokens[start:end]), pos=list(range(start, end)), seq_id=[seq] * (end - start))
    return model.forward(cache.init_batch(batch, n_ubatch))[-1]


def generate(model, cache, seq: int, text: list[int], logits: np.ndarray) -> list[int]:
    """Greedy tokens; the state then covers text + all generated tokens but the last."""
    out = [int(np.argmax(logits))]
    while len(out) < N_GENERATE:
        logits = feed(model, cache, seq, text + out, len(text) + len(out) - 1, len(text) + len(out))
        out.append(int(np.argmax(logits)))
    return out


def cold(model, dtype: str, prompt: list[int], last_piece: int) -> tuple[np.ndarray, list[int], list[np.ndarray]]:
    """The prompt on a fresh cache, in two pieces split at ``last_piece`` (the start of the
    restored run's last piece): (last logits, generated tokens, final r and s rows)."""
    cache = model.new_cache(n_seq_max=1, dtype=dtype)
    if last_piece:
        feed(model, cache, 0, prompt, 0, last_piece)
    logits = feed(model, cache, 0, prompt, last_piece, len(prompt), n_ubatch=5)
    tokens = generate(model, cache, 0, prompt, logits)
    row = cache.cell(0)[2]
    return logits, tokens, [cache.r[il][row].copy() for il in range(cache.n_layer)] + \
        [cache.s[il][row].copy() for il in range(cache.n_layer)]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_restored_and_continued_equals_cold_runs(model, dtype):
    rng = np.random.default_rng(7)
    system = rng.integers(0, 64, 21).tolist()
    a = system + rng.integers(0, 64, 12).tolist()
    b = system + rng.integers(0, 64, 9).tolist()
    c = system + rng.integers(0, 64, 5).tolist()
    cache = model.new_cache(n_seq_max=2, dtype=dtype)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=8)
    restored = []
    conversation = None
    for step, prompt in enumerate([a, b, c, None, None]):
        if prompt is None:   # the next turn of the previous conversation
            prompt = conversation + rng.integers(0, 64, 6).tolist()
        seq = step % 2
        cache.seq_rm(seq, -1, -1)
        n = pc.restore(seq, prompt)
        restored.append(n)
        done = n
        for cut in pc.plan(prompt, n):
            last_piece = done
            logits = feed(model, cache, seq, prompt, done, cut, n_ubatch=5)
            pc.save(seq, prompt[:cut])
            done = cut
        tokens = generate(model, cache, seq, prompt, logits)
        conversation = prompt + tokens
        pc.save(seq, conversation[:-1])
        row = cache.cell(seq)[2]

        # a cold run split where the state came from does not matter (the states are rounded
        # after every token); the last piece's ubatches decide the order of the float sums
        cold_logits, cold_tokens, cold_rows = cold(model, dtype, prompt, last_piece)
        assert tokens == cold_tokens
        np.testing.assert_array_equal(logits, cold_logits)
        rows = [cache.r[il][row] for il in range(cache.n_layer)] + [cache.s[il][row] for il in range(cache.n_layer)]
        for ours, theirs in zip(rows, cold_rows):
            np.testing.assert_array_equal(ours, theirs)
        solo = ReferenceRun(model, dtype, dtype).feed(prompt)[-1]
        assert np.max(np.abs(logits - solo)) / np.max(np.abs(solo)) <= TOLERANCE[dtype]
    # B cut at the junction with A (21); C restored it; each later turn restored the previous turn whole
    assert restored[0] == 0 and restored[1] == 16 and restored[2] == 21
    assert restored[3] == len(c) + N_GENERATE - 1
    assert restored[4] > restored[3]


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_result_does_not_depend_on_where_the_prefill_is_cut(model, dtype):
    prompt = np.random.default_rng(11).integers(0, 64, 30).tolist()
    whole = model.new_cache(n_seq_max=1, dtype=dtype)
    expected = feed(model, whole, 0, prompt, 0, len(prompt))
    for cuts in ([1, 30], [7, 13, 29, 30], [15, 16, 30], list(range(1, 31))):
        cache = model.new_cache(n_seq_max=1, dtype=dtype)
        done = 0
        for cut in cuts:
            logits = feed(model, cache, 0, prompt, done, cut, n_ubatch=4)
            done = cut
        for il in range(cache.n_layer):   # the stored states: bit for bit
            np.testing.assert_array_equal(cache.r[il][0], whole.r[il][0])
            np.testing.assert_array_equal(cache.s[il][0], whole.s[il][0])
        # the logits come from the last ubatch, whose shape sets the order of the float64 sums
        np.testing.assert_allclose(logits, expected, rtol=1e-12, atol=1e-12)
