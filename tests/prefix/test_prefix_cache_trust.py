"""PrefixCache calls that fail change nothing, and its cost follows the prompt (issue 17).

* ``save`` that raises part way (another thread inside the cache, a read
  that fails) keeps no snapshot: never a pool slot that was not filled.
* ``restore`` that raises leaves the stats, the snapshots and their eviction
  order as they were (checked against a twin prefix cache that never saw
  the failing call), with or without a store hit.
* Memory and work of ``match`` / ``plan`` / ``restore`` / ``save`` do not grow
  with ``block_size``; a store miss hashes the prompt once (hashed bytes
  counted, not time).

Both engines, through the ``rc`` fixture.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache.prefix_cache import PrefixCache
from recurrent_cache.stores import DirectoryStore, Geometry, snapshot_key
from recurrent_cache.stores import snapshot as snapshot_module
from test_prefix_cache import assert_state_of, make_cache, prefill, serve, snapshot_bytes

PLACING = ("_place_sequence", "seq_restore")   # how restore places a sequence, before and after the core


def failing(*args, **kwargs):
    raise recurrent_cache.UsageError("this RecurrentCache is in use by another thread (simulated)")


def make_placement_fail(monkeypatch, cache) -> None:
    for name in PLACING:
        if hasattr(cache, name):
            monkeypatch.setattr(cache, name, failing)


def traffic(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Prompts sharing prefixes (a few system prompts, then their own tokens)."""
    systems = [rng.integers(1, 50, size=int(k)).tolist() for k in (6, 11, 17)]
    return [systems[int(rng.integers(3))] + rng.integers(1, 50, size=int(rng.integers(1, 12))).tolist()
            for _ in range(n)]


def fingerprint(pc: PrefixCache, prompts: list[list[int]]) -> tuple:
    return pc.stats(), len(pc), [pc.match(p + [0]) for p in prompts]


# -- save is all-or-nothing -------------------------------------------------------------------

def test_a_save_whose_read_of_the_cache_raises_keeps_nothing(rc, monkeypatch):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 4 * snapshot_bytes(), block_size=4)
    kept, failed = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9]
    serve(rc, cache, pc, kept)
    cache.seq_rm(0, -1, -1)
    prefill(rc, cache, 0, failed, 0, len(failed))
    before = fingerprint(pc, [kept, failed])
    real_cell = cache.cell
    calls = []

    def cell_of_another_thread(i):
        calls.append(i)
        if len(calls) > 1:
            failing()
        return real_cell(i)

    monkeypatch.setattr(cache, "cell", cell_of_another_thread)
    with pytest.raises(recurrent_cache.UsageError):
        pc.save(0, failed)
    monkeypatch.undo()
    assert fingerprint(pc, [kept, failed]) == before
    assert pc.match(failed + [0]) == 4                   # the grid point of the shared prefix, not 7
    cache.seq_rm(0, -1, -1)
    assert pc.restore(0, failed + [0]) == 4
    assert_state_of(cache, 0, failed[:4])


def test_saves_racing_a_thread_inside_the_cache_never_keep_an_unfilled_snapshot(rc):
    """Another thread calls into the cache all the time: saves that meet it raise UsageError; every
    snapshot kept must hold exactly the state of its prompt.  Each prompt is saved once (a second
    save of a held prompt only refreshes it), until dozens of saves have met the other thread."""
    cache = make_cache(rc, n_seq_max=3)
    pc = PrefixCache(cache, 4096 * snapshot_bytes(), block_size=1024)
    rng = np.random.default_rng(1)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            try:
                cache.seq_pos_max(2)
            except recurrent_cache.UsageError:
                pass

    def fed(tokens) -> None:
        """seq 0 holds the state after ``tokens`` (from scratch again when the other thread interrupts)."""
        while True:
            try:
                cache.seq_rm(0, -1, -1)
                prefill(rc, cache, 0, tokens, 0, len(tokens))
                return
            except recurrent_cache.UsageError:
                continue

    other = threading.Thread(target=busy, daemon=True)
    prompts, refused = [], 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads often, so that they meet inside the cache
    other.start()
    try:
        deadline = time.monotonic() + 30
        while refused < 40 and len(prompts) < 4000 and time.monotonic() < deadline:
            tokens = rng.integers(1, 1 << 20, size=6).tolist()
            prompts.append(tokens)
            fed(tokens)
            try:
                pc.save(0, tokens)
            except recurrent_cache.UsageError:
                refused += 1
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    assert refused > 0, "the other thread never met a save: the test proved nothing"
    assert len(pc) == len(prompts) - refused
    for tokens in prompts:   # every snapshot held restores exactly its prompt's state
        cache.seq_rm(1, -1, -1)
        if pc.restore(1, tokens + [0]):
            assert_state_of(cache, 1, tokens)


