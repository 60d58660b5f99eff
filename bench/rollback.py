"""Rollback (SPEC §7): what keeping a history costs a decode step, what a rollback costs, memory.

    python bench/rollback.py [--repeats 15] [--quick]

One run, interleaved round by round so every case sees the same machine load:
- the decode step (64 sequences, one token each, init_batch + apply/next through the
  Python API, and through the C header: ``decode_steps`` of examples/capi/c/) with
  n_rollback = 0, 4 and 16: the cache files the state each group
  starts from into its history (one row per tensor per sequence), so the cost grows with
  the sequences in the ubatch, never with the cache's size;
- what filing the start states adds to a decode step with a realistic state (n_rollback = 16,
  4 layers × (r 64 + s 256) f32 values, 64 sequences), against numpy copying the same rows
  into a history array of the same layout (issue 17: at most 2x);
- a rollback of one sequence by 1 and by k tokens (seq_rm(seq, p0, -1));
- the memory a cell needs for its history, for a mamba-130m-shaped state.
Rows are 1 layer of 16 floats for the step timings (bookkeeping, not bandwidth).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a script: the repository root on the path, for bench.capi
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402

import recurrent_cache as rc  # noqa: E402
from bench.quick import NOTE, add_quick_option  # noqa: E402

N_SEQS, N_EMBD = 64, 16
REALISTIC = (4, 64, 256)   # n_layer, n_embd_r, n_embd_s of the filing figure


def decoding(n_rollback: int, steps: int, size: int,
             shape: tuple[int, int, int] = (1, N_EMBD, N_EMBD)) -> tuple[rc.RecurrentCache, list[rc.Batch]]:
    cache = rc.RecurrentCache(*shape, n_seq_max=size, n_rollback=n_rollback)
    seqs = np.arange(N_SEQS, dtype=np.int32)
    for _ in cache.init_batch(rc.Batch(token=np.zeros(N_SEQS, np.int32), seq_id=seqs,
                                       pos=np.zeros(N_SEQS, np.int32))):
        pass
    batches = [rc.Batch(token=np.zeros(N_SEQS, np.int32), seq_id=seqs, pos=np.full(N_SEQS, 1 + i, np.int32))
               for i in range(steps)]
    return cache, batches


def step(cache: rc.RecurrentCache, batch: rc.Batch) -> None:
    st = cache.init_batch(batch)
    while True:
        st.apply()
        if not st.next():
            break


def timed_c_steps(kernel, repeats: int, size: int, shape: tuple[int, int, int] = (1, N_EMBD, N_EMBD),
                  rollbacks: tuple[int, ...] = (0, 4, 16)) -> dict[int, float]:
    """µs per decode step through the C header (one call runs 200 steps, GIL released)."""
    steps = 200
    runs = {k: decoding(k, 0, size, shape)[0] for k in rollbacks}
    samples: dict[int, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, cache in runs.items():
            start = time.perf_counter_ns()
            kernel.decode_steps(cache, N_SEQS, steps)
            samples[k].append((time.perf_counter_ns() - start) / steps / 1e3)
    for cache in runs.values():
        cache.check()
        assert cache.seq_pos_max(0) == steps * repeats
    return {k: statistics.median(v) for k, v in samples.items()}


def timed_steps(repeats: int, size: int, shape: tuple[int, int, int] = (1, N_EMBD, N_EMBD),
                rollbacks: tuple[int, ...] = (0, 4, 16)) -> dict[int, float]:
    steps = 200
    runs = {k: decoding(k, steps * repeats, size, shape) for k in rollbacks}
    samples: dict[int, list[float]] = {k: [] for k in runs}
    gc.disable()
    try:
        for r in range(repeats):
            for k, (cache, batches) in runs.items():
                start = time.perf_counter_ns()
                for batch in batches[r * steps:(r + 1) * steps]:
                    step(cache, batch)
                samples[k].append((time.perf_counter_ns() - start) / steps / 1e3)
    finally:
        gc.enable()
    for k, (cache, _) in runs.items():
        cache.check()
        assert cache.seq_rollback_min(0) == (-1 if k == 0 else steps * repeats - k), (k, cache.seq_rollback_min(0))
    return {k: statistics.median(v) for k, v in samples.items()}


def numpy_filing(repeats: int, n_rollback: int = 16) -> float:
    """µs per decode step for numpy to copy each sequence's rows (every tensor) into a history of
    the core's layout, history[k][cell, q % n_rollback]: the work filing the start states does."""
    n_layer, n_embd_r, n_embd_s = REALISTIC
    tensors = [np.random.default_rng(k).standard_normal((N_SEQS, n), dtype=np.float32)
               for k, n in enumerate([n_embd_r] * n_layer + [n_embd_s] * n_layer)]
    history = [np.zeros((N_SEQS, n_rollback, t.shape[1]), np.float32) for t in tensors]
    cells, steps, samples = np.arange(N_SEQS), 200, []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for q in range(steps):
            for tensor, kept in zip(tensors, history):
                kept[:, q % n_rollback] = tensor[cells]
        samples.append((time.perf_counter_ns() - start) / steps / 1e3)
    return statistics.median(samples)


