"""Workloads that move state rows, each compared with numpy moving the same bytes.

Copy-plan application (a decode step whose copy plan moves rows) against
numpy fancy indexing doing the same row work on the same tensors
(``t[dst] = t[src]; t[zeroed] = 0``); state_write_into / state_read / state_write against numpy copying
the same tensors to and from one buffer.  The caches have Mamba-like rows
(``MAMBA_ROWS``) filled with random numbers, so that no page is a shared zero page.
Every contender is measured by ``measure_interleaved`` in the same rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import numpy as np

import recurrent_cache as compiled

from .measure import Case, Stats, Timing, expect, measure_interleaved
from .workloads import DECODE_PROMPT, reference, decode, decode_batch, make_cache, prompt_batch


@dataclass(frozen=True)
class RowShape:
    n_layer: int
    n_embd_r: int
    n_embd_s: int

    @property
    def cell_bytes(self) -> int:
        """Bytes of state of one cell: every layer's r and s row, f32."""
        return self.n_layer * (self.n_embd_r + self.n_embd_s) * 4


# d_inner = 1024 Mamba: r = (d_conv - 1) * d_inner, s = d_state * d_inner; 608 KiB per cell
MAMBA_ROWS = RowShape(8, 3 * 1024, 16 * 1024)


@dataclass(frozen=True)
class BandwidthRow:
    workload: str
    bytes_per_op: int
    rows_moved: int | None    # per operation, copy plan only: rows copied from another row
    rows_zeroed: int | None   # ... and rows cleared (empty cells in the plan's range)
    core: Stats
    numpy: Stats
    reference: Stats
    baseline: str                # what the numpy column does


def tensors_of(cache: Any) -> list[np.ndarray]:
    return list(cache.r) + list(cache.s)


def fill_random(cache: Any) -> None:
    rng = np.random.default_rng(0)
    for tensor in tensors_of(cache):
        tensor[...] = rng.standard_normal(tensor.shape, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class RowWork:
    """What applying a copy plan writes: rows ``dst`` from rows ``src``, then rows ``zeroed``."""

    dst: np.ndarray
    src: np.ndarray
    zeroed: np.ndarray

    @classmethod
    def of(cls, st: Any) -> "RowWork":
        """The row work of the applied ubatch of MemoryState ``st`` (rows copied onto themselves
        are not work: the core skips them)."""
        copy_src = np.asarray(st.copy_src, dtype=np.int64)
        rows = st.head + np.arange(copy_src.size)
        moved = copy_src != rows
        return cls(rows[moved], copy_src[moved], rows[np.asarray(st.zero, dtype=bool)])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowWork) and all(
            np.array_equal(a, b) for a, b in ((self.dst, other.dst), (self.src, other.src),
                                              (self.zeroed, other.zeroed)))

    @property
    def rows_written(self) -> int:
        return self.dst.size + self.zeroed.size

    def with_numpy(self, tensors: list[np.ndarray]) -> Callable[[], None]:
        """The same work done by numpy fancy indexing, tensor by tensor."""
        def apply() -> None:
            for tensor in tensors:
                tensor[self.dst] = tensor[self.src]   # reads every source before writing
                tensor[self.zeroed] = 0
        return apply


# -- copy-plan application ------------------------------------------------------


class ForkCopyPlan:
    """Forks: sequences m..2m-1 are forked from 0..m-1 by ``seq_cp`` (untimed reset, after a
    ``seq_rm`` of the previous forks), then one decode step gives each fork its own cell,
    filled by the copy plan from the shared parent row: m rows move."""

    name = "copy plan: fork + decode step"

    def __init__(self, impl: ModuleType, shape: RowShape, n_moves: int) -> None:
        self.impl, self.n_moves = impl, n_moves
        self.cache = make_cache(impl, 2 * n_moves, 2 * n_moves, shape.n_layer, shape.n_embd_r, shape.n_embd_s)
        decode(impl, self.cache, prompt_batch(impl, [DECODE_PROMPT] * n_moves))
        fill_random(self.cache)
        self.forks = np.arange(n_moves, 2 * n_moves, dtype=np.int32)
        self.batch = decode_batch(impl, self.forks, DECODE_PROMPT)
        self.state = None

    def reset(self) -> None:
        for fork in self.forks.tolist():
            self.cache.seq_rm(fork, -1, -1)
            self.cache.seq_cp(fork - self.n_moves, fork, -1, -1)

    def run(self) -> None:
        self.state = decode(self.impl, self.cache, self.batch)


class GatherCopyPlan:
    """Gather: sequences 0..2m+1 fill cells 0..2m+1; ``seq_rm`` of the even ones frees every
    other cell (untimed reset, after a ``clear``); one decode step for the m+1 odd ones
    gathers them into consecutive cells: m rows move, sources overlapping destinations, and
    the m cells left empty in the plan's range are zeroed.  (``clear`` writes every row, so
    no page is a shared zero page here either.)"""

    name = "copy plan: gather after seq_rm"

    def __init__(self, impl: ModuleType, shape: RowShape, n_moves: int) -> None:
        self.impl = impl
        self.n_seqs = 2 * (n_moves + 1)
        self.cache = make_cache(impl, self.n_seqs, self.n_seqs, shape.n_layer, shape.n_embd_r, shape.n_embd_s)
        self.batch = decode_batch(impl, np.arange(1, self.n_seqs, 2), DECODE_PROMPT)
        self.state = None

    def reset(self) -> None:
        self.cache.clear()
        decode(self.impl, self.cache, prompt_batch(self.impl, [DECODE_PROMPT] * self.n_seqs))
        for seq in range(0, self.n_seqs, 2):
            self.cache.seq_rm(seq, -1, -1)

    def run(self) -> None:
        self.state = decode(self.impl, self.cache, self.batch)


