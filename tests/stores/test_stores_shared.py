"""Behaviour both stores share, tested against a real directory and a real Redis server.

Also the worker that the multi-process tests run as a separate OS process:
``python tests/stores/test_stores_shared.py ROLE STORE ...`` (see ``_worker``).

The Redis server is tests/redis_servers.py's, started per test by tests/conftest.py's
``redis_server`` fixture.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import ReferenceRun, random_model
from recurrent_cache.stores import (Geometry, Store, decode_snapshot, encode_snapshot, open_store, restore_rows,
                                    sequence_rows, snapshot_key)

HERE = Path(__file__).resolve()


def small_entries(n: int, namespace: str = "test", seed: int = 0):
    """n (key, tokens, entry) snapshots of a small geometry with random rows, prefixes of one list."""
    geometry = Geometry(2, 3, 5, "f32", "f16")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, size=n).tolist()
    out = []
    for length in range(1, n + 1):
        r = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
        s = [rng.standard_normal(5).astype(np.float16) for _ in range(2)]
        key = snapshot_key(namespace, geometry, tokens[:length])
        out.append((key, tokens[:length], encode_snapshot(key, tokens[:length], r, s, geometry)))
    return geometry, out


def numbered_entry(i: int, width: int) -> tuple[str, bytes, Geometry]:
    """Snapshot number i: tokens [i], every value i, rows ``width`` floats wide (8*width bytes)."""
    geometry = Geometry(1, width, width)
    key = snapshot_key("numbered", geometry, [i])
    row = np.full(width, i, np.float32)
    return key, encode_snapshot(key, [i], [row], [row], geometry), geometry


def test_round_trip_get_first_and_stats(kind):
    store = kind.open()
    assert isinstance(store, Store)
    geometry, entries = small_entries(6)
    for i, (key, _, entry) in enumerate(entries[:4]):
        assert store.put(key, [entry, bytearray(entry), memoryview(entry)][i % 3])   # any bytes-like
    keys = [key for key, _, _ in entries]
    assert [bytes(e) if e is not None else None for e in store.get_many(keys)] == \
        [entry for _, _, entry in entries[:4]] + [None, None]
    # longest first: prefixes 6 and 5 were never stored, 4 is the first hit
    index, entry = store.get_first(keys[::-1])
    assert index == 2 and bytes(entry) == entries[3][2]
    assert store.get_first(keys[4:]) is None
    assert store.get_many([]) == []
    stats = store.stats()
    assert (stats["lookups"], stats["hits"], stats["misses"], stats["damaged"], stats["errors"]) == (4, 5, 6, 0, 0)
    assert stats["puts"] == 4
    assert stats["bytes_read"] == sum(len(e) for _, _, e in entries[:4]) + len(entries[3][2])


def test_put_rejects_an_entry_of_another_key(kind):
    store = kind.open()
    _, entries = small_entries(2)
    with pytest.raises(rc.ArgumentError):
        store.put(entries[0][0], entries[1][2])
    with pytest.raises(rc.ArgumentError):
        store.put(entries[0][0], entries[0][2][:-1])
    assert store.get_many([entries[0][0], entries[1][0]]) == [None, None]


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "foreign", "empty"])
def test_damaged_entries_are_misses_counted_and_removed(kind, damage):
    store = kind.open()
    geometry, entries = small_entries(3)
    (key, tokens, entry), (other_key, _, other_entry) = entries[1], entries[2]
    store.put(key, entry)
    bad = {"flip": entry[:40] + bytes([entry[40] ^ 0x10]) + entry[41:],
           "truncate": entry[:-45] + entry[-32:] if kind.kind == "directory" else entry[:-1],
           "extend": entry[:-32] + b"\0" + entry[-32:],
           "foreign": other_entry,
           "empty": entry[-32:] if kind.kind == "directory" else b""}[damage]
    kind.raw_set(store, key, bad)
    assert store.get_many([key]) == [None]
    assert store.get_first([other_key, key]) is None
    stats = store.stats()
    assert stats["damaged"] == 1 and stats["hits"] == 0   # counted once, then removed
    assert kind.raw_get(store, key) is None
    assert store.put(key, entry)                            # and the key can be written again
    found = store.get_first([key])
    assert found is not None and decode_snapshot(found[1], key, geometry, tokens) is not None


# -- two OS processes ---------------------------------------------------------------------

MODEL = dict(seed=3, n_embd=16, n_layer=2, d_state=4, n_vocab=64)
BLOCK = 8
SYSTEM = list(range(1, 25))    # a 24-token system prompt every request starts with


def cuts_of(tokens: list[int], start: int = 0) -> list[int]:
    """Where prefill stops and a snapshot is taken: every multiple of BLOCK, and the end."""
    return sorted({c for c in range(BLOCK, len(tokens), BLOCK) if c > start} | {len(tokens)})


def prefill(model, cache, seq: int, tokens: list[int], start: int, cuts: list[int], on_cut=None):
    """Feed tokens[start:] to ``seq`` in chunks ending at ``cuts``; the logits after the last token."""
    logits = None
    for end in cuts:
        chunk = tokens[start:end]
        st = cache.init_batch(rc.Batch(token=chunk, pos=list(range(start, end)), seq_id=[seq] * len(chunk)),
                              n_ubatch=512)
        logits = model.forward(st)[-1]
        if on_cut is not None:
            on_cut(end)
        start = end
    return logits


def greedy(model, cache, seq: int, logits, pos: int, n: int) -> np.ndarray:
    """n greedy decode steps after ``pos``; every step's logits."""
    out = []
    for _ in range(n):
        token = int(np.argmax(logits))
        logits = model.forward(cache.init_batch(rc.Batch(token=[token], pos=[pos + 1], seq_id=[seq])))[-1]
        pos += 1
        out.append(logits)
    return np.array(out)


