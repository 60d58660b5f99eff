"""Storages (issue 19): the decode step on numpy and on torch, and the tensor calls a move costs.

    python bench/storage.py [--repeats 15] [--quick]

Four storages, the same caches (64 sequences, 4 layers, r 64 + s 256 values per layer):
numpy (the default), torch on the CPU moved by the core in C, torch on the CPU through the
index-array path a GPU takes (``host_access=False``), and CUDA when there is a GPU.

1. A decode step without moves, 64 sequences one token each: ``init_batch`` + ``apply()`` /
   ``next()`` and the views ``st.r(il)`` / ``st.s(il)`` of every layer (the cache's part of a
   step; what a model does with the rows is the model's).  µs per step, median of the
   rounds, the storages interleaved round by round; the ratio to numpy.
2. A step that moves rows: ``moved`` forks (``seq_cp``) each get their own cell in one apply.
   The storage calls it makes, counted through a storage that wraps torch (index path), for
   1 and 8 layers and 1 and 16 moved rows — they must not grow — and its time per storage.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):   # run as a script: the repository root on the path, for bench.quick
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np  # noqa: E402

import recurrent_cache as rc  # noqa: E402
from bench.quick import NOTE, add_quick_option  # noqa: E402
from bench.workloads import decode, decode_batch, prompt_batch  # noqa: E402
from recurrent_cache.storage import TorchStorage  # noqa: E402

N_SEQS, N_LAYER, N_EMBD_R, N_EMBD_S = 64, 4, 64, 256


class Counting:
    """A storage that counts the calls it forwards to another (and hides host memory, as a GPU's)."""

    host_access = False

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self.name, self.device = inner.name, inner.device

    def host_view(self, tensor: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return method(*args)
        return counted


def storages() -> dict[str, Any]:
    made: dict[str, Any] = {"numpy": "numpy", "torch cpu": TorchStorage("cpu"),
                            "torch cpu, index path": TorchStorage("cpu", host_access=False)}
    import torch
    if torch.cuda.is_available():
        made["torch cuda"] = TorchStorage("cuda")
    return made


def decoding(storage: Any, n_layer: int = N_LAYER, n_seqs: int = N_SEQS, size: int = N_SEQS) -> rc.RecurrentCache:
    """A cache of ``size`` cells holding n_seqs sequences after one token each."""
    cache = rc.RecurrentCache(n_layer, N_EMBD_R, N_EMBD_S, n_seq_max=size, storage=storage)
    decode(rc, cache, prompt_batch(rc, [1] * n_seqs))
    return cache


def decode_steps(cache: rc.RecurrentCache, steps: int) -> float:
    """µs per decode step of the cache's part: placement and the row views of every layer."""
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
                st.r(il), st.s(il)
            if not st.next():
                break
    return (time.perf_counter_ns() - start) / steps / 1e3


def moving_step(storage: Any, n_layer: int, moved: int) -> tuple[rc.RecurrentCache, rc.Batch]:
    """A cache whose next batch gives ``moved`` forks of sequence 0 their own cells (rows copied)."""
    cache = decoding(storage, n_layer, 1, moved + 1)
    for seq in range(1, moved + 1):
        cache.seq_cp(0, seq)
    return cache, rc.Batch(token=[1] * moved, seq_id=list(range(1, moved + 1)), pos=[1] * moved)


def calls_of_a_move(n_layer: int, moved: int) -> int:
    storage = Counting(TorchStorage("cpu"))
    cache, batch = moving_step(storage, n_layer, moved)
    storage.calls = 0
    cache.init_batch(batch).apply()
    return storage.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "3 repeats of 20 steps")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 15; 3 with --quick)")
    options = parser.parse_args()
    if options.quick:
        print(NOTE)
    import torch
    torch.set_num_threads(1)   # small tensors: threads only add contention on a shared machine
    repeats = options.repeats or (3 if options.quick else 15)
    steps = 20 if options.quick else 200
    print("# storages ({}; torch {}, {} thread)".format(
        "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), torch.__version__, torch.get_num_threads()))
    made = storages()
    caches = {name: decoding(storage) for name, storage in made.items()}
    samples: dict[str, list[float]] = {name: [] for name in made}
    moves: dict[str, list[float]] = {name: [] for name in made}
    gc.disable()
    try:
        order = list(made)
        for round_ in range(repeats):
            for name in order[round_ % len(order):] + order[:round_ % len(order)]:
                samples[name].append(decode_steps(caches[name], steps))
                cache, batch = moving_step(made[name], N_LAYER, 16)
                start = time.perf_counter_ns()
                cache.init_batch(batch).apply()
                moves[name].append((time.perf_counter_ns() - start) / 1e3)
    finally:
        gc.enable()
    for cache in caches.values():
        cache.check()
    base = statistics.median(samples["numpy"])
    print(f"\n## decode step without moves, {N_SEQS} sequences, {N_LAYER} layers, µs, median of {repeats} "
          f"rounds of {steps} steps")
    print("| storage | µs per step | vs numpy | a step moving 16 rows (µs) |")
    print("|---|---:|---:|---:|")
    for name in made:
        median = statistics.median(samples[name])
        print(f"| {name} | {median:.1f} | {median / base:.2f}x | {statistics.median(moves[name]):.0f} |")
    print("\n## storage calls of one apply that moves rows (torch, index path)")
    print("| layers | rows moved | storage calls |")
    print("|---:|---:|---:|")
    for n_layer in (1, 8):
        for moved in (1, 16):
            print(f"| {n_layer} | {moved} | {calls_of_a_move(n_layer, moved)} |")


if __name__ == "__main__":
    main()
