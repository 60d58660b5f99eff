"""The generator on a hybrid model (``random_jamba_model``: Mamba layers, an attention layer, MoE),
whose ``new_cache`` gives a ``HybridCache``, through the same public interface: batched, chunked,
forked, speculative and prefix-restored requests give the tokens of the same request run alone."""

from __future__ import annotations

import pytest

import recurrent_cache as rc
from recurrent_cache.generation import DraftModel, Generator, prompt_lookup
from recurrent_cache.models.jamba import random_jamba_model

MODEL = random_jamba_model(seed=3)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], [7, 7, 7, 7, 7], [4, 5, 6, 4, 5, 6, 4], [200]]


def alone(prompt, n, **options):
    """The request alone on a fresh one-sequence cache, its prompt in one step."""
    return Generator(MODEL, n_seq_max=1).generate([prompt], max_new_tokens=n, **options)[0].tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_and_chunked_requests_equal_their_solo_runs(temperature):
    generator = Generator(MODEL, n_seq_max=3, n_ubatch=3, n_batch=5)
    assert isinstance(generator.cache, rc.HybridCache)
    requests = generator.generate(PROMPTS, max_new_tokens=6, temperature=temperature, seed=5)
    for prompt, request in zip(PROMPTS, requests):
        assert request.tokens == alone(prompt, 6, temperature=temperature, seed=5)
    assert generator.cache.kv_used == 0, "finished requests gave their KV cells back"


def test_forks_share_the_prompt_and_each_equals_its_solo_run():
    generator = Generator(MODEL, n_seq_max=3)
    request = generator.submit(PROMPTS[0], max_new_tokens=5, temperature=1.0, seed=2, n=3)
    for _ in generator.run_until_done():
        pass
    assert generator.stats.prompt_tokens == len(PROMPTS[0])
    for sample in [request, *request.forks]:
        assert sample.tokens == alone(PROMPTS[0], 5, temperature=1.0, seed=sample.sampler.seed)


@pytest.mark.parametrize("draft", [prompt_lookup, "same model", lambda history, k: [history[-1]] * k])
def test_speculation_rolls_both_halves_back_and_equals_greedy(draft):
    source = DraftModel(MODEL) if draft == "same model" else draft
    plain = Generator(MODEL, n_seq_max=3).generate(PROMPTS, max_new_tokens=10)
    generator = Generator(MODEL, n_seq_max=3, draft=source, n_draft=3)
    fast = generator.generate(PROMPTS, max_new_tokens=10)
    assert [r.tokens for r in fast] == [r.tokens for r in plain]
    assert generator.stats.drafted > 0


def test_prefix_reuse_through_a_hybrid_prefix_cache():
    cache = MODEL.new_cache(n_seq_max=2)
    generator = Generator(MODEL, cache, prefix_cache=rc.HybridPrefixCache(cache, 8 << 20, block_size=4))
    system = list(range(1, 19))
    first = generator.generate([system + [30, 31]], max_new_tokens=4)[0]
    turn = first.history[:-1]
    again = generator.generate([turn + [40]], max_new_tokens=4)[0]
    assert again.restored == len(turn)
    assert again.tokens == alone(turn + [40], 4)
    whole = generator.generate([system + [30, 31]], max_new_tokens=4)[0]   # held whole: all but the last token
    assert whole.restored == len(system) + 1 and whole.tokens == first.tokens
    # a prompt the cache holds whole (the first turn's end): the longest prefix short of its last token
    exact = generator.generate([turn], max_new_tokens=4)[0]
    assert exact.restored == len(system) + 1 and exact.tokens == alone(turn, 4)


def test_a_request_longer_than_the_kv_cells_is_refused():
    generator = Generator(MODEL, n_seq_max=2, kv_size=16)
    with pytest.raises(rc.ArgumentError, match="longer than the cache's 16 KV cells"):
        generator.submit(list(range(10)), max_new_tokens=7)
    assert not generator.waiting
    # two requests of 10 cells each wait for each other rather than overfill the 16 cells
    requests = generator.generate([list(range(5)), list(range(6, 11))], max_new_tokens=5)
    assert generator.stats.peak_sequences == 1
    assert [r.tokens for r in requests] == [alone(list(range(5)), 5), alone(list(range(6, 11)), 5)]
