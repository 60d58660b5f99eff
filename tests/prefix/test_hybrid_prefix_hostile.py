"""Issue 28's attack on ``HybridPrefixCache`` and its store tier: an entry a shared store hands out that
is not the state of exactly its tokens (a shifted sequence's, written by another program), stores that
raise or answer nonsense, and budgets of every size.  Each is a miss or a refusal with the memory as it
was — an entry used to be read into the sequence and then refused with ``PositionError``, the sequence
left holding the foreign state."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.hybrid_prefix import HybridPrefixCache
from recurrent_cache.stores.snapshot import encode_hybrid_snapshot, hybrid_key_text, prefix_keys

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot

NAMESPACE = "hostile-test-model"


def make() -> HybridCache:
    return HybridCache(3, attn_layers=[1], recr_layers=[0, 2], n_embd_k=4, n_embd_v=6, n_embd_r=3, n_embd_s=5,
                       kv_size=16, n_seq_max=3, dtype_k="f32", dtype_v="f32")


class DictStore:
    """A third-party store in memory: the store interface, and no counters (``stats()`` is None)."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def get_first(self, keys: list[str]) -> tuple[int, bytes] | None:
        return next(((i, self.entries[key]) for i, key in enumerate(keys) if key in self.entries), None)

    def put(self, key: str, entry: Any) -> bool:
        self.entries[key] = bytes(entry)
        return True

    def stats(self) -> None:
        return None


class RaisingStore(DictStore):
    def get_first(self, keys: list[str]) -> Any:
        raise ConnectionError("the store is down")

    def put(self, key: str, entry: Any) -> bool:
        raise ConnectionError("the store is down")

    def stats(self) -> Any:
        raise ConnectionError("the store is down")


class NonsenseStore(DictStore):
    def get_first(self, keys: list[str]) -> Any:
        return (len(keys) + 5, b"GGSQ")   # an index outside the candidates


def entry_key(cache: HybridCache, tokens: list[int]) -> str:
    geometry = Geometry(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s,
                        layers=cache.recr_layers)
    return prefix_keys(NAMESPACE, geometry, np.array(tokens, np.int32), [len(tokens)], hybrid_key_text(cache))[0]


@pytest.mark.parametrize("foreign", ["shifted", "cut", "longer"])
def test_a_store_entry_not_of_exactly_its_tokens_is_a_miss_with_the_memory_unchanged(foreign):
    source = make()
    decode(source, Histories(3), {0: [1, 2, 3, 4]})
    if foreign == "shifted":
        source.seq_add(0, 0, -1, 5)      # positions 5 .. 8
    elif foreign == "cut":
        source.seq_add(0, 0, 1, -1)      # the first token's KV cell freed (pushed below 0)
    tokens = [1, 2, 3] if foreign == "longer" else [1, 2, 3, 4]   # "longer": 4 tokens' state under 3
    store = DictStore()
    key = entry_key(source, tokens)
    store.entries[key] = bytes(encode_hybrid_snapshot(key, tokens, source.state_write(0)))
    cache = make()
    decode(cache, Histories(3), {2: [9, 9]})
    before = snapshot(cache)
    prefix = HybridPrefixCache(cache, max_bytes=1 << 20, store=store, namespace=NAMESPACE)
    assert prefix.restore(1, tokens + [7]) == 0
    assert same(before, snapshot(cache))
    stats = prefix.stats()
    assert (stats["store_hits"], stats["store_damaged"], stats["restored"]) == (0, 1, 0)
    cache.check()


def test_an_entry_of_exactly_its_tokens_is_restored():
    source, histories = make(), Histories(3)
    decode(source, histories, {0: [1, 2, 3, 4]})
    store = DictStore()
    HybridPrefixCache(source, max_bytes=1 << 20, store=store, namespace=NAMESPACE).save(0, [1, 2, 3, 4])
    cache = make()
    prefix = HybridPrefixCache(cache, max_bytes=1 << 20, store=store, namespace=NAMESPACE)
    assert prefix.restore(1, [1, 2, 3, 4, 5]) == 4
    histories.copy(0, 1)
    histories.forget(0)
    assert_holds_its_history(cache, histories)


def test_state_read_with_n_tokens_checks_the_positions_before_anything_changes():
    source = make()
    decode(source, Histories(3), {0: [1, 2, 3]})
    blob = source.state_write(0)
    cache = make()
    before = snapshot(cache)
    for n_tokens, words in [(2, "recurrent state is at position"), (4, "recurrent state is at position")]:
        with pytest.raises(rc.StateError, match=words):
            cache.state_read(blob, 1, n_tokens=n_tokens)
    with pytest.raises(rc.ArgumentError, match="n_tokens is for the state of one sequence"):
        cache.state_read(source.state_write(), n_tokens=3)
    with pytest.raises(rc.ArgumentError, match="n_tokens"):
        cache.state_read(blob, 1, n_tokens=0)
    assert same(before, snapshot(cache))
    cache.state_read(blob, 1, n_tokens=3)
    assert cache.seq_pos_max(1) == 2


@pytest.mark.parametrize("store", [RaisingStore(), NonsenseStore(), DictStore()], ids=lambda s: type(s).__name__)
def test_a_store_that_raises_answers_nonsense_or_keeps_no_counters_is_a_miss(store):
    cache, histories = make(), Histories(3)
    decode(cache, histories, {0: [1, 2, 3]})
    prefix = HybridPrefixCache(cache, max_bytes=1 << 20, store=store, namespace=NAMESPACE)
    prefix.save(0, [1, 2, 3])
    before = snapshot(cache)
    assert prefix.restore(1, [5, 6, 7]) == 0
    assert same(before, snapshot(cache))
    stats = prefix.stats()
    assert isinstance(stats["store_errors"], int) and isinstance(stats["store_damaged"], int)
    assert prefix.restore(1, [1, 2, 3, 4]) == 3   # from memory, whatever the store does


@pytest.mark.parametrize("max_bytes", [2**62, 10**26, np.int64(1 << 20)])
def test_budgets_of_every_size_are_counted_not_allocated(max_bytes):
    cache, histories = make(), Histories(3)
    decode(cache, histories, {0: [1, 2, 3]})
    prefix = HybridPrefixCache(cache, max_bytes=max_bytes)
    assert prefix.save(0, [1, 2, 3]) and prefix.nbytes > 0


@pytest.mark.parametrize("max_bytes", [0, -1, 1.5, "1", None, True, np.array([1, 2])])
def test_a_budget_that_is_not_a_positive_integer_is_an_argument_error(max_bytes):
    with pytest.raises(rc.ArgumentError, match="max_bytes"):
        HybridPrefixCache(make(), max_bytes=max_bytes)
