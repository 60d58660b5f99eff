"""The benchmark suite: compiled core (Python and cimport API) vs reference vs numpy, in one run.

    python bench/run.py [--quick] [--out-dir DIR]      # or: python -m bench ...

Prints a markdown report and writes it to DIR/results.md with the plots
DIR/decode_step.png and DIR/throughput.png (DIR defaults to bench/results/,
bench/results/quick/ with --quick).  See bench/README.md for every row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable
from collections.abc import Iterator

if __package__ in (None, ""):  # run as a script: import the suite as the package `bench`
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench import capi, churn  # noqa: E402  (first: bench/__init__ may put src/ on the path)
from bench.bandwidth import MAMBA_ROWS, BandwidthRow, RowShape, copy_plan_rows, state_io_rows  # noqa: E402
from bench.measure import Stats, Timing, Workload, measure  # noqa: E402
from bench.plots import plot_all  # noqa: E402
from bench.quick import NOTE, add_quick_option  # noqa: E402
from bench.report import DECODE_STEP, LatencyRow, report  # noqa: E402
from bench.workloads import (INGEST_CACHE_SIZE, INGEST_TOKENS, BatchBuild, CimportDecodeStep,  # noqa: E402
                             ModelReadDecodeStep, PromptIngestion, PythonDecodeStep)

import recurrent_cache as compiled  # noqa: E402
from bench.workloads import reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Settings:
    timing: Timing                    # for µs operations (calibrated loops)
    bandwidth_timing: Timing          # for row moves and state I/O (contenders interleaved)
    decode_sizes: tuple[int, ...]
    decode_active: tuple[int, ...]    # active sequences; skipped where larger than the size
    reference_cells: int              # the reference decode step runs where size * active <= this
    model_read_active: tuple[int, ...]  # where the step is also timed as a model reads it
    ingest_seqs: tuple[int, ...]
    churn_sizes: tuple[int, ...]
    churn_reference_sizes: tuple[int, ...]
    churn_steps: int
    copy_rows: RowShape
    copy_moves: tuple[int, ...]       # rows moved per copy-plan step
    state_io_mib: tuple[int, ...]


FULL = Settings(
    timing=Timing(repeats=7, min_repeats=3, target_ns=100_000_000, budget_ns=3_000_000_000, max_iters=200_000),
    bandwidth_timing=Timing(repeats=7, min_repeats=3, target_ns=20_000_000, budget_ns=3_000_000_000, max_iters=50),
    decode_sizes=(64, 1024, 16384, 65536), decode_active=(1, 8, 64, 512, 4096), reference_cells=2**22,
    model_read_active=(64, 4096),
    ingest_seqs=(1, 16, 256), churn_sizes=(64, 65536), churn_reference_sizes=(64,), churn_steps=400,
    copy_rows=MAMBA_ROWS, copy_moves=(1, 8, 64), state_io_mib=(4, 32, 256))

QUICK = Settings(
    timing=Timing(repeats=3, min_repeats=3, target_ns=20_000_000, budget_ns=500_000_000, max_iters=50_000),
    bandwidth_timing=Timing(repeats=3, min_repeats=3, target_ns=5_000_000, budget_ns=500_000_000, max_iters=20),
    decode_sizes=(64, 65536), decode_active=(1, 64, 512, 4096), reference_cells=64 * 64,
    model_read_active=(64, 4096),
    ingest_seqs=(1, 16, 256), churn_sizes=(64, 65536), churn_reference_sizes=(64,), churn_steps=60,
    copy_rows=RowShape(2, 1024, 4096), copy_moves=(1, 16), state_io_mib=(4, 16))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    started = time.perf_counter()
    log(f"{name} ...")
    yield
    log(f"{name}: {time.perf_counter() - started:.1f} s")


def log_stats(label: str, api: str, stats: Stats) -> None:
    log(f"  {label:<52} {api:<11} {stats.median:>12,.2f} µs/op  ({stats.iters} ops x {stats.repeats})")


def latency_row(workload: str, size: int | None, active: int | None, timing: Timing,
                **factories: Callable[[], Workload] | None) -> LatencyRow:
    """Measure each given workload factory (python=, model=, cimport=, reference=); None is not measured."""
    stats = {}
    for api, make in factories.items():
        if make is not None:
            stats[api] = measure(make(), timing)
            log_stats(f"{workload} size {size} active {active}", api, stats[api])
    return LatencyRow(workload, size, active, **stats)


def decode_rows(settings: Settings, kernel: ModuleType | None) -> list[LatencyRow]:
    """Decode steps at every (size, active) with active <= size: Python API (bare and read as a
    model reads it), cimport API, reference."""
    rows = []
    for size in settings.decode_sizes:
        for active in (a for a in settings.decode_active if a <= size):
            rows.append(latency_row(
                DECODE_STEP, size, active, settings.timing,
                python=functools.partial(PythonDecodeStep, compiled, active, size),
                model=(functools.partial(ModelReadDecodeStep, compiled, active, size)
                       if active in settings.model_read_active else None),
                cimport=functools.partial(CimportDecodeStep, kernel, compiled, active, size) if kernel else None,
                reference=(functools.partial(PythonDecodeStep, reference, active, size)
                           if size * active <= settings.reference_cells else None)))
    return rows


def batch_build_row(settings: Settings) -> LatencyRow:
    active = 64
    return latency_row("Batch() for a decode step", None, active, settings.timing,
                       python=functools.partial(BatchBuild, compiled, active))


def ingestion_rows(settings: Settings) -> list[LatencyRow]:
    return [latency_row(f"prompt ingestion ({INGEST_TOKENS} tokens)", INGEST_CACHE_SIZE, n_seqs, settings.timing,
                        python=functools.partial(PromptIngestion, compiled, n_seqs),
                        reference=functools.partial(PromptIngestion, reference, n_seqs))
            for n_seqs in settings.ingest_seqs]


def churn_rows(settings: Settings) -> list[LatencyRow]:
    """One schedule per size, replayed by the compiled core (and the reference where affordable)."""
    rows = []
    for size in settings.churn_sizes:
        schedule = churn.plan(size, settings.churn_steps)
        measured = {"python": churn.measure_churn(compiled, size, schedule, settings.timing)}
        if size in settings.churn_reference_sizes:
            measured["reference"] = churn.measure_churn(reference, size, schedule, settings.timing)
        for kind in measured["python"]:
            by_api = {api: stats[kind] for api, stats in measured.items()}
            for api, stats in by_api.items():
                log_stats(f"churn {kind} size {size}", api, stats)
            rows.append(LatencyRow(f"churn: {kind}", size, churn.SLOTS, **by_api))
    return rows


def bandwidth_rows(settings: Settings) -> list[BandwidthRow]:
    rows = copy_plan_rows(settings.copy_rows, settings.copy_moves, settings.bandwidth_timing)
    for mib in settings.state_io_mib:
        rows += state_io_rows(mib, settings.bandwidth_timing)
    for row in rows:
        log(f"  {row.workload:<40} {row.bytes_per_op / 2**20:>8.2f} MiB  core {row.core.median:>10,.0f} µs  "
            f"numpy {row.numpy.median:>10,.0f} µs")
    return rows


def load_kernel() -> tuple[ModuleType | None, list[str]]:
    """The cimport-API kernel and a note for the report, or None and why."""
    if compiled.RecurrentCache(0, 1, 1).engine != "compiled":
        return None, ["cimport API not measured: RECURRENT_CACHE_IMPL selects the reference engine (no cell_table)"]
    try:
        kernel = capi.decode_kernel()
    except Exception as exc:  # no Cython / setuptools / compiler: report without the column
        return None, [f"cimport API not measured: building examples/capi failed ({type(exc).__name__}: {exc})"]
    return kernel, [f"cimport API: examples/capi/cython/continuous_batching.pyx decode_steps ({kernel.__file__})"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_quick_option(parser, "fewer sizes and repeats, smaller rows and state; under a minute")
    parser.add_argument("--out-dir", type=Path, metavar="DIR",
                        help="where results.md and the plots go (default bench/results/, "
                             "bench/results/quick/ with --quick)")
    args = parser.parse_args(argv)
    settings, mode = (QUICK, "quick") if args.quick else (FULL, "full")
    out_dir = args.out_dir or (RESULTS / "quick" if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    with section("building / loading the cimport kernel"):
        kernel, notes = load_kernel()
    if args.quick:
        notes.insert(0, NOTE)
    with section("decode steps"):
        latency = decode_rows(settings, kernel) + [batch_build_row(settings)]
    with section("prompt ingestion"):
        latency += ingestion_rows(settings)
    with section("churn"):
        latency += churn_rows(settings)
    with section("copy plan and state I/O"):
        bandwidth = bandwidth_rows(settings)
    notes += plot_all(latency, bandwidth, out_dir)
    notes.append(f"run time {time.perf_counter() - started:.0f} s")
    text = report(mode, notes, latency, bandwidth)
    print(text)
    (out_dir / "results.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