# -- restore is all-or-nothing ----------------------------------------------------------------

def test_a_restore_that_raises_leaves_stats_and_eviction_order_as_they_were(rc, monkeypatch):
    prompts = traffic(np.random.default_rng(2), 30)
    caches = [make_cache(rc), make_cache(rc)]
    pcs = [PrefixCache(cache, 6 * snapshot_bytes(), block_size=4) for cache in caches]
    for tokens in prompts[:10]:
        for cache, pc in zip(caches, pcs):
            serve(rc, cache, pc, tokens)
    victim = prompts[3]
    caches[0].seq_rm(1, -1, -1)
    assert pcs[0].match(victim + [0]) > 0
    with monkeypatch.context() as patch:
        make_placement_fail(patch, caches[0])
        with pytest.raises(recurrent_cache.UsageError):
            pcs[0].restore(1, victim + [0])
    assert caches[0].seq_pos_max(1) == -1
    assert fingerprint(pcs[0], prompts) == fingerprint(pcs[1], prompts)
    for tokens in prompts[10:]:   # the same traffic evicts the same snapshots from both
        results = [serve(rc, cache, pc, tokens) for cache, pc in zip(caches, pcs)]
        assert results[0] == results[1]
        assert fingerprint(pcs[0], prompts) == fingerprint(pcs[1], prompts)


def test_a_restore_of_a_store_hit_that_raises_promotes_nothing(rc, monkeypatch, tmp_path):
    store = DirectoryStore(tmp_path)
    writer_cache = make_cache(rc)
    writer = PrefixCache(writer_cache, 8 * snapshot_bytes(), block_size=4, store=store, namespace="t")
    tokens = list(range(1, 12))
    serve(rc, writer_cache, writer, tokens)
    cache = make_cache(rc)
    pc = PrefixCache(cache, 8 * snapshot_bytes(), block_size=4, store=store, namespace="t")
    before = pc.stats()
    with monkeypatch.context() as patch:
        make_placement_fail(patch, cache)
        with pytest.raises(recurrent_cache.UsageError):
            pc.restore(0, tokens + [0])
    assert pc.stats() == before and len(pc) == 0 and pc.match(tokens + [0]) == 0
    assert cache.seq_pos_max(0) == -1
    # the store hit (the longest grid point: a fresh process knows no junction), placed and promoted
    assert pc.restore(0, tokens + [0]) == 8
    assert_state_of(cache, 0, tokens[:8])
    stats = pc.stats()
    assert (stats["lookups"], stats["hits"], stats["store_hits"], stats["store_lookups"]) == (1, 1, 1, 1)
    assert len(pc) == 1 and pc.match(tokens + [0]) == 8


# -- cost follows the prompt, not block_size --------------------------------------------------

