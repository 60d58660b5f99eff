"""PrefixCache over a store (SPEC §8): a real directory and a real Redis server.

A second PrefixCache, in this process and in another OS process, restores the
prefixes the first one saved, and its Mamba logits and states equal a cold
run; a snapshot never reaches a cache of another namespace, geometry or dtype;
an evicted snapshot is found in the store by a later miss; a damaged entry,
a store that raises and a Redis server that stops are misses, never
exceptions.  The Redis server is the real ``redis-server`` that the store
tests start (``RedisServer`` in tests/redis_servers.py).

Also the worker the multi-process test runs: ``python tests/stores/test_prefix_cache_store.py
ROLE STORE PROMPTS_JSON`` (see ``_worker``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import random_model
from recurrent_cache.stores import Geometry, RedisStore, encode_snapshot, open_store, snapshot_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, when run as the worker script
from redis_servers import RedisServer  # noqa: E402


HERE = Path(__file__).resolve()
MODEL = dict(seed=3, n_embd=16, n_layer=2, d_state=4, n_vocab=64)
NAMESPACE = f"random_model{sorted(MODEL.items())}"   # the model's identity, as the demo makes it
BLOCK = 8
N_UBATCH = 5
SYSTEM = list(range(1, 25))    # a 24-token system prompt


@pytest.fixture(scope="module")
def model():
    return random_model(**MODEL)


def feed(model, cache, seq: int, tokens, start: int, end: int) -> np.ndarray:
    batch = rc.Batch(token=list(tokens[start:end]), pos=list(range(start, end)), seq_id=[seq] * (end - start))
    return model.forward(cache.init_batch(batch, N_UBATCH))[-1]


def serve(model, cache, pc, tokens: list[int], seq: int = 0) -> dict:
    """Restore, prefill with a save at every cut: what was restored, the start of the last
    piece, the last logits and the final rows of ``seq``."""
    cache.seq_rm(seq, -1, -1)
    n = done = pc.restore(seq, tokens)
    last_piece, logits = n, None
    for cut in pc.plan(tokens, n):
        last_piece = done
        logits = feed(model, cache, seq, tokens, done, cut)
        pc.save(seq, tokens[:cut])
        done = cut
    row = cache.cell(seq)[2]
    rows = [cache.r[il][row].copy() for il in range(cache.n_layer)] + \
        [cache.s[il][row].copy() for il in range(cache.n_layer)]
    return {"restored": n, "last_piece": last_piece, "logits": logits, "rows": rows}


def assert_equals_cold_run(model, tokens: list[int], result: dict, dtype: str = "f32") -> None:
    """The same tokens on a fresh cache, split where the last piece started: bit for bit."""
    cache = model.new_cache(n_seq_max=1, dtype=dtype)
    if result["last_piece"]:
        feed(model, cache, 0, tokens, 0, result["last_piece"])
    logits = feed(model, cache, 0, tokens, result["last_piece"], len(tokens))
    np.testing.assert_array_equal(np.asarray(result["logits"]), logits)
    rows = [cache.r[il][0] for il in range(cache.n_layer)] + [cache.s[il][0] for il in range(cache.n_layer)]
    for ours, cold in zip(result["rows"], rows):
        np.testing.assert_array_equal(np.asarray(ours, dtype=cold.dtype), cold)


def first_prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [SYSTEM + rng.integers(1, 64, size=13).tolist(), SYSTEM + rng.integers(1, 64, size=5).tolist()]


def second_prompts(first: list[list[int]]) -> list[list[int]]:
    """One continues the first conversation, one shares the system prompt only, one nothing."""
    rng = np.random.default_rng(6)
    return [first[0] + [7, 8, 9], SYSTEM + rng.integers(1, 64, size=11).tolist(), rng.integers(1, 64, 12).tolist()]


def _worker(argv: list[str]) -> int:
    """``serve STORE PROMPTS_JSON``: serve each prompt through a PrefixCache over the store;
    prints what each restored, its last piece, logits and rows, and the PrefixCache's stats."""
    _, spec, prompts = argv[0], argv[1], json.loads(argv[2])
    model = random_model(**MODEL)
    cache = model.new_cache(n_seq_max=2)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=open_store(spec), namespace=NAMESPACE)
    report = []
    for tokens in prompts:
        result = serve(model, cache, pc, tokens)
        report.append({**result, "logits": result["logits"].tolist(), "rows": [r.tolist() for r in result["rows"]]})
    print(json.dumps({"report": report, "stats": pc.stats()}))
    return 0