def planned_work(scenario: Any) -> RowWork:
    """Run the scenario once, untimed: the row work of its copy plan."""
    scenario.reset()
    scenario.run()
    scenario.cache.check()
    return RowWork.of(scenario.state)


def copy_plan_row(scenario_cls: type, shape: RowShape, n_moves: int, timing: Timing) -> BandwidthRow:
    """The compiled core (and the reference) applying the plan vs numpy doing the same row work."""
    core = scenario_cls(compiled, shape, n_moves)
    work = planned_work(core)
    expect(work.dst.size == n_moves, f"{core.name}: the plan moved {work.dst.size} rows, not {n_moves}")
    # numpy gets the core's reset too, so both run right after the same memory traffic
    ref = scenario_cls(reference, shape, n_moves)
    expect(planned_work(ref) == work, f"{core.name}: the reference planned other row work")
    cases = {"core": Case(core.run, core.reset),
             "numpy": Case(work.with_numpy(tensors_of(core.cache)), core.reset),
             "reference": Case(ref.run, ref.reset)}
    stats = measure_interleaved(cases, timing)
    expect(RowWork.of(core.state) == work, f"{core.name}: the timed steps did other row work")
    return BandwidthRow(core.name, work.rows_written * shape.cell_bytes, work.dst.size, work.zeroed.size,
                        stats["core"], stats["numpy"], stats["reference"], "numpy t[dst] = t[src]; t[z] = 0")


def copy_plan_rows(shape: RowShape, move_counts: tuple[int, ...], timing: Timing) -> list[BandwidthRow]:
    return [copy_plan_row(scenario, shape, n, timing)
            for scenario in (ForkCopyPlan, GatherCopyPlan) for n in move_counts]


# -- state I/O ----------------------------------------------------------------------


def full_cache(impl: ModuleType, mib: int) -> Any:
    """A cache of at least ``mib`` MiB of Mamba-like rows, every cell in use, random rows."""
    size = -(-mib * 2**20 // MAMBA_ROWS.cell_bytes)
    cache = make_cache(impl, size, size, MAMBA_ROWS.n_layer, MAMBA_ROWS.n_embd_r, MAMBA_ROWS.n_embd_s)
    decode(impl, cache, decode_batch(impl, np.arange(size), 0))
    fill_random(cache)
    expect(cache.used == size, "the cache is not full")
    return cache


class NumpyStateCopies:
    """The physical baseline: the state tensors' bytes, tensor by tensor, to and from one buffer."""

    def __init__(self, tensors: list[np.ndarray], n_bytes: int) -> None:
        self.tensors = [t.reshape(-1).view(np.uint8) for t in tensors]
        self.n_bytes = n_bytes
        self.buffer = np.ones(n_bytes, dtype=np.uint8)   # every page faulted in before timing
        offsets = np.cumsum([0] + [t.size for t in self.tensors])
        self.sections = [self.buffer[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def out(self) -> None:
        for tensor, section in zip(self.tensors, self.sections):
            np.copyto(section, tensor)

    def into(self) -> None:
        for tensor, section in zip(self.tensors, self.sections):
            np.copyto(tensor, section)

    def new(self) -> None:
        fresh = np.empty(self.n_bytes, dtype=np.uint8)
        start = 0
        for tensor in self.tensors:
            np.copyto(fresh[start:start + tensor.size], tensor)
            start += tensor.size


def state_io_rows(mib: int, timing: Timing) -> list[BandwidthRow]:
    """A whole cache of ``mib`` MiB: state_write_into a preallocated buffer, state_read of the
    blob, state_write to a new bytes object; compiled core, reference and numpy interleaved."""
    core, ref = full_cache(compiled, mib), full_cache(reference, mib)
    blob = core.state_write()
    expect(blob == ref.state_write(), "core and reference write different blobs")
    copies = NumpyStateCopies(tensors_of(core), len(blob))
    target = copies.buffer
    # row: (numpy baseline, core, reference, what the baseline does); numpy runs first in each
    # round, so the state_read that follows undoes its copy of the buffer into the tensors
    contenders = {
        "state_write_into(buffer)": (copies.out, lambda: core.state_write_into(target),
                                     lambda: ref.state_write_into(target), "numpy copy tensors -> buffer"),
        "state_read(blob)": (copies.into, lambda: core.state_read(blob), lambda: ref.state_read(blob),
                             "numpy copy buffer -> tensors"),
        "state_write() -> bytes": (copies.new, core.state_write, ref.state_write,
                                   "numpy copy -> new array"),
    }
    cases = {f"{row} {who}": Case(fn) for row, fns in contenders.items()
             for who, fn in zip(("numpy", "core", "reference"), fns[:3])}
    stats = measure_interleaved(cases, timing)
    expect(core.state_write() == blob and ref.state_write() == blob, "a state_read changed the state")
    core.check()
    return [BandwidthRow(row, len(blob), None, None, stats[f"{row} core"], stats[f"{row} numpy"],
                         stats[f"{row} reference"], baseline)
            for row, (*_, baseline) in contenders.items()]
