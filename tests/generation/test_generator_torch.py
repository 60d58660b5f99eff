"""The generator on torch storage (the model runs on the cache's device, the logits come back to the
host once per step): the same tokens as on numpy storage, greedy and sampled, with speculation."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch storage needs torch: pip install '.[torch]'")

from recurrent_cache.generation import Generator, prompt_lookup  # noqa: E402
from recurrent_cache.models import random_model  # noqa: E402

MODEL = random_model(seed=1)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6], [4, 5, 6, 4, 5, 6, 4]]


@pytest.mark.parametrize("host_access", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_torch_storage_gives_the_numpy_tokens(host_access, temperature):
    from recurrent_cache.storage import TorchStorage

    on_numpy = Generator(MODEL, n_seq_max=2, n_ubatch=3, draft=prompt_lookup, n_draft=3)
    on_torch = Generator(MODEL, n_seq_max=2, n_ubatch=3, draft=prompt_lookup, n_draft=3,
                         storage=TorchStorage("cpu", host_access=host_access))
    expected = on_numpy.generate(PROMPTS, max_new_tokens=8, temperature=temperature, seed=2)
    served = on_torch.generate(PROMPTS, max_new_tokens=8, temperature=temperature, seed=2)
    assert [r.tokens for r in served] == [r.tokens for r in expected]
    for a, b in zip(served, expected):
        assert isinstance(a.last_logits, np.ndarray)
        assert np.max(np.abs(a.last_logits - b.last_logits)) <= 1e-5 * np.max(np.abs(b.last_logits))


def test_a_hybrid_model_on_torch_storage_gives_the_numpy_tokens():
    from recurrent_cache.models.jamba import random_jamba_model

    jamba = random_jamba_model(seed=3)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [4, 5, 4, 5, 4]]
    expected = Generator(jamba, n_seq_max=2, n_batch=4, draft=prompt_lookup, n_draft=2).generate(prompts,
                                                                                                 max_new_tokens=6)
    served = Generator(jamba, n_seq_max=2, n_batch=4, draft=prompt_lookup, n_draft=2,
                       storage="torch").generate(prompts, max_new_tokens=6)
    assert [r.tokens for r in served] == [r.tokens for r in expected]
