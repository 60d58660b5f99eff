"""``recurrent_cache.generation.Generator`` on the numpy Mamba: every request's tokens equal the same
request run alone through the cache-free reference (``ReferenceRun``), whatever the batching, the
admission order, the chunking, the forks, the speculation or the prefix reuse; bad input raises
naming the value and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.generation import DraftModel, Generator, prompt_lookup
from recurrent_cache.models import ReferenceRun, Sampler, random_model

MODEL = random_model(seed=1)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6], [7, 7, 7, 7], [9] * 20, [3, 1], [200, 100, 50]]


def alone(prompt: list[int], n: int, sampler: Sampler, model=MODEL) -> list[int]:
    """``n`` tokens after ``prompt``, token by token from a zero state, no cache."""
    run = ReferenceRun(model)
    sampler = sampler.fresh()
    tokens = [sampler(run.feed(prompt)[-1])]
    while len(tokens) < n:
        tokens.append(sampler(run.feed(tokens[-1:])[-1]))
    return tokens


@pytest.mark.parametrize("n_seq_max, n_ubatch, n_batch",
                         [(1, 64, 2048), (3, 4, 7), (4, 1, 3), (6, 16, 5), (6, 4, 2048)])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_request_equals_its_solo_run(n_seq_max, n_ubatch, n_batch, temperature):
    generator = Generator(MODEL, n_seq_max=n_seq_max, n_ubatch=n_ubatch, n_batch=n_batch)
    requests = generator.generate(PROMPTS, max_new_tokens=7, temperature=temperature, top_k=20, seed=4)
    for prompt, request in zip(PROMPTS, requests):
        assert request.finish_reason == "length"
        assert request.tokens == alone(prompt, 7, request.sampler)
    assert generator.stats.peak_sequences == min(n_seq_max, len(PROMPTS))
    assert generator.stats.prompt_tokens == sum(map(len, PROMPTS))
    assert MODEL.new_cache().used == 0 and generator.cache.used == 0, "every finished request gave its cell back"


def test_a_long_prompt_is_chunked_and_does_not_stall_decoding():
    generator = Generator(MODEL, n_seq_max=2, n_batch=4)
    short = generator.submit([5, 6], max_new_tokens=6)
    long = generator.submit(list(range(40)), max_new_tokens=2)
    events = [generator.step() for _ in range(6)]
    # the short request decodes one token per step while the long prompt goes in 3 or 4 tokens at a time
    assert [sum(len(e.tokens) for e in step if e.request is short) for step in events] == [1, 1, 1, 1, 1, 1]
    assert long.tokens == [] and long.n_cached == 2 + 5 * 3
    for _ in generator.run_until_done():
        pass
    assert long.tokens == alone(list(range(40)), 2, long.sampler)


def test_admission_order_and_arrival_between_steps_do_not_matter():
    rng = np.random.default_rng(0)
    generator = Generator(MODEL, n_seq_max=2, n_batch=6)
    submitted = []
    for k in rng.permutation(len(PROMPTS)).tolist():
        submitted.append((PROMPTS[k], generator.submit(PROMPTS[k], max_new_tokens=5, temperature=1.0, seed=k)))
        for _ in range(int(rng.integers(0, 3))):
            generator.step()
    seen: dict[int, list[int]] = {}
    for event in generator.run_until_done():
        seen.setdefault(event.request.id, []).extend(event.tokens)
    for prompt, request in submitted:
        assert request.tokens == alone(prompt, 5, request.sampler)
        assert seen.get(request.id, []) == request.tokens[len(request.tokens) - len(seen.get(request.id, [])):]


def test_n_samples_fork_the_prompt_and_each_equals_its_solo_run():
    generator = Generator(MODEL, n_seq_max=4)
    request = generator.submit(PROMPTS[0], max_new_tokens=6, temperature=1.2, seed=3, n=3)
    for _ in generator.run_until_done():
        pass
    samples = [request, *request.forks]
    assert [s.sampler.seed for s in samples] == [3, (3, 1), (3, 2)]
    assert generator.stats.prompt_tokens == len(PROMPTS[0]), "the prompt ran once"
    for sample in samples:
        assert sample.tokens == alone(PROMPTS[0], 6, sample.sampler)
    assert len({tuple(s.tokens) for s in samples}) == 3


def test_fork_of_a_running_request_continues_from_where_it_is():
    generator = Generator(MODEL, n_seq_max=3)
    parent = generator.submit(PROMPTS[1], max_new_tokens=8, temperature=1.0, seed=1)
    for _ in range(3):
        generator.step()
    children = generator.fork(parent, 2, seeds=[10, 11])
    assert children[0].prompt == PROMPTS[1] + parent.tokens[:-1]
    for _ in generator.run_until_done():
        pass
    assert parent.tokens == alone(PROMPTS[1], 8, parent.sampler)
    for child in children:
        assert child.tokens == alone(child.prompt, 8, child.sampler)
    with pytest.raises(rc.ArgumentError, match="finished"):
        generator.fork(parent, 1)


def test_fork_without_free_sequences_raises_and_changes_nothing():
    generator = Generator(MODEL, n_seq_max=2)
    parent = generator.submit(PROMPTS[1], max_new_tokens=4)
    generator.submit(PROMPTS[2], max_new_tokens=4)
    generator.step()
    with pytest.raises(rc.NoFreeCellError, match="0 are free"):
        generator.fork(parent, 1)
    assert parent.forks == [] and len(generator.running) == 2 and generator.cache.used == 2


@pytest.mark.parametrize("draft", ["prompt lookup", "same model", "other model", "wrong"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_equals_plain_decoding_token_for_token(draft, temperature):
    source = {"prompt lookup": prompt_lookup, "same model": DraftModel(MODEL), "other model":
              DraftModel(random_model(seed=2)), "wrong": lambda history, k: [(history[-1] + 1) % 256] * k}[draft]
    prompts = PROMPTS + [[4, 5, 6, 4, 5, 6, 4, 5]]
    plain = Generator(MODEL, n_seq_max=3).generate(prompts, max_new_tokens=12, temperature=temperature, seed=6)
    generator = Generator(MODEL, n_seq_max=3, n_ubatch=5, draft=source, n_draft=4)
    fast = generator.generate(prompts, max_new_tokens=12, temperature=temperature, seed=6)
    assert [r.tokens for r in fast] == [r.tokens for r in plain]
    for a, b in zip(fast, plain):   # several tokens per ubatch sum in another order: float noise only
        assert np.max(np.abs(a.last_logits - b.last_logits)) <= 1e-5 * np.max(np.abs(b.last_logits))
    stats = generator.stats
    assert stats.drafted > 0 and stats.verify_steps > 0
    if draft == "same model" and temperature == 0:
        assert stats.accepted == stats.drafted and stats.rollbacks == 0
    if draft == "wrong":
        assert stats.rollbacks > 0
    assert generator.cache.used == 0


def test_speculation_needs_rollback_room():
    cache = MODEL.new_cache(n_seq_max=2, n_rollback=2)
    with pytest.raises(rc.ConfigError, match="n_rollback >= 3"):
        Generator(MODEL, cache, draft=prompt_lookup, n_draft=3)
    with pytest.raises(rc.ConfigError, match="n_draft"):
        Generator(MODEL, cache, draft=prompt_lookup)


def test_prefix_reuse_gives_the_recomputed_tokens_and_says_what_it_reused(tmp_path):
    system = list(range(1, 41))
    prompts = [system + [50, 51, 52], system + [60, 61], system + [70]]
    cold = Generator(MODEL, n_seq_max=2).generate(prompts, max_new_tokens=5)
    cache = MODEL.new_cache(n_seq_max=2)
    generator = Generator(MODEL, cache, prefix_cache=rc.PrefixCache(cache, 16 << 20, block_size=16))
    warm = [generator.generate([prompt], max_new_tokens=5)[0] for prompt in prompts]
    assert [r.tokens for r in warm] == [r.tokens for r in cold]
    assert [r.restored for r in warm] == [0, 32, 40]   # a grid point, then the junction B's cut made
    assert generator.stats.restored_tokens == 72
    assert generator.stats.prompt_tokens == sum(map(len, prompts)) - 72
    # the finished request's history was saved: its next turn restores all of it
    turn = warm[0].history[:-1]
    follow_up = generator.generate([turn + [99]], max_new_tokens=3)[0]
    assert follow_up.restored == len(turn)
    assert follow_up.tokens == alone(turn + [99], 3, follow_up.sampler)

    # a store behind it: a new generator (another process) restores what the first one saved, from
    # the block grid (the PrefixCache made for a store cuts every 256 tokens)
    namespace, long_system = "random_model seed 1", [t % 256 for t in range(300)]
    first = Generator(MODEL, n_seq_max=2, store=rc.stores.DirectoryStore(str(tmp_path)), namespace=namespace)
    first.generate([long_system + [1, 2]], max_new_tokens=1)
    second = Generator(MODEL, n_seq_max=2, store=rc.stores.DirectoryStore(str(tmp_path)), namespace=namespace)
    again = second.generate([long_system + [3]], max_new_tokens=3)[0]
    assert again.restored == 256 and second.stats.prompt_tokens == 301 - 256
    assert again.tokens == alone(long_system + [3], 3, again.sampler)


def test_stop_tokens_stop_strings_and_prefill_only_requests():
    text_model = random_model(seed=5)   # 256 byte tokens: a byte vocabulary
    generator = Generator(text_model, n_seq_max=2)
    free = generator.generate(["def f"], max_new_tokens=30)[0]
    stop_token = free.tokens[3]
    first = free.tokens.index(stop_token)
    by_token = generator.generate(["def f"], max_new_tokens=30, stop_tokens=[stop_token])[0]
    assert by_token.tokens == free.tokens[:first + 1] and by_token.finish_reason == "stop"
    text = text_model.vocab.decode(free.tokens)
    by_string = generator.generate(["def f"], max_new_tokens=30, stop=[text[4:6]])[0]
    end = text.index(text[4:6]) + 2
    assert text_model.vocab.decode(by_string.tokens) == text[:end] and by_string.finish_reason == "stop"
    prefill = generator.generate(["def f"], max_new_tokens=0)[0]
    assert prefill.tokens == [] and prefill.finish_reason == "length" and generator.stats.steps > 0


def test_cancel_frees_the_sequence_for_the_next_request():
    generator = Generator(MODEL, n_seq_max=1)
    first = generator.submit(PROMPTS[0], max_new_tokens=50)
    second = generator.submit(PROMPTS[1], max_new_tokens=3)
    generator.step()
    generator.cancel(first)
    for _ in generator.run_until_done():
        pass
    assert first.finish_reason == "cancelled" and second.tokens == alone(PROMPTS[1], 3, second.sampler)


@pytest.mark.parametrize("call, message", [
    (lambda g: g.submit([1, 256, 3]), "token 256 is outside the model's vocabulary"),
    (lambda g: g.submit([1, -1]), "token -1 is outside"),
    (lambda g: g.submit([]), "the prompt is empty"),
    (lambda g: g.submit([1.5, 2]), "prompt must be a 1-D array of integers"),
    (lambda g: g.submit([1], max_new_tokens=-1), "max_new_tokens"),
    (lambda g: g.submit([1], max_new_tokens=2**31 - 1), "longer than int32 positions allow"),
    (lambda g: g.submit([1], temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    (lambda g: g.submit([1], top_p=0.0), "top_p must be a number in \\(0, 1\\], got 0.0"),
    (lambda g: g.submit([1], stop_tokens=[300]), "stop_tokens: token 300"),
    (lambda g: g.submit([1], stop=[""]), "stop strings must be non-empty"),
    (lambda g: g.submit([1], n=3), "n = 3 samples need as many sequences"),
    (lambda g: g.submit("caf\u00e9", max_new_tokens=1, stop=["x"], n=0), "n must be"),
])
def test_bad_requests_raise_naming_the_value_and_change_nothing(call, message):
    generator = Generator(MODEL, n_seq_max=2)
    running = generator.submit([1, 2], max_new_tokens=3)
    generator.step()
    before = (len(generator.waiting), list(generator.running), generator.cache.seq_pos_max(0), generator.stats.steps)
    with pytest.raises(rc.ArgumentError, match=message):
        call(generator)
    assert (len(generator.waiting), list(generator.running), generator.cache.seq_pos_max(0),
            generator.stats.steps) == before
    for _ in generator.run_until_done():
        pass
    assert running.tokens == alone([1, 2], 3, running.sampler)


def test_text_without_a_vocabulary_is_refused():
    generator = Generator(random_model(seed=0, n_vocab=100))   # no byte vocabulary: token ids only
    with pytest.raises(rc.ArgumentError, match="no vocabulary"):
        generator.submit("hello")
    with pytest.raises(rc.ArgumentError, match="need a model with a vocabulary"):
        generator.submit([1, 2], stop=["x"])
    assert not generator.waiting


def test_bad_generator_options_raise_config_errors():
    with pytest.raises(rc.ConfigError, match="n_seq_max 3 is more than the cache's 2"):
        Generator(MODEL, MODEL.new_cache(n_seq_max=2), n_seq_max=3)
    with pytest.raises(rc.ConfigError, match="n_batch"):
        Generator(MODEL, n_batch=0)
    with pytest.raises(rc.ConfigError, match="store"):
        cache = MODEL.new_cache()
        Generator(MODEL, cache, prefix_cache=rc.PrefixCache(cache, 1 << 20), store=object())


def test_a_draft_outside_the_vocabulary_raises_before_the_step_changes_anything():
    generator = Generator(MODEL, n_seq_max=2, draft=lambda history, k: [999], n_draft=2)
    running = generator.submit(PROMPTS[1], max_new_tokens=4)
    waiting = generator.submit(PROMPTS[2], max_new_tokens=4)
    generator.submit(PROMPTS[3], max_new_tokens=4)
    generator.step()
    generator.cancel(running)
    running = generator.submit(PROMPTS[1], max_new_tokens=4)
    before = (generator.stats.steps, [r.id for r in generator.running], len(generator.waiting),
              generator.cache.seq_pos_max(waiting.seq))
    with pytest.raises(rc.ArgumentError, match="draft: token 999 is outside the model's vocabulary"):
        generator.step()
    assert (generator.stats.steps, [r.id for r in generator.running], len(generator.waiting),
            generator.cache.seq_pos_max(waiting.seq)) == before


def test_top_p_draws_from_the_nucleus_only():
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3]))
    drawn = {Sampler(1.0, 0, seed, top_p=0.75)(logits) for seed in range(200)}
    assert drawn == {1, 3}                       # 0.5 + 0.3 pass 0.75: the two most likely only
    assert {Sampler(1.0, 0, seed, top_p=0.1)(logits) for seed in range(50)} == {1}
    assert {Sampler(1.0, 0, seed)(logits) for seed in range(200)} == {0, 1, 2, 3}
    assert "top-p 0.8" in str(Sampler(1.0, 0, 1, top_p=0.8))