def _worker(argv: list[str]) -> int:
    """The other process.  ``writer STORE PROMPTS_JSON``: prefill each prompt, putting a snapshot
    at every cut; prints the sha256 of every entry put.  ``reader STORE PROMPTS_JSON``: for each
    prompt restore the longest stored prefix, prefill the rest, decode 4 tokens; prints what it
    restored, the sha256 of the entry read and the logits.  ``hammer STORE KEY ENTRIES_DIR N``:
    put the entries of a directory under one key N times, checking every read between."""
    role, spec = argv[0], argv[1]
    store = open_store(spec, **({"max_bytes": int(argv[4])} if role == "churn" else {}))
    if role in ("churn", "write-forever"):
        # churn: put keys FIRST..FIRST+N-1, reading random earlier keys back after each put
        # write-forever: put keys 0, 1, 2, ... until killed
        first, n = (int(argv[2]), int(argv[3])) if role == "churn" else (0, 1 << 30)
        rng = np.random.default_rng(first)
        bad = 0
        for i in range(first, first + n):
            store.put(*numbered_entry(i, 1 << 12 if role == "churn" else 1 << 20)[:2])
            j = int(rng.integers(first, i + 1))
            key, entry = numbered_entry(j, 1 << 12)[:2]
            found = store.get_first([key])
            bad += found is not None and bytes(found[1]) != entry
        print(json.dumps({"bad": bad, "stats": store.stats()}, default=str))
        return 0
    if role == "hammer":
        key, entries_dir, n = argv[2], Path(argv[3]), int(argv[4])
        candidates = sorted(p.read_bytes() for p in entries_dir.iterdir())
        bad = 0
        for i in range(n):
            store.put(key, candidates[i % len(candidates)])
            found = store.get_first([key])
            if found is not None and bytes(found[1]) not in candidates:
                bad += 1
        print(json.dumps({"bad": bad, "stats": store.stats()}, default=str))
        return 0
    prompts = json.loads(argv[2])
    model = random_model(**MODEL)
    cache = model.new_cache(n_seq_max=2)
    geometry = Geometry.of(cache)
    namespace = f"random_model{sorted(MODEL.items())}"
    report = []
    for tokens in prompts:
        cache.clear()
        if role == "writer":
            shas = []

            def save(end: int) -> None:
                key = snapshot_key(namespace, geometry, tokens[:end])
                entry = encode_snapshot(key, tokens[:end], *sequence_rows(cache, 0), geometry)
                store.put(key, entry)
                shas.append([end, hashlib.sha256(entry).hexdigest()])

            prefill(model, cache, 0, tokens, 0, cuts_of(tokens), on_cut=save)
            report.append(shas)
        else:
            lengths = list(range(len(tokens) - 1, 0, -1))   # every prefix, longest first: one lookup
            keys = [snapshot_key(namespace, geometry, tokens[:n]) for n in lengths]
            found = store.get_first(keys)
            start, sha = 0, None
            if found is not None:
                start = lengths[found[0]]
                rows = decode_snapshot(found[1], keys[found[0]], geometry, tokens[:start], verify_crc=False)
                assert rows is not None
                restore_rows(cache, 0, start, *rows)
                sha = hashlib.sha256(found[1]).hexdigest()
            logits = prefill(model, cache, 0, tokens, start, cuts_of(tokens, start))
            steps = greedy(model, cache, 0, logits, len(tokens) - 1, 4)
            report.append({"restored": start, "sha256": sha,
                           "logits": np.vstack([logits, steps]).tolist()})
    print(json.dumps({"report": report, "stats": store.stats()}, default=str))
    return 0


