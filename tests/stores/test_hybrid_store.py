"""A store as the second tier of ``HybridPrefixCache``: a hybrid sequence's state (its KV rows and its
recurrent state) kept as the ggsq file llama.cpp writes for it, restored into another memory exactly,
and every damaged or foreign entry a miss that changes nothing — on a DirectoryStore and on a real Redis."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache import HybridCache, HybridPrefixCache
from recurrent_cache.errors import ArgumentError
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.stores import hybrid_key_text, prefix_keys

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot

BLOCK = 4


def make(**kw) -> HybridCache:
    args = dict(attn_layers=[1], recr_layers=[0, 1], n_embd_k=4, n_embd_v=2, n_embd_r=3, n_embd_s=5, kv_size=128,
                n_seq_max=4, dtype_k="f32", dtype_v="f32")
    args.update(kw)
    return HybridCache(2, **args)


def key_of(cache: HybridCache, namespace: str, tokens: list[int]) -> str:
    geometry = Geometry(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s,
                        layers=cache.recr_layers)
    return prefix_keys(namespace, geometry, tokens, [len(tokens)], hybrid_key_text(cache))[0]


@pytest.mark.parametrize("v_trans", [True, False])
def test_a_prefix_saved_by_one_memory_is_restored_by_another_through_the_store(kind, v_trans):
    writer, histories = make(v_trans=v_trans), Histories(4)
    prompt = list(range(1, 11))                                  # 10 tokens
    decode(writer, histories, {0: prompt[:8]}, n_ubatch=3)
    saving = HybridPrefixCache(writer, max_bytes=1 << 20, block_size=BLOCK, store=kind.open(), namespace="m")
    assert saving.save(0, prompt[:8])                            # a block multiple: a length restore asks for
    decode(writer, histories, {0: prompt[8:]})
    assert saving.save(0, prompt)
    assert saving.stats()["store_written"] == 2

    reader, theirs = make(v_trans=v_trans), Histories(4)
    theirs.numbers = histories.numbers                           # one numbering of histories for both memories
    restoring = HybridPrefixCache(reader, max_bytes=1 << 20, block_size=BLOCK, store=kind.open(), namespace="m")
    assert restoring.restore(2, prompt) == 10                    # the store is asked for 10, 9, 8 and 4 tokens
    theirs.adopt(histories, 0)
    theirs.copy(0, 2)
    assert restoring.restore(3, prompt[:8] + [77, 78, 79]) == 8  # 11, 10, 8, 4 asked: the 8-token entry
    theirs.keep_before(0, 8)
    theirs.copy(0, 3)
    assert restoring.restore(1, prompt) == 10                    # promoted into memory: no lookup this time
    theirs.copy(2, 1)
    theirs.forget(0)
    assert_holds_its_history(reader, theirs)
    stats = restoring.stats()
    assert (stats["store_lookups"], stats["store_hits"], stats["store_tokens_restored"]) == (2, 2, 18)
    assert (stats["restored"], stats["tokens_restored"]) == (3, 28)
    decode(reader, theirs, {2: [50, 51], 3: [77], 1: [9]})       # each goes on from there
    assert_holds_its_history(reader, theirs)
    reader.check()


def test_a_damaged_a_foreign_and_a_truncated_entry_are_misses_that_change_nothing(kind):
    writer, histories = make(), Histories(4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    decode(writer, histories, {0: prompt})
    store = kind.open()
    key = key_of(writer, "m", prompt)
    # what raw_set takes: the ggsq file and room for the trailer (a directory keeps it in the file's name)
    pad = b"\0" * 32 if kind.kind == "directory" else b""

    def put_again() -> bytes:
        """The entry as the store holds it (each damaged one is removed on its first read)."""
        assert HybridPrefixCache(writer, 1 << 20, BLOCK, store=store, namespace="m").save(0, prompt)
        held = kind.raw_get(store, key)
        assert held is not None
        return bytes(held)

    reader = make()
    restoring = HybridPrefixCache(reader, 1 << 20, BLOCK, store=kind.open(), namespace="m")
    before = snapshot(reader)
    good = put_again()
    assert HybridPrefixCache(reader, 1 << 20, BLOCK, store=kind.open(), namespace="another").restore(0, prompt) == 0
    flipped = bytearray(good)
    flipped[60] ^= 0xFF                                          # a KV cell's bytes: the CRC-32 no longer matches
    kind.raw_set(store, key, bytes(flipped) + pad)
    assert restoring.restore(0, prompt) == 0
    good = put_again()
    kind.raw_set(store, key, good[:len(good) // 2] + pad)        # truncated
    assert restoring.restore(0, prompt) == 0
    assert same(before, snapshot(reader)) and reader.seq_pos_max(0) == -1
    stats = restoring.stats()
    assert stats["store_hits"] == 0 and stats["store_damaged"] + stats["store_errors"] >= 1
    put_again()
    assert restoring.restore(0, prompt) == len(prompt)           # the intact entry again: restored


def test_an_entry_of_another_kv_layout_is_never_asked_for(kind):
    writer, histories = make(dtype_k="f16"), Histories(4)
    decode(writer, histories, {0: [1, 2, 3, 4]})
    assert HybridPrefixCache(writer, 1 << 20, BLOCK, store=kind.open(), namespace="m").save(0, [1, 2, 3, 4])
    reader = make()                                              # f32 keys: its key differs, a miss
    assert HybridPrefixCache(reader, 1 << 20, BLOCK, store=kind.open(), namespace="m").restore(0, [1, 2, 3, 4]) == 0
    assert key_of(writer, "m", [1, 2, 3, 4]) != key_of(reader, "m", [1, 2, 3, 4])


def test_a_store_needs_a_namespace_and_restore_an_empty_sequence(tmp_path):
    cache = make()
    with pytest.raises(ArgumentError, match="namespace"):
        HybridPrefixCache(cache, 1 << 20, store=object())
    with pytest.raises(ArgumentError, match="store interface"):
        HybridPrefixCache(cache, 1 << 20, store=object(), namespace="m")
    from recurrent_cache.stores import DirectoryStore

    histories = Histories(4)
    decode(cache, histories, {1: [3, 4]})
    prefixes = HybridPrefixCache(cache, 1 << 20, store=DirectoryStore(tmp_path), namespace="m")
    before = snapshot(cache)
    with pytest.raises(ArgumentError, match="holds positions"):
        prefixes.restore(1, [3, 4, 5])
    assert same(before, snapshot(cache))
    assert prefixes.stats()["store_lookups"] == 0
    np.testing.assert_array_equal(cache.seq_kv_cells(1).size, 2)
