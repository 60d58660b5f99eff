"""Issue 28's attack on the generator with a hybrid model: every bad request and every bad argument is
the package's exception naming the value (they were raw ``TypeError`` / ``AttributeError``), with
nothing queued; a prefix cache over another memory is refused before it could restore into it."""

from __future__ import annotations

import pytest

import recurrent_cache as rc
from recurrent_cache.generation import Generator
from recurrent_cache.hybrid_prefix import HybridPrefixCache
from recurrent_cache.models.jamba import random_jamba_model

MODEL = random_jamba_model(seed=3)


@pytest.mark.parametrize(("options", "words"), [
    (dict(seed=object()), "seed <object"), (dict(seed=1.5), "seed 1.5"),
    (dict(stop=None), "stop must be a string or a sequence"), (dict(stop=5), "stop must be"),
])
def test_a_bad_request_is_an_argument_error_queueing_nothing(options, words):
    generator = Generator(MODEL, n_seq_max=2)
    with pytest.raises(rc.ArgumentError, match=words):
        generator.submit([1, 2, 3], **options)
    assert generator.done and not generator.waiting


@pytest.mark.parametrize("prompts", ["abc", b"abc", 5, None])
def test_generate_takes_a_sequence_of_prompts_not_one(prompts):
    generator = Generator(MODEL, n_seq_max=2)
    with pytest.raises(rc.ArgumentError, match="a sequence of prompts"):
        generator.generate(prompts)
    assert generator.done


def test_fork_of_something_that_is_not_a_request():
    generator = Generator(MODEL, n_seq_max=2)
    with pytest.raises(rc.ArgumentError, match="fork takes a Request"):
        generator.fork(object(), 1)


def test_constructor_arguments_that_cannot_serve_are_config_errors():
    cache = MODEL.new_cache(n_seq_max=2)
    other = MODEL.new_cache(n_seq_max=2)
    with pytest.raises(rc.ConfigError, match="cache must be a RecurrentCache or a HybridCache"):
        Generator(MODEL, object())
    with pytest.raises(rc.ConfigError, match="prefix_cache must be"):
        Generator(MODEL, cache, prefix_cache=object())
    with pytest.raises(rc.ConfigError, match="another cache"):
        Generator(MODEL, cache, prefix_cache=HybridPrefixCache(other, max_bytes=1 << 20))
    with pytest.raises(rc.ConfigError, match="draft must be a DraftModel or a callable"):
        Generator(MODEL, draft=5, n_draft=1)
    assert Generator(MODEL, cache, prefix_cache=HybridPrefixCache(cache, max_bytes=1 << 20)).cache is cache