def run_worker(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_second_process_restores_the_first_ones_snapshots_exactly(kind):
    rng = np.random.default_rng(5)
    first = [SYSTEM + rng.integers(1, 64, size=13).tolist(), SYSTEM + rng.integers(1, 64, size=5).tolist()]
    # the second process: one prompt continues the first conversation (its 37 tokens were saved
    # at their end), one shares the system prompt only (saved at 24), one shares nothing
    second = [first[0] + [7, 8, 9], SYSTEM + rng.integers(1, 64, size=11).tolist(),
              rng.integers(1, 64, size=12).tolist()]
    written = run_worker("writer", kind.spec, json.dumps(first))
    read = run_worker("reader", kind.spec, json.dumps(second))
    saved = {sha for prompt in written["report"] for _, sha in prompt}
    assert [r["restored"] for r in read["report"]] == [37, 24, 0]
    assert read["report"][0]["sha256"] in saved and read["report"][1]["sha256"] in saved   # exact bytes
    assert read["stats"]["hits"] == 2 and read["stats"]["damaged"] == 0

    # cold runs here, split at the same points, from a zero state
    model = random_model(**MODEL)
    for tokens, result in zip(second, read["report"]):
        cache = model.new_cache(n_seq_max=2)
        cuts = sorted(set(cuts_of(tokens[:result["restored"]])) | set(cuts_of(tokens, result["restored"]))) \
            if result["restored"] else cuts_of(tokens)
        logits = prefill(model, cache, 0, tokens, 0, cuts)
        cold = np.vstack([logits, greedy(model, cache, 0, logits, len(tokens) - 1, 4)])
        assert np.array_equal(np.array(result["logits"]), cold)
        alone = ReferenceRun(model).feed(tokens)[-1]
        np.testing.assert_allclose(result["logits"][0], alone, rtol=1e-9, atol=1e-9)


def test_concurrent_writers_of_one_key(kind, tmp_path):
    """Four processes put four different entries under one key while reading it back."""
    _, entries = small_entries(1)
    key, tokens, _ = entries[0]
    geometry = Geometry(2, 3, 5, "f32", "f16")
    entries_dir = tmp_path / "entries"
    entries_dir.mkdir()
    rng = np.random.default_rng(9)
    for i in range(4):
        r = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
        s = [rng.standard_normal(5).astype(np.float16) for _ in range(2)]
        (entries_dir / f"{i}").write_bytes(encode_snapshot(key, tokens, r, s, geometry))
    processes = [subprocess.Popen([sys.executable, str(HERE), "hammer", kind.spec, key, str(entries_dir), "60"],
                                  stdout=subprocess.PIPE, text=True) for _ in range(4)]
    results = [json.loads(p.communicate(timeout=300)[0]) for p in processes]
    assert all(p.returncode == 0 for p in processes)
    assert [r["bad"] for r in results] == [0] * 4
    assert sum(int(r["stats"]["damaged"]) for r in results) == 0
    final = kind.open().get_first([key])
    assert final is not None and bytes(final[1]) in {p.read_bytes() for p in entries_dir.iterdir()}


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
