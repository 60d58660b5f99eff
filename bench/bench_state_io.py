"""Throughput of state_write_into / state_read / state_write against a plain numpy copy.

A whole cache of at least 256 MiB of state rows (every cell in use, Mamba-like
row widths) is written into a preallocated buffer, read back, and written to
a new bytes object, by the compiled core and by the pure-Python reference.
The physical baseline is numpy copying the same bytes between the same kind
of memory (the state tensors and one preallocated buffer), measured in the
same run, interleaved with the others so that both see the same machine.

    python bench/bench_state_io.py              # 256 MiB, 7 repeats
    python bench/bench_state_io.py --mib 1024 --repeats 5

Ratios are throughput / numpy throughput (median of the repeats); the goal
for state_write_into and state_read is >= 0.8.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

import recurrent_cache
import recurrent_cache.reference

N_LAYER = 8
N_EMBD_R = 3 * 1024    # (d_conv - 1) * d_inner of a d_inner = 1024 Mamba
N_EMBD_S = 16 * 1024   # d_state * d_inner
GOAL = 0.8


def build(rc, size: int):
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=size)
    for _ in cache.init_batch(rc.Batch(token=np.zeros(size, np.int32), pos=np.zeros(size, np.int32),
                                       seq_id=np.arange(size, dtype=np.int32))):
        pass
    rng = np.random.default_rng(0)
    for tensor in list(cache.r) + list(cache.s):
        tensor[...] = rng.standard_normal(tensor.shape, dtype=np.float32)
    assert cache.used == size
    return cache


def timed(fn) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state rows in MiB (at least)")
    parser.add_argument("--repeats", type=int, default=7)
    options = parser.parse_args()

    cell_bytes = N_LAYER * (N_EMBD_R + N_EMBD_S) * 4
    size = -(-options.mib * 2**20 // cell_bytes)
    row_bytes = size * cell_bytes
    core = build(recurrent_cache, size)
    reference = build(recurrent_cache.reference, size)
    tensors = [t.reshape(-1).view(np.uint8) for t in list(core.r) + list(core.s)]
    blob = core.state_write()
    assert blob == reference.state_write()
    target = np.empty(len(blob), dtype=np.uint8)
    target[...] = 1   # fault every page in before timing

    # the baseline: the same bytes, tensor by tensor, into and out of one buffer
    sections = []
    offset = 0
    for tensor in tensors:
        sections.append((tensor, target[offset:offset + tensor.size]))
        offset += tensor.size

    def numpy_out():
        for tensor, section in sections:
            np.copyto(section, tensor)

    def numpy_in():
        for tensor, section in sections:
            np.copyto(tensor, section)

    def numpy_new():
        fresh = np.empty(len(blob), dtype=np.uint8)
        offset = 0
        for tensor in tensors:
            np.copyto(fresh[offset:offset + tensor.size], tensor)
            offset += tensor.size

    out, into, new = "numpy copy tensors -> buffer", "numpy copy buffer -> tensors", "numpy copy -> new array"
    # name: (what runs, the numpy copy it is compared with)
    cases = {
        out: (numpy_out, out),
        into: (numpy_in, into),
        new: (numpy_new, new),
        "core state_write_into(buffer)": (lambda: core.state_write_into(target), out),
        "core state_read(blob)": (lambda: core.state_read(blob), into),
        "core state_write() -> bytes": (core.state_write, out),
        "  the same vs a copy to a new array": (None, new),
        "reference state_write_into(buffer)": (lambda: reference.state_write_into(target), out),
        "reference state_read(blob)": (lambda: reference.state_read(blob), into),
        "reference state_write() -> bytes": (reference.state_write, out),
    }
    times: dict[str, list[float]] = {name: [] for name, (fn, _) in cases.items() if fn}
    for fn, _ in cases.values():   # warm-up
        if fn:
            fn()
    for _ in range(options.repeats):
        for name, (fn, _) in cases.items():
            if fn:
                times[name].append(timed(fn))
    times["  the same vs a copy to a new array"] = times["core state_write() -> bytes"]
    assert core.state_write() == blob and reference.state_write() == blob
    core.check()

    print(f"whole cache: {size} cells x {N_LAYER} layers x (r {N_EMBD_R} + s {N_EMBD_S}) f32 = "
          f"{row_bytes / 2**20:.0f} MiB of rows, blob {len(blob) / 2**20:.1f} MiB; "
          f"median of {options.repeats} repeats")
    print(f"{'operation':<38} {'median ms':>10} {'min ms':>8} {'GB/s':>7} {'ratio':>7}  (vs)")
    ratios = {}
    for name, (_, baseline) in cases.items():
        samples = times[name]
        median = statistics.median(samples)
        ratios[name] = statistics.median(times[baseline]) / median
        print(f"{name:<38} {median * 1e3:>10.1f} {min(samples) * 1e3:>8.1f} "
              f"{row_bytes / median / 1e9:>7.2f} {ratios[name]:>7.2f}  ({baseline})")
    verdict = all(ratios[name] >= GOAL for name in ("core state_write_into(buffer)", "core state_read(blob)"))
    print(f"goal (core state_write_into and state_read >= {GOAL} x numpy): {'met' if verdict else 'NOT met'}")


if __name__ == "__main__":
    main()
