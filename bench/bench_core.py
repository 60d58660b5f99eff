"""Compiled core vs pure-Python reference on the cache's bookkeeping hot paths.

Run from the repository root, with the compiled core built:

    PYTHONPATH=src python bench/bench_core.py [--quick] [--out FILE]

Every workload runs twice in the same process, once against the package
(``recurrent_cache``, the compiled core) and once against
``recurrent_cache.reference``, through the same code: a workload only ever
talks to the ``impl`` module it was given.  See bench/README.md for what each
row of the table means.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np

try:
    import recurrent_cache as compiled
except ModuleNotFoundError as exc:  # neither installed nor on PYTHONPATH: use the work tree's src/
    if exc.name != "recurrent_cache":
        raise
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import recurrent_cache as compiled
from recurrent_cache import reference

# Every cache is bookkeeping-dominated: one layer, narrow f32 rows.
N_LAYER, N_EMBD = 1, 16
N_UBATCH = 512

DECODE_SEQS = 64           # sequences advanced by one decode step
DECODE_PROMPT = 4          # prompt tokens per sequence placed before decoding
RMCP_PROMPT = 32           # prompt tokens of sequence 0 in the seq_rm/seq_cp cache
SPLIT_SEQS, SPLIT_TOKENS_PER_SEQ = 256, 16

TARGET_STEP_SCALING = 1.5  # compiled decode step: size 65536 / size 64, at most
TARGET_SPEEDUP = 30.0      # decode step at size 64: reference / compiled, at least


@dataclass(frozen=True)
class Settings:
    sizes: tuple[int, ...]   # cache sizes of the decode-step workload
    repeats: int             # timed repeats per measurement (at most)
    min_repeats: int         # ... and at least, whatever the budget says
    target_ns: int           # wanted duration of one timed repeat
    budget_ns: int           # soft cap on the timed repeats of one measurement
    max_iters: int           # cap on the operations in one timed repeat


FULL = Settings(sizes=(64, 1024, 16384, 65536), repeats=7, min_repeats=3,
                target_ns=100_000_000, budget_ns=3_000_000_000, max_iters=200_000)
QUICK = Settings(sizes=(64, 65536), repeats=3, min_repeats=3,
                 target_ns=20_000_000, budget_ns=1_000_000_000, max_iters=50_000)


# -- workloads ----------------------------------------------------------------
#
# A workload owns one cache of one implementation.  ``inputs(n)`` builds the
# arguments of the next ``n`` operations (outside the timed region) and
# ``run(arg)`` performs one operation; ``verify()`` checks, after timing, that
# the operations really did what they claim.


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark sanity check failed: {message}")


def make_cache(impl: ModuleType, n_seq_max: int, size: int) -> Any:
    return impl.RecurrentCache(N_LAYER, N_EMBD, N_EMBD, n_seq_max=n_seq_max, size=size)


def decode_batch(impl: ModuleType, n_seqs: int, pos: int) -> Any:
    """One token for each of sequences 0 .. n_seqs-1, all at position ``pos``."""
    return impl.Batch(token=np.zeros(n_seqs, dtype=np.int32),
                      pos=np.full(n_seqs, pos, dtype=np.int32),
                      seq_id=np.arange(n_seqs, dtype=np.int32))


def prompt_batch(impl: ModuleType, lengths: list[int]) -> Any:
    """Sequence ``i`` gets ``lengths[i]`` tokens at positions 0, 1, ..."""
    seq_id = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    return impl.Batch(token=np.zeros(seq_id.size, dtype=np.int32), pos=pos, seq_id=seq_id)


def decode(impl: ModuleType, cache: Any, batch: Any) -> None:
    """init_batch, then apply every ubatch: what llama_decode does to the cache."""
    st = cache.init_batch(batch, n_ubatch=N_UBATCH)
    if st.status != impl.MemoryStatus.SUCCESS:
        raise RuntimeError(f"init_batch returned {st.status!r}")
    while True:
        st.apply()
        if not st.next():
            break


class DecodeStep:
    """One decode step: one new token for each of 64 placed sequences."""

    name = f"decode step ({DECODE_SEQS} seqs x 1 token)"

    def __init__(self, impl: ModuleType, size: int) -> None:
        self.impl, self.size = impl, size
        self.cache = make_cache(impl, DECODE_SEQS, size)
        decode(impl, self.cache, prompt_batch(impl, [DECODE_PROMPT] * DECODE_SEQS))
        self.next_pos = DECODE_PROMPT

    def inputs(self, n: int) -> list[Any]:
        batches = [decode_batch(self.impl, DECODE_SEQS, self.next_pos + i) for i in range(n)]
        self.next_pos += n
        return batches

    def run(self, batch: Any) -> None:
        decode(self.impl, self.cache, batch)

    def verify(self) -> None:
        self.cache.check()
        for seq in (0, DECODE_SEQS - 1):
            expect(self.cache.seq_pos_max(seq) == self.next_pos - 1, "decode steps were not applied")


class BatchBuild:
    """Building the decode step's Batch (excluded from the decode-step row)."""

    name = f"Batch() for a decode step ({DECODE_SEQS} tokens)"

    def __init__(self, impl: ModuleType, size: int | None = None) -> None:
        self.impl, self.size = impl, None  # no cache involved

    def inputs(self, n: int) -> list[int]:
        return list(range(n))

    def run(self, pos: int) -> None:
        decode_batch(self.impl, DECODE_SEQS, pos)

    def verify(self) -> None:
        pass