@pytest.mark.parametrize("block_size", [1 << 22, 1 << 40])
def test_memory_does_not_grow_with_block_size(rc, block_size):
    cache = make_cache(rc)
    pc = PrefixCache(cache, 64 * snapshot_bytes(), block_size=block_size)
    rng = np.random.default_rng(3)
    shared = rng.integers(1, 1000, size=500).tolist()
    prompts = [shared + rng.integers(1, 1000, size=300).tolist() for _ in range(3)]
    tracemalloc.start()
    try:
        for tokens in prompts:
            serve(rc, cache, pc, tokens)        # restore, plan (junctions), save
            pc.match(tokens + [0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert pc.plan(prompts[0] + [5]) == [500, 801]   # the junction found, no grid point
    assert peak < 1 << 20, f"block_size {block_size}: {peak} bytes at the peak for 800-token prompts"


class MissingStore:
    """A store that holds nothing: every restore is a store miss."""

    def get_first(self, keys):
        return None

    def put(self, key, entry):
        return False

    def stats(self):
        return {}


class CountingSha256:
    """hashlib.sha256 that adds the bytes it hashes to ``counted``."""

    counted = 0

    def __init__(self, data: bytes = b"", *, state=None) -> None:
        self._hash = state if state is not None else hashlib.sha256()
        self.update(data)

    def update(self, data) -> None:
        CountingSha256.counted += memoryview(data).nbytes
        self._hash.update(data)

    def copy(self) -> "CountingSha256":
        return CountingSha256(state=self._hash.copy())

    def digest(self) -> bytes:
        return self._hash.digest()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def hashed_bytes_of_a_store_miss(rc, monkeypatch, n_tokens: int, block_size: int) -> int:
    cache = make_cache(rc)
    pc = PrefixCache(cache, 8 * snapshot_bytes(), block_size=block_size, store=MissingStore(), namespace="t")
    tokens = np.random.default_rng(n_tokens).integers(1, 1 << 20, size=n_tokens)
    with monkeypatch.context() as patch:
        patch.setattr(snapshot_module, "hashlib", type("hashlib", (), {"sha256": CountingSha256}))
        CountingSha256.counted = 0
        assert pc.restore(0, tokens) == 0
        assert pc.stats()["store_lookups"] == 1
        return CountingSha256.counted


@pytest.mark.parametrize("block_size", [16, 256])
def test_a_store_miss_hashes_the_prompt_once(rc, monkeypatch, block_size):
    n = 4096
    once, twice = (hashed_bytes_of_a_store_miss(rc, monkeypatch, k, block_size) for k in (n, 2 * n))
    assert twice <= 2.2 * once, f"hashed {once} bytes for {n} tokens, {twice} for {2 * n}: not linear"
    candidates = n // block_size
    assert once <= 4 * n + 8 * candidates + 1024, f"hashed {once} bytes for a {4 * n}-byte prompt"


def test_prefix_keys_are_the_documented_hash_of_each_prefix():
    """An independent implementation of the key layout (snapshot_key's docstring): sha256 of the
    length-prefixed namespace and geometry, the tokens, then their byte count."""
    from recurrent_cache.stores.snapshot import prefix_keys   # here: the other tests also run on main
    geometry = Geometry(2, 3, 5, "f32", "f16")
    tokens = np.random.default_rng(4).integers(-5, 1 << 30, size=50).tolist()
    lengths = [50, 1, 0, 17, 17, 49]

    def expected(n: int) -> str:
        fields = ["ns ü".encode(), b"n_layer=2;n_embd_r=3;n_embd_s=5;dtype_r=f32;dtype_s=f16"]
        message = b"".join(struct.pack("<Q", len(f)) + f for f in fields)
        token_bytes = np.asarray(tokens[:n], "<i4").tobytes()
        return "rc2:" + hashlib.sha256(message + token_bytes + struct.pack("<Q", len(token_bytes))).hexdigest()

    assert prefix_keys("ns ü", geometry, tokens, lengths) == [expected(n) for n in lengths]
    assert [snapshot_key("ns ü", geometry, tokens[:n]) for n in lengths] == [expected(n) for n in lengths]
    with pytest.raises(recurrent_cache.ArgumentError, match="51"):
        prefix_keys("ns", geometry, tokens, [51])
