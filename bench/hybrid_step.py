"""The hybrid memory's 64-sequence decode step, from 64 to 1M KV cells held, next to the recurrent-only step.

    python bench/hybrid_step.py [--repeats 200] [--quick]

A ``HybridCache`` (one attention layer, one recurrent layer, rows one value wide so that placement,
not row traffic, is measured) whose 64 sequences hold N / 64 tokens each, N from 64 to 1M; one step
is ``init_batch`` of one token per sequence at its next position (the KV half's prepare and the
recurrent split) and
``apply`` of its one ubatch in both halves, through the Python API.  The table has room for every
repeat (``kv_size = N + 64 * repeats``): the steps run back to back and nothing is taken back.  The
table has served those steps once before the timed run (then cleared and filled again), as a cache
in service has: each page of its sequences' trees is touched once in its life, which a table on
fresh memory pays during its first steps (~0.4 page faults a step; its median is timed beside).  The
recurrent-only step is the same through a ``RecurrentCache`` of 64 sequences; the ratio is the
hybrid step's median over it, measured in the same run (the caches interleaved in rounds of 10
steps, so that a burst of load on a shared machine falls on each alike), and beside it the ratio of
the fastest steps, which a busy machine disturbs least.  The load average is recorded; the full
run writes bench/results/hybrid_step.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a script: the repository root on the path, for bench.quick
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402

from bench.quick import NOTE, add_quick_option  # noqa: E402
from recurrent_cache import Batch, HybridCache, RecurrentCache  # noqa: E402

N_SEQS = 64
PROMPT_UBATCH = 512
RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_step.md"


def hybrid(held: int, repeats: int, warm: bool = True) -> HybridCache:
    """A hybrid memory whose 64 sequences hold ``held`` tokens each, with room for ``repeats`` steps.
    ``warm``: the steps run once first, then the cache is cleared and filled again, so that the timed
    steps reuse memory the table has touched (as a cache that has served before); on fresh memory each
    step also pays the first touch of the pages its sequences' trees grow into (~0.4 page faults)."""
    cache = HybridCache(2, attn_layers=[0], recr_layers=[1], n_embd_k=1, n_embd_v=1, n_embd_r=1, n_embd_s=1,
                        kv_size=N_SEQS * (held + repeats), n_seq_max=N_SEQS, dtype_k="f32", dtype_v="f32")
    fill(cache, held)
    if warm:
        steps(cache, held, repeats)
        cache.clear()
        fill(cache, held)
    return cache


def fill(cache: HybridCache, held: int) -> None:
    """Each of the 64 sequences' first ``held`` tokens, in prompt ubatches."""
    for seq in range(N_SEQS):
        for start in range(0, held, PROMPT_UBATCH):
            n = min(PROMPT_UBATCH, held - start)
            state = cache.init_batch(Batch(token=np.zeros(n, np.int32), seq_id=np.full(n, seq, np.int32),
                                           pos=np.arange(start, start + n, dtype=np.int32)), n_ubatch=PROMPT_UBATCH)
            for _ in state:
                pass


def steps(cache: HybridCache | RecurrentCache, held: int, repeats: int) -> list[float]:
    """µs of each of ``repeats`` decode steps (one token per sequence at its next position, as a
    decode loop knows them: init_batch + apply)."""
    token = np.zeros(N_SEQS, np.int32)
    seqs = np.arange(N_SEQS, dtype=np.int32)
    samples = []
    for step in range(repeats):
        batch = Batch(token=token, seq_id=seqs, pos=np.full(N_SEQS, held + step, np.int32))
        start = time.perf_counter_ns()
        state = cache.init_batch(batch)
        state.apply()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    add_quick_option(parser, "N up to 16K, 20 repeats, no results file")
    args = parser.parse_args()
    sizes = [64, 1024, 16384] if args.quick else [64, 1024, 16384, 262144, 1048576]
    repeats = 20 if args.quick else args.repeats
    if args.quick:
        print(NOTE)
    load_before = os.getloadavg()[0]
    rows = []
    rounds = max(1, repeats // 10)   # rounds of 10 steps: a burst of load falls on all three alike
    for held_cells in sizes:
        held = held_cells // N_SEQS
        cache, recurrent_cache = hybrid(held, repeats), RecurrentCache(1, 1, 1, n_seq_max=N_SEQS)
        fresh = hybrid(held, repeats, warm=False)
        hybrid_samples: list[float] = []
        recurrent_samples: list[float] = []
        fresh_samples: list[float] = []
        for r in range(rounds):   # interleaved, so that all see the same load
            per_round = repeats // rounds
            recurrent_samples += steps(recurrent_cache, r * per_round, per_round)
            hybrid_samples += steps(cache, held + r * per_round, per_round)
            fresh_samples += steps(fresh, held + r * per_round, per_round)
        median, recurrent = statistics.median(hybrid_samples), statistics.median(recurrent_samples)
        fastest, recurrent_fastest = min(hybrid_samples), min(recurrent_samples)
        fresh_median = statistics.median(fresh_samples)
        rows.append((held_cells, median, recurrent, median / recurrent, fastest, recurrent_fastest,
                     fastest / recurrent_fastest, fresh_median, fresh_median / recurrent))
        print(f"{held_cells:>9} KV cells held: hybrid step {median:8.1f} µs median, "
              f"recurrent-only {recurrent:6.1f} µs: {median / recurrent:4.2f}x (fastest steps "
              f"{fastest:.1f} / {recurrent_fastest:.1f} µs: {fastest / recurrent_fastest:4.2f}x; on fresh "
              f"memory {fresh_median:.1f} µs: {fresh_median / recurrent:4.2f}x)", flush=True)
    load_after = os.getloadavg()[0]
    lines = ["# The hybrid decode step (bench/hybrid_step.py)", "",
             f"64 sequences, one token each at its next position, `init_batch` + `apply` through the Python API; "
             f"medians of {repeats} steps, the hybrid and the recurrent-only (RecurrentCache, 64 sequences) steps "
             f"interleaved in {rounds} rounds. Load average {load_before:.2f} before, {load_after:.2f} after "
             f"({os.cpu_count()} cores). The hybrid's table has served the same steps once before (then "
             f"cleared and filled again); the last two columns time a table on fresh memory, whose steps also "
             f"fault in the pages its sequences' trees grow into.", "",
             "| KV cells held | hybrid step (µs) | recurrent-only step (µs) | ratio | fastest hybrid step (µs) "
             "| fastest recurrent-only step (µs) | ratio of the fastest | fresh memory: hybrid step (µs) | ratio |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {n:,} | {m:.1f} | {r:.1f} | {q:.2f}x | {fm:.1f} | {fr:.1f} | {fq:.2f}x | {c:.1f} | {cq:.2f}x |"
              for n, m, r, q, fm, fr, fq, c, cq in rows]
    if not args.quick:
        RESULTS.write_text("\n".join(lines) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
