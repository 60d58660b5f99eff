"""Qwen3-Next without torch: a random model's sequences batched through the hybrid cache equal each run alone,
on every state dtype; the cache is shaped from the model; bad sizes are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.errors import ModelError
from recurrent_cache.models import Qwen3NextHParams, random_qwen3_next_model
from recurrent_cache.models._deltanet import DeltaNetParams

PROMPTS = ([5, 17, 200, 3, 9, 41, 8], [250, 1, 2], [77, 4, 4, 4])


def logits_by_token(model, cache, prompts, n_ubatch):
    """The prompts in one batch (ubatches of ``n_ubatch``), then two decode steps: logits by (seq, pos)."""
    tokens = [t for p in prompts for t in p]
    seq_ids = [s for s, p in enumerate(prompts) for _ in p]
    positions = [i for p in prompts for i in range(len(p))]
    got = {}
    for step in range(3):
        st = cache.init_batch(rc.Batch(token=tokens, pos=positions, seq_id=seq_ids, logits=[1] * len(tokens)),
                              n_ubatch)
        got |= {(seq_ids[i], positions[i]): row for i, row in zip(st.out_ids, model.forward(st))}
        tokens = [10 + step] * len(prompts)
        seq_ids = list(range(len(prompts)))
        positions = [len(p) + step for p in prompts]
    return got


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_batched_equals_each_sequence_alone(dtype):
    model = random_qwen3_next_model(seed=3, n_embd=32, head_dim=8, head_k_dim=8, head_v_dim=8, n_ff=48, n_ff_exp=16)
    together = logits_by_token(model, model.new_cache(n_seq_max=3, kv_size=64, dtype=dtype), PROMPTS, n_ubatch=3)
    for seq, prompt in enumerate(PROMPTS):
        alone = logits_by_token(model, model.new_cache(n_seq_max=1, kv_size=64, dtype=dtype), [prompt], n_ubatch=8)
        for pos in range(len(prompt) + 2):
            expected = alone[(0, pos)]
            # the states are rounded after every token; attention's and the experts' products over other rows
            # sum in another order
            np.testing.assert_allclose(together[(seq, pos)], expected, rtol=0, atol=1e-9 * np.abs(expected).max())


def test_the_cache_is_shaped_from_the_model():
    model = random_qwen3_next_model(seed=0, n_layer=4, attn_layers=(1, 3))
    p = model.hparams
    cache = model.new_cache(n_seq_max=2, kv_size=32)
    assert cache.attn_layers == (1, 3) and cache.recr_layers == (0, 2)
    assert cache.r[0].shape[1] == p.deltanet.n_embd_r == 3 * (2 * 2 * 16 + 4 * 16)
    assert cache.s[0].shape[1] == p.deltanet.n_embd_s == 4 * 16 * 16
    assert "Qwen3-Next" in p.describe()


def test_bad_sizes_are_refused_by_name():
    deltanet = DeltaNetParams(n_embd=32, d_conv=4, n_k_heads=1, n_v_heads=1, head_k_dim=8, head_v_dim=8)
    sizes = dict(n_vocab=16, n_embd=32, n_layer=2, n_head=2, n_head_kv=1, head_dim=8, n_rot=2, deltanet=deltanet,
                 attn_layers=(1,))
    Qwen3NextHParams(**sizes)
    for change, named in ((dict(n_embd=48), "n_embd 32 is not the model's 48"), (dict(n_rot=10), "n_rot 10"),
                          (dict(attn_layers=(2,)), "attn_layers"), (dict(n_head_kv=3), "n_head_kv 3"),
                          (dict(moe_layers=(0,), n_expert=2, n_expert_used=3), "cannot use 3")):
        with pytest.raises(ModelError, match=named):
            Qwen3NextHParams(**(sizes | change))