def run_worker(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- sharing ------------------------------------------------------------------------------

def test_another_process_and_another_prefix_cache_restore_the_first_ones_prefixes(kind, model):
    first = first_prompts()
    second = second_prompts(first)
    written = run_worker("serve", kind.spec, json.dumps(first))
    assert [r["restored"] for r in written["report"]] == [0, 24]   # its own memory: the 24-token junction
    assert written["stats"]["store_puts"] >= 6 and written["stats"]["store_errors"] == 0

    # a second OS process: an empty memory, so the store is asked for the block grid
    read = run_worker("serve", kind.spec, json.dumps(second))
    # 40 tokens continue first[0]: its grid point 32 (37, the end, is not on this process's grid);
    # the system prompt's 24; nothing
    assert [r["restored"] for r in read["report"]] == [32, 24, 0]
    stats = read["stats"]
    assert (stats["store_hits"], stats["store_tokens_restored"], stats["store_damaged"]) == (2, 56, 0)
    for tokens, result in zip(second, read["report"]):
        assert_equals_cold_run(model, tokens, result)

    # and a PrefixCache in this process, on a store object of its own: the second process
    # saved second[1] at 32 meanwhile
    cache = model.new_cache(n_seq_max=2)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=kind.open(), namespace=NAMESPACE)
    result = serve(model, cache, pc, second[1])
    assert result["restored"] == 32
    assert_equals_cold_run(model, second[1], result)
    assert pc.match(second[1][:32] + [0]) == 32             # promoted into memory
    assert pc.match(second[1] + [0]) == len(second[1])      # and the prefill saved there since


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_snapshots_through_a_directory(tmp_path, model, dtype):
    """Rows go through the store by their bytes (bf16: ml_dtypes.bfloat16 or uint16 alike)."""
    prompt = SYSTEM + [5, 6, 7]
    writer = model.new_cache(n_seq_max=2, dtype=dtype)
    serve(model, writer, rc.PrefixCache(writer, 1 << 20, block_size=BLOCK, store=rc.stores.DirectoryStore(
        tmp_path), namespace=NAMESPACE), SYSTEM + [9])
    cache = model.new_cache(n_seq_max=2, dtype=dtype)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=rc.stores.DirectoryStore(tmp_path),
                        namespace=NAMESPACE)
    result = serve(model, cache, pc, prompt)
    assert result["restored"] == 24 and pc.stats()["store_hits"] == 1
    assert_equals_cold_run(model, prompt, result, dtype)


# -- never into a cache it does not fit ------------------------------------------------------

def test_never_restored_into_another_namespace_geometry_or_dtype(kind, model):
    prompt = SYSTEM + [40, 41, 42]
    cache = model.new_cache(n_seq_max=2)
    serve(model, cache, rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=kind.open(), namespace=NAMESPACE),
          SYSTEM + [50])
    others = {
        "namespace": (model.new_cache(n_seq_max=2), "another model"),
        "dtype": (model.new_cache(n_seq_max=2, dtype="f16"), NAMESPACE),
        "geometry": (random_model(**{**MODEL, "n_layer": 3}).new_cache(n_seq_max=2), NAMESPACE),
    }
    for what, (other, namespace) in others.items():
        pc = rc.PrefixCache(other, 1 << 20, block_size=BLOCK, store=kind.open(), namespace=namespace)
        assert pc.restore(0, prompt) == 0, what
        assert other.cell(0)[2] == -1 and other.used == 0
        stats = pc.stats()
        assert (stats["store_lookups"], stats["store_hits"], stats["store_damaged"]) == (1, 0, 0), what
    pc = rc.PrefixCache(model.new_cache(n_seq_max=2), 1 << 20, block_size=BLOCK, store=kind.open(),
                        namespace=NAMESPACE)
    assert pc.restore(0, prompt) == 24   # the same namespace, geometry and dtype