class SeqRmCp:
    """``seq_rm(k, -1, -1); seq_cp(0, k, -1, -1)`` with k cycling over 1..63."""

    name = "seq_rm + seq_cp pair"

    def __init__(self, impl: ModuleType, size: int) -> None:
        self.impl, self.size = impl, size
        self.cache = make_cache(impl, DECODE_SEQS, size)
        lengths = [RMCP_PROMPT] + [DECODE_PROMPT] * (DECODE_SEQS - 1)
        decode(impl, self.cache, prompt_batch(impl, lengths))
        self.k = 0

    def inputs(self, n: int) -> list[int]:
        ks = [1 + (self.k + i) % (DECODE_SEQS - 1) for i in range(n)]
        self.k += n
        return ks

    def run(self, k: int) -> None:
        self.cache.seq_rm(k, -1, -1)
        self.cache.seq_cp(0, k, -1, -1)

    def verify(self) -> None:
        self.cache.check()
        shared = self.cache.cell(self.cache.cell(0)[2])[3]  # seq ids in seq 0's cell
        copied = {1 + i % (DECODE_SEQS - 1) for i in range(min(self.k, DECODE_SEQS - 1))}
        expect(copied <= set(shared), "seq_cp did not share seq 0's state")


class Split:
    """``init_batch`` without apply: validation + split_equal + prepare."""

    name = (f"init_batch split ({SPLIT_SEQS * SPLIT_TOKENS_PER_SEQ} tokens, "
            f"{SPLIT_SEQS} seqs)")

    def __init__(self, impl: ModuleType, size: int) -> None:
        self.impl, self.size = impl, size
        self.cache = make_cache(impl, SPLIT_SEQS, size)
        # Interleaved like a server's batch: token i is sequence i % 256.
        i = np.arange(SPLIT_SEQS * SPLIT_TOKENS_PER_SEQ, dtype=np.int32)
        self.batch = impl.Batch(token=np.zeros(i.size, dtype=np.int32),
                                pos=i // SPLIT_SEQS, seq_id=i % SPLIT_SEQS)

    def inputs(self, n: int) -> list[Any]:
        return [self.batch] * n

    def run(self, batch: Any) -> None:
        st = self.cache.init_batch(batch, n_ubatch=N_UBATCH)
        if st.status != self.impl.MemoryStatus.SUCCESS:
            raise RuntimeError(f"init_batch returned {st.status!r}")

    def verify(self) -> None:
        self.cache.check()
        expect(self.cache.used == 0, "init_batch without apply changed the cache")


# -- measuring ----------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Time per operation over the repeats, in microseconds."""

    median: float
    low: float
    high: float
    iters: int
    repeats: int


def timed_ns(workload: Any, n: int) -> int:
    """Run ``n`` operations of ``workload``; only the loop itself is timed."""
    args = workload.inputs(n)
    run = workload.run
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        for arg in args:
            run(arg)
        return time.perf_counter_ns() - t0
    finally:
        gc.enable()


def measure(workload: Any, settings: Settings) -> Stats:
    """Warm up and calibrate, then time ``repeats`` loops sized to ``target_ns``.

    The calibration runs are the warm-up: the loop grows until it lasts a
    tenth of the target, which gives the time of one operation.  A slow
    operation gets fewer repeats (never fewer than ``min_repeats``) so a
    measurement stays within ``budget_ns``.
    """
    n = 1
    while True:
        elapsed = timed_ns(workload, n)
        if elapsed * 10 >= settings.target_ns or n >= settings.max_iters:
            break
        n = min(n * 4, settings.max_iters)
    per_op = max(elapsed / n, 1.0)
    iters = int(min(max(1, settings.target_ns // per_op), settings.max_iters))
    repeats = int(settings.budget_ns // (per_op * iters))
    repeats = max(settings.min_repeats, min(settings.repeats, repeats))
    samples = [timed_ns(workload, iters) / iters / 1000 for _ in range(repeats)]
    workload.verify()
    return Stats(statistics.median(samples), min(samples), max(samples), iters, repeats)


@dataclass(frozen=True)
class Row:
    operation: str
    size: int | None
    compiled: Stats
    reference: Stats

    @property
    def ratio(self) -> float:
        return self.reference.median / self.compiled.median


def bench(workload_cls: Callable[[ModuleType, int | None], Any], size: int | None,
          settings: Settings) -> Row:
    """The same workload, built and measured once per implementation."""
    stats = {}
    for label, impl in (("compiled", compiled), ("reference", reference)):
        workload = workload_cls(impl, size)
        stats[label] = measure(workload, settings)
        print(f"  {workload.name:<44} size {str(workload.size):>6}  {label:<9} "
              f"{stats[label].median:>12,.1f} us/op  ({stats[label].iters} ops x "
              f"{stats[label].repeats})", file=sys.stderr, flush=True)
    return Row(workload.name, workload.size, stats["compiled"], stats["reference"])


def run_all(settings: Settings) -> list[Row]:
    rows = [bench(DecodeStep, size, settings) for size in settings.sizes]
    rows.append(bench(BatchBuild, None, settings))
    rows += [bench(SeqRmCp, size, settings) for size in (64, 65536)]
    rows.append(bench(Split, SPLIT_SEQS, settings))
    return rows


# -- reporting ----------------------------------------------------------------


def us(value: float) -> str:
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def spread(stats: Stats) -> str:
    return f"{us(stats.low)}–{us(stats.high)}"


def table(rows: list[Row]) -> str:
    lines = [
        "| operation | cache size | compiled µs/op (median) | compiled min–max "
        "| reference µs/op (median) | reference min–max | reference / compiled |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        size = "–" if row.size is None else str(row.size)
        lines.append(f"| {row.operation} | {size} | {us(row.compiled.median)} | {spread(row.compiled)} "
                     f"| {us(row.reference.median)} | {spread(row.reference)} | {row.ratio:,.1f}x |")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def summary(rows: list[Row]) -> list[str]:
    steps = {row.size: row for row in rows if row.operation == DecodeStep.name}
    small, large = steps[min(steps)], steps[max(steps)]
    scaling = large.compiled.median / small.compiled.median
    speedup = small.ratio
    return [
        f"- {verdict(scaling <= TARGET_STEP_SCALING)}: compiled decode step, size {large.size} / "
        f"size {small.size} = {scaling:.2f} (target <= {TARGET_STEP_SCALING})",
        f"- {verdict(speedup >= TARGET_SPEEDUP)}: decode step at size {small.size}, "
        f"reference / compiled = {speedup:.1f}x (target >= {TARGET_SPEEDUP:.0f}x)",
    ]


def origin(cls: type) -> str:
    """``module.Class (file name)``: which implementation a name resolved to."""
    path = getattr(sys.modules[cls.__module__], "__file__", None) or "?"
    return f"{cls.__module__}.{cls.__qualname__} ({Path(path).name})"


def header(settings: Settings, quick: bool) -> list[str]:
    lines = [
        f"recurrent_cache core benchmark ({'quick' if quick else 'full'}): "
        f"Python {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs",
        f"compiled = the package: {origin(compiled.RecurrentCache)}, {origin(compiled.MemoryState)}; "
        f"reference = {origin(reference.RecurrentCache)}",
        f"medians of up to {settings.repeats} repeats; each repeat is a loop of ops sized "
        f"to ~{settings.target_ns // 1_000_000} ms",
    ]
    if compiled.RecurrentCache is reference.RecurrentCache:
        lines.append("WARNING: the package exports the reference implementation "
                     "(RECURRENT_CACHE_IMPL=reference?), so both columns time the same code "
                     "and every ratio is ~1.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes, repeats and shorter loops (finishes in < 30 s)")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="also write the header, table and summary (markdown) to FILE")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL

    started = time.perf_counter()
    rows = run_all(settings)
    report = "\n".join(header(settings, args.quick) + ["", table(rows), ""] + summary(rows))
    print(report)
    print(f"(total run time {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
