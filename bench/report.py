"""The markdown report: header, the latency table, the bandwidth table and the targets."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import numpy as np

import recurrent_cache as compiled

from .bandwidth import BandwidthRow
from .measure import Stats

DECODE_STEP = "decode step"
TARGET_CIMPORT_STEP_US = 10.0   # cimport API, 64 sequences, any size up to 65536
TARGET_STEP_SCALING = 1.5       # Python API, 64 sequences: size 65536 / size 64, at most
TARGET_SPEEDUP = 30.0           # decode step, 64 sequences: reference / Python API, at least
TARGET_STATE_IO = 0.8           # state_write_into and state_read: throughput / numpy, at least
TARGET_STATE_IO_ROWS = ("state_write_into(buffer)", "state_read(blob)")
TARGET_SEQS = 64
TARGET_MODEL_READ = {64: 1.75, 4096: 1.5}   # the step read as a model reads it / the bare step, at most


@dataclass(frozen=True)
class LatencyRow:
    """One operation at one cache size and number of active sequences, per API."""

    workload: str
    size: int | None
    active: int | None
    python: Stats | None
    cimport: Stats | None = None
    reference: Stats | None = None
    model: Stats | None = None        # Python API, the step read as a model reads it

    @property
    def model_ratio(self) -> float | None:
        """model reads / bare Python API step."""
        if self.python is None or self.model is None:
            return None
        return self.model.median / self.python.median

    @property
    def speedup(self) -> float | None:
        """reference / Python API (both are the Python API, the same calls)."""
        if self.python is None or self.reference is None:
            return None
        return self.reference.median / self.python.median


# -- cells ---------------------------------------------------------------------------


def number(value: float) -> str:
    return f"{value:,.2f}" if value < 10 else f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def timing_cell(stats: Stats | None) -> str:
    """``median (min–max)``, or ``–`` when not measured."""
    if stats is None:
        return "–"
    return f"{number(stats.median)} ({number(stats.low)}–{number(stats.high)})"


def ratio_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}x" if value >= 10 else f"{value:.2f}x"


def gb_per_s(n_bytes: int, stats: Stats) -> str:
    return f"{n_bytes / (stats.median * 1e3):.2f}"


def rows_cell(row: BandwidthRow) -> str:
    return "–" if row.rows_moved is None else f"{row.rows_moved} + {row.rows_zeroed}"


def throughput_ratio(row: BandwidthRow, stats: Stats) -> float:
    """Throughput of ``stats`` / throughput of numpy on the same bytes."""
    return row.numpy.median / stats.median


# -- tables --------------------------------------------------------------------------


def latency_table(rows: list[LatencyRow]) -> str:
    lines = ["| workload | cache size | active seqs | Python API µs/op | read as a model µs/op | model / bare "
             "| cimport API µs/op | reference µs/op | reference / Python API |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.workload} | {row.size or '–'} | {row.active or '–'} "
                     f"| {timing_cell(row.python)} | {timing_cell(row.model)} | {ratio_cell(row.model_ratio)} "
                     f"| {timing_cell(row.cimport)} "
                     f"| {timing_cell(row.reference)} | {ratio_cell(row.speedup)} |")
    return "\n".join(lines)


def bandwidth_table(rows: list[BandwidthRow]) -> str:
    lines = ["| workload | MiB per op | rows moved + zeroed | core µs/op | core GB/s | numpy baseline "
             "| numpy GB/s | core / numpy | reference GB/s | reference / numpy |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row.workload} | {row.bytes_per_op / 2**20:,.2f} | {rows_cell(row)} "
            f"| {timing_cell(row.core)} | {gb_per_s(row.bytes_per_op, row.core)} "
            f"| {row.baseline} | {gb_per_s(row.bytes_per_op, row.numpy)} "
            f"| {ratio_cell(throughput_ratio(row, row.core))} "
            f"| {gb_per_s(row.bytes_per_op, row.reference)} "
            f"| {ratio_cell(throughput_ratio(row, row.reference))} |")
    return "\n".join(lines)


# -- summary -------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def decode_steps_of(rows: list[LatencyRow], active: int) -> dict[int, LatencyRow]:
    return {row.size: row for row in rows if row.workload == DECODE_STEP and row.active == active}


def decode_step_line(row: LatencyRow) -> str:
    return (f"- decode step, {row.active} seqs, size {row.size}: Python API {timing_cell(row.python)} µs, "
            f"cimport API {timing_cell(row.cimport)} µs, reference {timing_cell(row.reference)} µs "
            f"(reference / Python API {ratio_cell(row.speedup)})")


def cimport_target_line(steps: dict[int, LatencyRow]) -> str:
    measured = [row for row in steps.values() if row.cimport is not None]
    if not measured:
        return "- n/a: cimport API decode step (not measured)"
    worst = max(measured, key=lambda row: row.cimport.median)
    return (f"- {verdict(worst.cimport.median <= TARGET_CIMPORT_STEP_US)}: cimport API {TARGET_SEQS}-seq "
            f"decode step <= {TARGET_CIMPORT_STEP_US:.0f} µs at every size: worst "
            f"{number(worst.cimport.median)} µs at size {worst.size}")


def scaling_target_line(small: LatencyRow, large: LatencyRow) -> str:
    scaling = large.python.median / small.python.median
    return (f"- {verdict(scaling <= TARGET_STEP_SCALING)}: Python API {TARGET_SEQS}-seq decode step, "
            f"size {large.size} / size {small.size} = {scaling:.2f} (target <= {TARGET_STEP_SCALING})")


def speedup_target_line(row: LatencyRow) -> str:
    ok = None if row.speedup is None else row.speedup >= TARGET_SPEEDUP
    return (f"- {verdict(ok)}: reference / Python API, {TARGET_SEQS}-seq decode step at size {row.size} = "
            f"{ratio_cell(row.speedup)} (target >= {TARGET_SPEEDUP:.0f}x)")


def model_read_lines(rows: list[LatencyRow]) -> list[str]:
    lines = []
    for active, target in TARGET_MODEL_READ.items():
        measured = [row for row in rows if row.workload == DECODE_STEP and row.active == active
                    and row.model_ratio is not None]
        for row in measured:
            lines.append(f"- {verdict(row.model_ratio <= target)}: decode step read as a model reads it / bare "
                         f"apply-next loop, {active} seqs, size {row.size} = {row.model_ratio:.2f}x "
                         f"(target <= {target}x)")
    return lines


def decode_summary(rows: list[LatencyRow]) -> list[str]:
    steps = decode_steps_of(rows, TARGET_SEQS)
    small, large = steps[min(steps)], steps[max(steps)]
    return [decode_step_line(small), decode_step_line(large), cimport_target_line(steps),
            scaling_target_line(small, large), speedup_target_line(small)] + model_read_lines(rows)


def bandwidth_line(row: BandwidthRow) -> str:
    ratio = throughput_ratio(row, row.core)
    is_target = row.workload in TARGET_STATE_IO_ROWS
    return (f"- {verdict(ratio >= TARGET_STATE_IO) + ': ' if is_target else ''}{row.workload}, "
            f"{row.bytes_per_op / 2**20:,.1f} MiB: core / numpy ({row.baseline}) = {ratio:.2f}"
            f"{f' (target >= {TARGET_STATE_IO})' if is_target else ''}; "
            f"reference / numpy = {throughput_ratio(row, row.reference):.2f}")


def bandwidth_summary(rows: list[BandwidthRow]) -> list[str]:
    """One line per workload, at its largest size."""
    largest: dict[str, BandwidthRow] = {}
    for row in rows:
        if row.workload not in largest or row.bytes_per_op > largest[row.workload].bytes_per_op:
            largest[row.workload] = row
    return [bandwidth_line(row) for row in largest.values()]


# -- header --------------------------------------------------------------------------


def header(mode: str, notes: list[str]) -> list[str]:
    load = ", load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    lines = [
        f"# recurrent_cache benchmark suite ({mode})", "",
        f"- Python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs{load}",
        f"- engines: the compiled columns run on `{compiled.RecurrentCache(0, 1, 1).engine}`, "
        "the reference column on `reference`",
    ]
    return lines + [f"- {note}" for note in notes]


def without_verdicts(lines: list[str]) -> list[str]:
    """A quick run's figures, as figures: three short repeats on small inputs decide no target."""
    return [line.replace("- PASS: ", "- ").replace("- FAIL: ", "- ").replace("- n/a: ", "- ") for line in lines]


def report(mode: str, notes: list[str], latency: list[LatencyRow], bandwidth: list[BandwidthRow]) -> str:
    summary = decode_summary(latency) + bandwidth_summary(bandwidth)
    if mode == "quick":
        summary = ["- quick run: figures only, no PASS / FAIL — three short repeats on small rows and "
                   "states cannot decide a target on a shared machine; `python bench/run.py` does"] + \
            without_verdicts(summary)
    parts = header(mode, notes) + [
        "", "Times: median (min–max) over the repeats. See bench/README.md for what each row measures.",
        "", "## Operations", "", latency_table(latency),
        "", "## Row moves and state I/O vs numpy", "", bandwidth_table(bandwidth), "", "## Summary", "",
    ] + summary
    return "\n".join(parts) + "\n"