def test_damaged_and_foreign_entries_are_counted_misses(kind, model):
    prompt = SYSTEM + [40, 41]
    cache = model.new_cache(n_seq_max=2)
    serve(model, cache, rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=kind.open(), namespace=NAMESPACE),
          SYSTEM + [50])
    store = kind.open()
    geometry = Geometry.of(cache)
    key_24, key_16 = (snapshot_key(NAMESPACE, geometry, SYSTEM[:n]) for n in (24, 16))
    entry_24 = kind.raw_get(store, key_24)
    if kind.kind == "directory":
        entry_24 = entry_24 + bytes(32)     # (raw_set drops the trailer a directory keeps in the name)
    kind.raw_set(store, key_24, entry_24[:40] + bytes([entry_24[40] ^ 1]) + entry_24[41:])   # one bit
    foreign = encode_snapshot(key_24, SYSTEM[:24], *[[np.zeros(geometry.n_embd_r, np.float32)] * 2,
                                                     [np.zeros(geometry.n_embd_s, np.float32)] * 2], geometry)
    kind.raw_set(store, key_16, foreign)    # intact, but written under the key of 24 tokens
    other = model.new_cache(n_seq_max=2)
    pc = rc.PrefixCache(other, 1 << 20, block_size=BLOCK, store=store, namespace=NAMESPACE)
    assert pc.restore(0, prompt) == 8      # 24 and 16 damaged: the next candidate
    stats = pc.stats()
    assert stats["store_damaged"] == 2 and stats["store_hits"] == 1
    result = serve(model, other, pc, prompt, seq=1)
    assert result["restored"] == 8         # promoted into memory; the store lost 24 and 16
    assert_equals_cold_run(model, prompt, result)


