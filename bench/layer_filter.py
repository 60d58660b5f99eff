"""The layer filter (issue 18): a decode step with a filter against one with as many unfiltered layers.

    python bench/layer_filter.py [--repeats 15] [--quick]

A hybrid model's cache keeps state for its recurrent layers only.  The filter must cost
nothing beyond the layers it keeps: a decode step of a cache of 8 layers with
``layers=(0, 2, 4, 6)`` is measured against one of 4 unfiltered layers (the same rows) and
one of 8 unfiltered layers (what a cache without a filter would hold), 64 sequences, one
token each, interleaved round by round so every case sees the same machine load:

- Python API: ``init_batch`` + ``apply()``/``next()``, and the model's part of a step: it
  reads and writes ``st.r(il)`` / ``st.s(il)`` of every layer with state;
- C header: ``decode_steps`` of examples/capi/c/ (placement only, the GIL released).
Rows: r 64 + s 256 f32 values per layer.  Figures: µs per step, median of the rounds.
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
from bench.workloads import decode, decode_batch, prompt_batch  # noqa: E402

N_SEQS, N_EMBD_R, N_EMBD_S = 64, 64, 256
CASES = {   # name: (n_layer, layers)
    "8 layers, layers=(0, 2, 4, 6)": (8, (0, 2, 4, 6)),
    "4 layers, unfiltered": (4, None),
    "8 layers, unfiltered": (8, None),
}


def decoding(n_layer: int, layers: tuple[int, ...] | None) -> rc.RecurrentCache:
    """A cache holding 64 sequences after one token each."""
    cache = rc.RecurrentCache(n_layer, N_EMBD_R, N_EMBD_S, n_seq_max=N_SEQS, layers=layers)
    decode(rc, cache, prompt_batch(rc, [1] * N_SEQS))
    return cache


def python_steps(cache: rc.RecurrentCache, steps: int) -> float:
    """µs per decode step: placement, then every layer with state read and written as a model would."""
    seqs = np.arange(N_SEQS, dtype=np.int32)
    first = cache.seq_pos_max(0) + 1
    batches = [decode_batch(rc, seqs, first + i) for i in range(steps)]
    layers = cache.layers
    start = time.perf_counter_ns()
    for batch in batches:
        st = cache.init_batch(batch)
        while True:
            st.apply()
            for il in layers:
                r, s = st.r(il), st.s(il)
                r *= 0.5
                s += 1.0
            if not st.next():
                break
    return (time.perf_counter_ns() - start) / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "3 repeats of 20 steps")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 15; 3 with --quick)")
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    repeats = options.repeats or (3 if options.quick else 15)
    steps = 20 if options.quick else 200
    print("# layer filter ({})".format("load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())))
    try:
        from bench.capi import decode_kernel   # builds examples/capi/c once, cached in build/bench
        kernel = decode_kernel("c")
    except Exception as exc:  # no compiler / setuptools: the Python rows only
        kernel = None
        print(f"(C header not measured: {type(exc).__name__}: {exc})")
    caches = {name: (decoding(*shape), decoding(*shape)) for name, shape in CASES.items()}
    python: dict[str, list[float]] = {name: [] for name in CASES}
    c_header: dict[str, list[float]] = {name: [] for name in CASES}
    gc.disable()
    try:
        order = list(caches.items())
        for round_ in range(repeats):
            # each round starts with another case: no case always runs first (cold) or last
            for name, (for_python, for_c) in order[round_ % len(order):] + order[:round_ % len(order)]:
                python[name].append(python_steps(for_python, steps))
                if kernel is not None:
                    start = time.perf_counter_ns()
                    kernel.decode_steps(for_c, N_SEQS, steps)
                    c_header[name].append((time.perf_counter_ns() - start) / steps / 1e3)
    finally:
        gc.enable()
    for for_python, for_c in caches.values():
        for_python.check()
        for_c.check()
    print(f"\n## decode step, {N_SEQS} sequences, r {N_EMBD_R} + s {N_EMBD_S} f32 per layer, µs, "
          f"median of {repeats} rounds of {steps} steps")
    print("| cache | layers with state | Python API (rows read and written) | C header (placement) |")
    print("|---|---:|---:|---:|")
    for name, (for_python, _) in caches.items():
        c_figure = f"{statistics.median(c_header[name]):.2f}" if kernel is not None else "-"
        print(f"| {name} | {len(for_python.layers)} | {statistics.median(python[name]):.1f} | {c_figure} |")


if __name__ == "__main__":
    main()
