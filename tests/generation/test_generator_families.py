"""Every model family of the package through the one generation loop, unchanged: batched, chunked,
speculative and forked requests give the tokens of each request run alone (seeded sampling)."""

from __future__ import annotations

import pytest

from recurrent_cache.generation import Generator
from recurrent_cache.models import random_mamba2_model, random_model
from recurrent_cache.models.jamba import random_jamba_model
from recurrent_cache.models.lfm2 import random_lfm2_model
from recurrent_cache.models.nemotron_h import random_nemotron_h_model
from recurrent_cache.models.qwen3_next import random_qwen3_next_model

FAMILIES = [random_model, random_mamba2_model, random_jamba_model, random_lfm2_model, random_nemotron_h_model,
            random_qwen3_next_model]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [4, 5, 4, 5, 4, 5]]


@pytest.mark.parametrize("make", FAMILIES, ids=lambda make: make.__name__)
def test_each_family_serves_every_request_as_alone(make):
    model = make(seed=1)
    alone = [Generator(model).generate([p], max_new_tokens=6, temperature=0.8, seed=3)[0].tokens for p in PROMPTS]
    def drafts(history, k):   # every step: the last token again, then its successor (some right, some wrong)
        return [history[-1], (history[-1] + 1) % 256][:k]

    generator = Generator(model, n_seq_max=2, n_batch=4, n_ubatch=3, draft=drafts, n_draft=2)
    served = generator.generate(PROMPTS, max_new_tokens=6, temperature=0.8, seed=3)
    assert [r.tokens for r in served] == alone
    assert generator.stats.drafted > 0 and generator.stats.rollbacks > 0
    parent = generator.submit(PROMPTS[0], max_new_tokens=6, temperature=0.8, seed=3, n=2)
    for _ in generator.run_until_done():
        pass
    child = parent.forks[0]
    assert parent.tokens == alone[0]
    assert child.tokens == Generator(model).generate([PROMPTS[0]], max_new_tokens=6, temperature=0.8,
                                                     seed=child.sampler.seed)[0].tokens