class PlainStore:
    """A third-party store: the store interface over a dict, with no checks of its own."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}
        self.broken = False

    def get_first(self, keys):
        if self.broken:
            raise ConnectionError("the network is down")
        for i, key in enumerate(keys):
            if key in self.entries:
                return i, self.entries[key]
        return None

    def put(self, key, entry):
        if self.broken:
            raise ConnectionError("the network is down")
        self.entries[key] = bytes(entry)
        return True

    def stats(self):
        return {"entries": len(self.entries)}


def test_any_store_object_checked_by_the_prefix_cache(model, caplog):
    store = PlainStore()
    cache = model.new_cache(n_seq_max=2)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=store, namespace=NAMESPACE)
    serve(model, cache, pc, SYSTEM + [50])
    geometry = Geometry.of(cache)
    key_24, key_16 = (snapshot_key(NAMESPACE, geometry, SYSTEM[:n]) for n in (24, 16))
    good = store.entries[key_24]
    store.entries[key_24] = good[:100] + bytes([good[100] ^ 4]) + good[101:]   # the CRC-32 catches it
    other = model.new_cache(n_seq_max=2)
    reader = rc.PrefixCache(other, 1 << 20, block_size=BLOCK, store=store, namespace=NAMESPACE)
    assert reader.restore(0, SYSTEM + [1]) == 0 and other.used == 0   # one lookup, the first hit damaged
    store.entries[key_24] = store.entries[key_16]                      # another key's entry
    assert reader.restore(0, SYSTEM + [1]) == 0
    assert reader.stats()["store_damaged"] == 2
    store.entries[key_24] = good
    assert reader.restore(0, SYSTEM + [1]) == 24
    store.broken = True                       # raises on every call: misses and skipped writes
    other.seq_rm(0, -1, -1)
    assert reader.restore(1, SYSTEM[:20] + [9]) == 0
    serve(model, other, reader, SYSTEM[:20] + [9], seq=1)
    stats = reader.stats()
    assert stats["store_errors"] >= 2 and stats["store_hits"] == 1
    assert sum("raised ConnectionError" in r.getMessage() for r in caplog.records) == 1   # logged once
    with pytest.raises(rc.ArgumentError, match="store interface"):
        rc.PrefixCache(cache, 1 << 20, store=object())


class CounterlessStore(PlainStore):
    """A store whose stats() returns None (it keeps no counters) or raises."""

    def __init__(self, raises: bool) -> None:
        super().__init__()
        self.raises = raises

    def stats(self):
        if self.raises:
            raise ConnectionError("the network is down")
        return None


@pytest.mark.parametrize("raises", [False, True], ids=["none", "raises"])
def test_stats_of_a_store_without_counters_are_unknown_not_an_error(model, raises):
    cache = model.new_cache(n_seq_max=2)
    pc = rc.PrefixCache(cache, 1 << 20, block_size=BLOCK, store=CounterlessStore(raises), namespace=NAMESPACE)
    serve(model, cache, pc, SYSTEM + [50])
    stats = pc.stats()
    assert stats["store_puts"] >= 1 and stats["store_damaged"] == 0
    assert stats["store_errors"] == int(raises)   # a raising stats() is a failed call; None is no count


# -- eviction and failures ---------------------------------------------------------------------

def test_evicted_snapshots_are_found_in_the_store(kind, model):
    cache = model.new_cache(n_seq_max=2)
    snapshot_bytes = rc.PrefixCache(cache, 0).snapshot_bytes
    pc = rc.PrefixCache(cache, snapshot_bytes, block_size=BLOCK, store=kind.open(), namespace=NAMESPACE)
    a = SYSTEM + [30, 31, 32, 33, 34, 35, 36, 37, 38]
    serve(model, cache, pc, a)       # saves 8, 16, 24, 32, 33 through one slot
    assert pc.stats()["evictions"] == 4 and pc.match(SYSTEM[:16] + [0]) == 0
    prompt = SYSTEM[:20] + [1, 2]
    result = serve(model, cache, pc, prompt, seq=1)
    assert result["restored"] == 16 and pc.stats()["store_hits"] == 1
    assert_equals_cold_run(model, prompt, result)


def test_redis_stopped_mid_run_degrades_to_misses_and_unconfirmed_writes_spill_later(tmp_path, model):
    server = RedisServer(tmp_path).start()
    try:
        cache = model.new_cache(n_seq_max=2)
        snapshot_bytes = rc.PrefixCache(cache, 0).snapshot_bytes
        store = RedisStore(server.url, retry_after=0.0)
        pc = rc.PrefixCache(cache, snapshot_bytes, block_size=BLOCK, store=store, namespace=NAMESPACE)
        server.stop()
        # the server is gone: every lookup is a miss, every write fails, the loop goes on exactly
        prompt = SYSTEM + [50]
        result = serve(model, cache, pc, prompt)   # saves 8, 16, 24, 25 through one slot
        assert result["restored"] == 0
        assert_equals_cold_run(model, prompt, result)
        stats = pc.stats()
        assert stats["store_errors"] >= 8 and stats["store_hits"] == 0
        assert stats["store_spills"] == 3          # 8, 16, 24: evicted unconfirmed, offered again in vain
        server.start()                              # empty
        serve(model, cache, pc, [9] * 30, seq=1)    # its end (30) evicts 25, which is written now
        assert pc.stats()["store_spills"] == 4
        # a reader whose grid has 25 on it finds it
        fresh = model.new_cache(n_seq_max=2)
        reader = rc.PrefixCache(fresh, 1 << 20, block_size=5, store=RedisStore(server.url), namespace=NAMESPACE)
        found = serve(model, fresh, reader, prompt + [1, 2])
        assert found["restored"] == 25
        assert_equals_cold_run(model, prompt + [1, 2], found)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
