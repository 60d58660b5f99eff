"""What a store costs a PrefixCache: write-through saves and restores from the store, against memory.

    python bench/prefix_store.py            # mamba-130m-shaped states (2.7 MiB), ~1 min
    python bench/prefix_store.py --rounds 3 # fewer rounds
    python bench/prefix_store.py --quick    # 4 of the 24 layers, 3 rounds: seconds, figures not for quoting

One run, interleaved rounds (median, min–max), on one 4,097-token prompt with
``block_size`` 256:

- ``save``: a new 256-token prefix saved by a PrefixCache with room for it
  (a copy into the pool) — memory only, then written through to a
  DirectoryStore (a temporary directory) and to Redis (a real redis-server on
  a unix socket, started here);
- ``restore``: ``seq_rm`` + ``restore`` of the 4,096-token prefix — from
  memory, and by a PrefixCache whose memory is empty (a new process): one
  ``get_first`` over the 16 grid candidates (the longest stored), the
  decode, the promotion into memory and the copy into the cache.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import recurrent_cache as rc

sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench/, for bench/stores.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository root, for bench.quick
from stores import interleaved, ms, start_redis  # noqa: E402
from bench.quick import NOTE, add_quick_option  # noqa: E402

SHAPE = ("mamba-130m", 24, 3 * 1536, 16 * 1536)   # layers, n_embd_r, n_embd_s (f32)
QUICK_SHAPE = ("mamba-130m", 4, 3 * 1536, 16 * 1536)
PROMPT = 4097
BLOCK = 256
NAMESPACE = "bench/prefix_store.py"


def place(cache, seq: int, n_tokens: int, rng: np.random.Generator) -> None:
    """Give ``seq`` a cell at position n_tokens - 1 holding random rows (a stand-in for a prefill)."""
    cache.seq_rm(seq, -1, -1)
    cache.seq_restore(seq, n_tokens - 1,
                      [rng.standard_normal(cache.n_embd_r, dtype=np.float32) for _ in range(cache.n_layer)],
                      [rng.standard_normal(cache.n_embd_s, dtype=np.float32) for _ in range(cache.n_layer)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/prefix_store.py", description=__doc__.split("\n")[0])
    add_quick_option(parser, "4 of the 24 layers, 3 rounds")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 15; 3 with --quick)")
    options = parser.parse_args(argv)
    if options.quick:
        print(NOTE)
    options.rounds = options.rounds or (3 if options.quick else 15)
    name, n_layer, n_embd_r, n_embd_s = QUICK_SHAPE if options.quick else SHAPE
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, PROMPT).tolist()
    workdir = Path(tempfile.mkdtemp(prefix="bench-prefix-store-"))
    server, urls = start_redis(workdir)
    try:
        stores = {"directory": lambda: rc.stores.DirectoryStore(workdir / "states"),
                  "Redis, unix socket": lambda: rc.stores.RedisStore(urls[0][1])}
        cache = rc.RecurrentCache(n_layer, n_embd_r, n_embd_s, n_seq_max=4)
        snapshot_bytes = rc.PrefixCache(cache, 0).snapshot_bytes

        def prefix_cache(store=None, snapshots: int = 4):
            return rc.PrefixCache(cache, snapshots * snapshot_bytes, block_size=BLOCK, store=store,
                                  namespace=NAMESPACE)

        # saves: seq 0 holds a state at position 255; each call saves it under new tokens
        place(cache, 0, BLOCK, rng)
        counter = itertools.count(1_000_000)
        room = options.rounds + 2   # every save is let in: a copy into the pool, no eviction
        savers = {"memory only": prefix_cache(snapshots=room)} | {
            label: prefix_cache(make(), snapshots=room) for label, make in stores.items()}
        save_cases = {label: (lambda pc=pc: pc.save(0, [next(counter)] + prompt[1:BLOCK]))
                      for label, pc in savers.items()}
        # restores: the 4,096-token state, in every store and in one PrefixCache's memory
        place(cache, 1, PROMPT - 1, rng)
        in_memory = prefix_cache()
        in_memory.save(1, prompt[:PROMPT - 1])
        for make in stores.values():
            prefix_cache(make()).save(1, prompt[:PROMPT - 1])
        readers = {"memory": in_memory}

        def fresh(label: str) -> None:   # a new process: its memory is empty
            cache.seq_rm(2, -1, -1)
            readers[label] = prefix_cache(stores[label]())

        restore_cases = {"memory": lambda: in_memory.restore(2, prompt)}
        prepare = {"memory": lambda: cache.seq_rm(2, -1, -1)}
        for label in stores:
            restore_cases[label] = lambda label=label: readers[label].restore(2, prompt)
            prepare[label] = lambda label=label: fresh(label)
        saves = interleaved(save_cases, options.rounds, {})
        restores = interleaved(restore_cases, options.rounds, prepare)
        for label in stores:   # every restore came from the store
            assert readers[label].stats()["store_hits"] == 1, label
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    mib = snapshot_bytes / 2**20
    print(f"## PrefixCache with a store: {name}-shaped state ({n_layer} layers, {mib:.1f} MiB, f32), "
          f"{options.rounds} rounds, ms: median (min–max)\n")
    print("| operation | memory only | directory | Redis, unix socket |")
    print("|---|---:|---:|---:|")
    print("| save (a new prefix) | " + " | ".join(ms(saves[label]) for label in save_cases) + " |")
    print("| restore 4,096 tokens | " + " | ".join(ms(restores[label]) for label in restore_cases) + " |")
    base_save = np.median(saves["memory only"])
    base_restore = np.median(restores["memory"])
    for label in stores:
        print(f"\n{label}: a write-through save costs {np.median(saves[label]) / base_save:.1f}x a memory-only "
              f"save; a restore from the store {np.median(restores[label]) / base_restore:.1f}x one from memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
