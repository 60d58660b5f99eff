"""Timing helpers shared by every workload.

Two ways to time, both with a warm-up, repeats and garbage collection off:

- ``measure`` for short operations (µs): a calibrated loop of many operations
  per repeat, inputs built before the clock starts;
- ``measure_interleaved`` for long operations compared with a physical
  baseline (row moves, state I/O vs numpy): one call per sample, the cases
  interleaved round by round so that all of them see the same machine load.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol
from collections.abc import Iterable, Iterator


def expect(ok: bool, message: str) -> None:
    """A benchmark sanity check: an implementation that did nothing must not look fast."""
    if not ok:
        raise RuntimeError(f"benchmark sanity check failed: {message}")


@dataclass(frozen=True)
class Timing:
    repeats: int      # timed repeats per measurement (at most)
    min_repeats: int  # ... and at least, whatever the budget says
    target_ns: int    # wanted duration of one timed repeat of ``measure``
    budget_ns: int    # soft cap on the timed repeats of one measurement
    max_iters: int    # cap on the operations in one timed repeat


@dataclass(frozen=True)
class Stats:
    """Time per operation over the repeats, in microseconds."""

    median: float
    low: float
    high: float
    iters: int     # operations per repeat
    repeats: int

    @classmethod
    def of(cls, samples_us: list[float], iters: int = 1) -> "Stats":
        return cls(statistics.median(samples_us), min(samples_us), max(samples_us), iters, len(samples_us))


class Workload(Protocol):
    def loop(self, n: int) -> Callable[[], None]:
        """A callable that performs the next ``n`` operations; its inputs are built here, untimed."""

    def verify(self) -> None:
        """Check, after timing, that the operations really happened."""


def loop_over(run: Callable[[object], None], args: Iterable[object]) -> Callable[[], None]:
    """The loop ``for arg in args: run(arg)`` as a callable, for ``Workload.loop``."""
    args = list(args)

    def loop() -> None:
        for arg in args:
            run(arg)
    return loop


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect now, then keep the garbage collector out of the timed region."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed_ns(fn: Callable[[], object]) -> int:
    """Wall time of one call of ``fn`` (the caller pauses the garbage collector)."""
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def repeats_within(timing: Timing, repeat_ns: float) -> int:
    """How many repeats of ``repeat_ns`` fit the budget, clamped to [min_repeats, repeats]."""
    return max(timing.min_repeats, min(timing.repeats, int(timing.budget_ns // max(repeat_ns, 1.0))))


def measure(workload: Workload, timing: Timing) -> Stats:
    """Warm up and calibrate, then time repeats of a loop sized to ``target_ns``.

    The calibration runs are the warm-up: the loop grows (1, 4, 16, ...
    operations) until it lasts a tenth of the target, which gives the time of
    one operation.  A slow operation gets fewer repeats (never fewer than
    ``min_repeats``) so that one measurement stays near ``budget_ns``.  The
    garbage collector runs before, not during, the measurement.
    """
    with gc_paused():
        n = 1
        while True:
            elapsed = timed_ns(workload.loop(n))
            if elapsed * 10 >= timing.target_ns or n >= timing.max_iters:
                break
            n = min(n * 4, timing.max_iters)
        per_op = max(elapsed / n, 1.0)
        iters = int(min(max(1, timing.target_ns // per_op), timing.max_iters))
        repeats = repeats_within(timing, per_op * iters)
        samples = [timed_ns(workload.loop(iters)) / iters / 1000 for _ in range(repeats)]
    workload.verify()
    return Stats.of(samples, iters)


@dataclass(frozen=True)
class Case:
    """One contender of ``measure_interleaved``: ``reset`` (untimed) prepares each ``run`` (timed)."""

    run: Callable[[], object]
    reset: Callable[[], object] | None = None

    def timed_calls_us(self, calls: int) -> list[float]:
        """``calls`` timed runs, each after an untimed reset (garbage collection paused by the caller)."""
        samples = []
        for _ in range(calls):
            if self.reset is not None:
                self.reset()
            t0 = time.perf_counter_ns()
            self.run()
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return samples


def measure_interleaved(cases: dict[str, Case], timing: Timing) -> dict[str, Stats]:
    """A warm-up round, then rounds in which every case in turn makes its calls.

    The warm-up call sets how many calls a case makes per round (enough to
    last ``target_ns``, at most ``max_iters``) and how many rounds fit the
    budget (between ``min_repeats`` and ``repeats``).  A round's sample of a
    case is the median of its calls; the collector runs only between rounds.
    """
    with gc_paused():
        warm_up_us = {name: case.timed_calls_us(1)[0] for name, case in cases.items()}
    calls = {name: int(min(max(1, timing.target_ns / 1000 // us), timing.max_iters))
             for name, us in warm_up_us.items()}
    round_ns = 1000 * sum(calls[name] * us for name, us in warm_up_us.items())
    rounds = []
    for _ in range(repeats_within(timing, round_ns)):
        with gc_paused():
            rounds.append({name: statistics.median(case.timed_calls_us(calls[name]))
                           for name, case in cases.items()})
    return {name: Stats.of([r[name] for r in rounds], calls[name]) for name in cases}
