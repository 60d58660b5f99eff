"""The decode step as a model really takes it, against the bare apply()/next() loop.

    python bench/model_step.py [--repeats 15] [--quick]

Both run on the same prebuilt one-token-per-sequence batches through the Python
API: ``bare`` is ``init_batch`` + ``apply()`` / ``next()``; ``model reads`` iterates
the ``MemoryState`` and reads what a model reads for every ubatch — ``ub.token``,
``ub.pos``, ``ub.seq_id``, ``ub.output`` and ``st.r(il)`` / ``st.s(il)`` of every
layer (two layers here).  Interleaved round by round, medians in µs per step, the
ratio in the same run (issue target: <= 1.75x at 64 sequences, <= 1.5x at 4,096).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import recurrent_cache as rc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the repository root, for bench.quick
from bench.quick import NOTE, add_quick_option  # noqa: E402

N_LAYER, N_EMBD = 2, 16


def decoding(n_seqs: int, steps: int) -> tuple[rc.RecurrentCache, list[rc.Batch]]:
    cache = rc.RecurrentCache(N_LAYER, N_EMBD, N_EMBD, n_seq_max=n_seqs)
    seqs = np.arange(n_seqs, dtype=np.int32)
    for _ in cache.init_batch(rc.Batch(token=np.zeros(n_seqs, np.int32), seq_id=seqs,
                                       pos=np.zeros(n_seqs, np.int32)), n_ubatch=n_seqs):
        pass
    batches = [rc.Batch(token=np.zeros(n_seqs, np.int32), seq_id=seqs, pos=np.full(n_seqs, 1 + i, np.int32))
               for i in range(steps)]
    return cache, batches


def bare(cache: rc.RecurrentCache, batch: rc.Batch) -> None:
    st = cache.init_batch(batch, n_ubatch=4096)
    while True:
        st.apply()
        if not st.next():
            break


def model_reads(cache: rc.RecurrentCache, batch: rc.Batch) -> None:
    st = cache.init_batch(batch, n_ubatch=4096)
    for ub in st:
        read = (ub.token, ub.pos, ub.seq_id, ub.output)
        rows = [(st.r(il), st.s(il)) for il in range(N_LAYER)]
        assert read[0] is not None and len(rows) == N_LAYER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "3 repeats")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 15; 3 with --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 4096])
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    options.repeats = options.repeats or (3 if options.quick else 15)
    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"# decode step read as a model reads it ({load})")
    print("| sequences | bare apply/next µs | model reads µs | ratio |")
    print("|---:|---:|---:|---:|")
    for n_seqs in options.sizes:
        steps = max(20, 20_000 // n_seqs)
        caches = {name: decoding(n_seqs, steps * options.repeats) for name in ("bare", "model")}
        samples: dict[str, list[float]] = {"bare": [], "model": []}
        gc.disable()
        try:
            for r in range(options.repeats):
                for name, run in (("bare", bare), ("model", model_reads)):
                    cache, batches = caches[name]
                    mine = batches[r * steps:(r + 1) * steps]
                    start = time.perf_counter_ns()
                    for batch in mine:
                        run(cache, batch)
                    samples[name].append((time.perf_counter_ns() - start) / steps / 1e3)
        finally:
            gc.enable()
        for cache, _ in caches.values():
            cache.check()
            assert cache.seq_pos_max(n_seqs - 1) == steps * options.repeats
        b, m = statistics.median(samples["bare"]), statistics.median(samples["model"])
        print(f"| {n_seqs} | {b:.1f} | {m:.1f} | {m / b:.2f}x |")


if __name__ == "__main__":
    main()