def rollback_cost(k: int, back: int, repeats: int) -> float:
    """µs per seq_rm(seq, pos + 1 - back, -1) on a mamba-130m-shaped state (24 layers)."""
    cache = rc.RecurrentCache(24, 3 * 1536, 16 * 1536, n_seq_max=2, n_rollback=k)
    times = []
    for _ in range(repeats):
        for _p in range(k + 1):
            for _ in cache.init_batch(rc.Batch(token=[0], seq_id=[0], pos=[cache.seq_pos_max(0) + 1])):
                pass
        pos = cache.seq_pos_max(0)
        start = time.perf_counter_ns()
        assert cache.seq_rm(0, pos + 1 - back, -1)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "3 repeats")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 15; 3 with --quick)")
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    options.repeats = options.repeats or (3 if options.quick else 15)
    rollback_repeats = 3 if options.quick else 9
    print("# rollback ({})".format("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())))
    print(f"\n## decode step, {N_SEQS} sequences, µs, median of {options.repeats}")
    print("| API | cache size | n_rollback 0 | n_rollback 4 | n_rollback 16 | 16 / 0 |")
    print("|---|---:|---:|---:|---:|---:|")
    try:
        from bench.capi import decode_kernel   # builds examples/capi/c once, cached in build/bench
        kernel = decode_kernel("c")
    except Exception as exc:  # no compiler / setuptools: the Python rows only
        kernel = None
        print(f"(C header not measured: {type(exc).__name__}: {exc})")
    for size in (64, 65536):
        t = timed_steps(options.repeats, size)
        print(f"| Python | {size} | {t[0]:.1f} | {t[4]:.1f} | {t[16]:.1f} | {t[16] / t[0]:.2f}x |")
        if kernel is not None:
            t = timed_c_steps(kernel, options.repeats, size)
            print(f"| C header | {size} | {t[0]:.2f} | {t[4]:.2f} | {t[16]:.2f} | {t[16] / t[0]:.2f}x |")
    n_layer, n_embd_r, n_embd_s = REALISTIC
    print(f"\n## filing the start states: n_rollback 16, {n_layer} layers x (r {n_embd_r} + s {n_embd_s}) f32, "
          f"{N_SEQS} sequences, µs per decode step, median of {options.repeats}")
    print("| API | n_rollback 0 | n_rollback 16 | added by filing | numpy copying the same rows | added / numpy |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline = numpy_filing(options.repeats)
    timings = {"Python": timed_steps(options.repeats, N_SEQS, REALISTIC, (0, 16))}
    if kernel is not None:
        timings["C header"] = timed_c_steps(kernel, options.repeats, N_SEQS, REALISTIC, (0, 16))
    for api, t in timings.items():
        added = t[16] - t[0]
        print(f"| {api} | {t[0]:.2f} | {t[16]:.2f} | {added:.2f} | {baseline:.2f} | {added / baseline:.2f}x |")
    print("\n## rollback of one sequence, mamba-130m-shaped state (24 layers, 2.7 MiB), µs")
    print("| n_rollback | back 1 token | back n_rollback tokens |")
    print("|---:|---:|---:|")
    for k in (4, 16):
        print(f"| {k} | {rollback_cost(k, 1, rollback_repeats):.0f} | {rollback_cost(k, k, rollback_repeats):.0f} |")
    row = (3 * 1536 + 16 * 1536) * 4 * 24
    print("\n## memory per cell, mamba-130m-shaped state (f32)")
    print("| n_rollback | state MiB | history MiB |")
    print("|---:|---:|---:|")
    for k in (0, 4, 16):
        print(f"| {k} | {row / 2**20:.2f} | {k * row / 2**20:.2f} |")


if __name__ == "__main__":
    main()
