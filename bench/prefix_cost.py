"""What a request costs ``rc.PrefixCache`` as the prompt and ``block_size`` grow (issue 17).

    python bench/prefix_cost.py            # 4k .. 262k tokens, block_size 16 .. 2**20 (~10 s)
    python bench/prefix_cost.py --quick    # 4k and 16k tokens

For each prompt length ``n`` and ``block_size`` ``B``, the prefix cache holds
two snapshots: the prompt's first half (a path the prompt follows) and a
prompt that leaves it at ``n/4`` (a junction ``plan`` must find).  Measured,
best of a few runs, with the peak of Python allocations (tracemalloc, a
separate run) over all four:

* ``plan``: the cuts of the prompt;
* ``restore hit``: the first half restored from memory into a free cell;
* ``restore miss``: a prefix cache over a store that holds nothing, so every
  grid point and junction is looked up in it: the keys of all ``n/B``
  candidates (one hash of the prompt) and one ``get_first``;
* ``save``: a new snapshot of the whole prompt.

The cost must follow ``n`` (about 4x per row here) and not ``B``; the store
miss hashes ``4n`` bytes of tokens once.  The model state is tiny (two layers
of 3 + 5 floats): this measures the prefix cache, not the copying of rows.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The repository root, for bench.quick; importing the package bench puts the work tree's src/ on
# the path when recurrent_cache is not installed (an installed one is never shadowed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.quick import NOTE, add_quick_option  # noqa: E402

import recurrent_cache as rc  # noqa: E402


class MissingStore:
    """A store that holds nothing (the store interface, answering a miss at once)."""

    def get_first(self, keys: list[str]) -> None:
        return None

    def put(self, key: str, entry: bytes) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return {}


def at_position(cache: rc.RecurrentCache, seq: int, n_tokens: int) -> None:
    """``seq`` holds a cell at position ``n_tokens - 1`` (its rows: whatever is there)."""
    cache.seq_rm(seq, -1, -1)
    for _ in cache.init_batch(rc.Batch(token=[1], pos=[n_tokens - 1], seq_id=[seq]), n_ubatch=512):
        pass


def best_of(runs: int, setup: Callable[[], None], call: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        setup()
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def measure(n: int, block_size: int, runs: int) -> dict[str, float]:
    rng = np.random.default_rng(n + block_size)
    prompt = rng.integers(1, 1 << 20, size=n).astype(np.int32)
    branch = prompt.copy()
    branch[n // 4:] = rng.integers(1, 1 << 20, size=n - n // 4)
    cache = rc.RecurrentCache(2, 3, 5, n_seq_max=2)
    pc = rc.PrefixCache(cache, 16 * 64, block_size=block_size)
    # over a store that holds nothing, with nothing in memory: every restore asks the store
    missing = rc.PrefixCache(cache, 16 * 64, block_size=block_size, store=MissingStore(), namespace="bench")
    for held in (prompt[:n // 2], branch[:n // 2 + 7]):
        at_position(cache, 0, len(held))
        pc.save(0, held)
    assert pc.plan(prompt)[0] == min(block_size, n // 4) and pc.match(prompt) == n // 2

    def free_seq() -> None:
        cache.seq_rm(1, -1, -1)

    def positioned() -> None:
        at_position(cache, 1, n)

    out = {
        "plan": best_of(runs, lambda: None, lambda: pc.plan(prompt)),
        "restore hit": best_of(runs, free_seq, lambda: pc.restore(1, prompt)),
        "restore miss": best_of(runs, free_seq, lambda: missing.restore(1, prompt)),
        # a prompt not held yet every time: the last token differs
        "save": 0.0,
    }
    saves = []
    for i in range(runs):
        positioned()
        prompt[-1] = (1 << 21) + i
        started = time.perf_counter()
        pc.save(1, prompt)
        saves.append(time.perf_counter() - started)
    out["save"] = min(saves)
    free_seq()
    tracemalloc.start()
    pc.plan(prompt)
    pc.restore(1, prompt)
    free_seq()
    missing.restore(1, prompt)
    free_seq()
    out["peak MiB"] = tracemalloc.get_traced_memory()[1] / (1 << 20)
    tracemalloc.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_quick_option(parser, "4k and 16k tokens only")
    args = parser.parse_args()
    if args.quick:
        print(NOTE)
    lengths = [4096, 16384] if args.quick else [4096, 16384, 65536, 262144]
    blocks = [16, 256, 4096, 1 << 20]
    columns = ["plan", "restore hit", "restore miss", "save"]
    print(f"{'tokens':>8} {'block':>6} " + " ".join(f"{c + ' ms':>15}" for c in columns) + f" {'peak MiB':>9}")
    for n in lengths:
        for block_size in blocks:
            result = measure(n, block_size, runs=3)
            print(f"{n:>8} {block_size:>6} " + " ".join(f"{1000 * result[c]:>15.2f}" for c in columns)
                  + f" {result['peak MiB']:>9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
