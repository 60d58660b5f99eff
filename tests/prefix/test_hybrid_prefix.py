"""Prefix reuse for hybrids: the KV rows of a prefix and the recurrent state at exactly its last token.

The made-up model of ``tests/core/hybrid_model.py`` writes rows that name their history, so a
restored sequence is checked to hold exactly the saving sequence's rows at those positions (the
history oracle), and to go on from there.  Budget tests count blocks and snapshots from the cache's
row sizes; a brute force gives the longest saved prefix of random prompts.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from recurrent_cache import HybridCache, HybridPrefixCache
from recurrent_cache.errors import ArgumentError, PositionError

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot

BLOCK = 4


def make(engine: str = "compiled", **kw) -> HybridCache:
    args = dict(attn_layers=[1], recr_layers=[0, 1], n_embd_k=4, n_embd_v=2, n_embd_r=3, n_embd_s=5, kv_size=128,
                n_seq_max=4, dtype_k="f32", dtype_v="f32", engine=engine)
    args.update(kw)
    return HybridCache(2, **args)


@pytest.fixture(params=["compiled", "reference"])
def engine(request) -> str:
    return request.param


def prefill(cache: HybridCache, histories: Histories, seq: int, tokens: list[int], start: int = 0) -> None:
    decode(cache, histories, {seq: tokens[start:]}, n_ubatch=5)


def test_a_saved_prefix_is_restored_into_another_sequence_exactly(engine):
    cache, histories = make(engine), Histories(4)
    prompt = list(range(1, 11))                                 # 10 tokens: 2 blocks and a tail of 2
    prefill(cache, histories, 0, prompt)
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 20, block_size=BLOCK)
    assert prefixes.save(0, prompt)
    assert prefixes.match(prompt + [99, 98]) == 10 and prefixes.match([1, 2, 3]) == 0
    assert prefixes.restore(2, prompt + [99, 98]) == 10
    histories.copy(0, 2)
    assert_holds_its_history(cache, histories)
    decode(cache, histories, {2: [99, 98], 0: [7]})            # each goes on from there
    assert_holds_its_history(cache, histories)
    cache.check()


def test_the_longest_prefix_at_any_token(engine):
    cache, histories = make(engine), Histories(4)
    prompt = list(range(1, 23))
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 20, block_size=BLOCK)
    done = 0
    for cut in (5, 13, 21):                                     # off the block grid, every one
        prefill(cache, histories, 0, prompt[:cut], done)
        assert prefixes.save(0, prompt[:cut])
        done = cut
    other = prompt[:15] + [50, 51]
    assert prefixes.match(other) == 13
    assert prefixes.restore(3, other) == 13
    histories.copy(0, 3)
    histories.keep_before(3, 13)
    assert_holds_its_history(cache, histories)


def test_a_shared_prefix_keeps_its_rows_once(engine):
    cache, histories = make(engine), Histories(4)
    common = list(range(1, 17))                                 # 4 full blocks
    first, second = common + [40, 41, 42], common + [60]
    prefill(cache, histories, 0, first)
    prefill(cache, histories, 1, second)
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 20, block_size=BLOCK)
    assert prefixes.save(0, first) and prefixes.save(1, second)
    token, state = cache.kv_bytes_per_token, cache.recurrent_bytes_per_seq
    assert token == 4 * 4 + 2 * 4 and state == 2 * (3 + 5) * 4
    assert prefixes.nbytes == 16 * token + (3 + 1) * token + 2 * state   # the 16 common tokens once


def test_the_budget_holds_evicts_and_frees_blocks(engine):
    cache, histories = make(engine, kv_size=256), Histories(4)
    token, state = cache.kv_bytes_per_token, cache.recurrent_bytes_per_seq
    budget = 2 * (8 * token + state)                           # room for two 8-token prefixes
    prefixes = HybridPrefixCache(cache, max_bytes=budget, block_size=BLOCK)
    for seq, base in enumerate((100, 200, 300)):
        prompt = list(range(base, base + 8))
        prefill(cache, histories, seq, prompt)
        prefixes.save(seq, prompt)
        assert prefixes.nbytes <= budget
    assert len(prefixes) == 2 and prefixes.stats()["evicted"] + prefixes.stats()["refused"] == 1
    assert prefixes.match(list(range(100, 108))) == 0 or prefixes.match(list(range(300, 308))) == 0
    assert prefixes.restore(3, list(range(200, 208))) == 8     # used: worth more now
    long_prompt = list(range(500, 540))                         # worth less per byte than what is held
    cache.seq_rm(0, -1, -1)
    prefill(cache, histories, 0, long_prompt)
    held = prefixes.nbytes
    assert prefixes.save(0, long_prompt) is False               # refused: nothing flushed, nothing kept
    assert prefixes.nbytes == held                              # its blocks went with it
    assert prefixes.match(list(range(200, 208))) == 8 and prefixes.match(long_prompt) == 0
    assert prefixes.nbytes <= budget


def test_restore_refuses_a_sequence_that_holds_tokens_and_changes_nothing(engine):
    cache, histories = make(engine), Histories(4)
    prefill(cache, histories, 0, [1, 2, 3, 4, 5])
    prefill(cache, histories, 1, [9])
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 20, block_size=BLOCK)
    prefixes.save(0, [1, 2, 3, 4, 5])
    before = snapshot(cache)
    with pytest.raises(ArgumentError, match="holds positions"):
        prefixes.restore(1, [1, 2, 3, 4, 5])
    assert same(before, snapshot(cache))
    with pytest.raises(PositionError, match="not exactly 0 .. 2"):
        prefixes.save(0, [1, 2, 3])
    with pytest.raises(ArgumentError, match="HybridCache"):
        HybridPrefixCache(object(), 100)


def test_the_longest_saved_prefix_equals_a_brute_force():
    cache, histories = make(kv_size=1024), Histories(4)
    prefixes = HybridPrefixCache(cache, max_bytes=1 << 30, block_size=BLOCK)
    rng = random.Random(5)
    saved: list[tuple[int, ...]] = []
    for _ in range(25):
        prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        cache.seq_rm(0, -1, -1)
        histories.forget(0)
        prefill(cache, histories, 0, prompt)
        assert prefixes.save(0, prompt)
        saved.append(tuple(prompt))
        probe = [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        expected = max((len(p) for p in saved if tuple(probe[:len(p)]) == p), default=0)
        assert prefixes.match(probe) == expected


@pytest.mark.needs_torch
def test_torch_storage_restores_on_the_index_path():
    pytest.importorskip("torch")
    from recurrent_cache.storage import TorchStorage
    for storage in (TorchStorage("cpu"), TorchStorage("cpu", host_access=False)):
        cache, histories = make(storage=storage), Histories(4)
        prompt = list(range(1, 12))
        prefill(cache, histories, 0, prompt)
        prefixes = HybridPrefixCache(cache, max_bytes=1 << 20, block_size=BLOCK)
        assert prefixes.save(0, prompt)
        assert prefixes.restore(1, prompt) == 11
        histories.copy(0, 1)
        assert_holds_its_history(cache, histories)
        assert np.array_equal(cache.seq_state(1).pos, np.arange(11))
