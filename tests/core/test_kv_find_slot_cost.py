"""The compiled KV table's slot search costs the cells it hands out, not the table's size: a decode
step's slot found right after ``head`` must not scan the cells below ``head`` as well (docs/hybrid.md,
"Costs").  Cost is measured as a ratio of the same call on a small and a 1M-cell table (both
with the slot right at ``head``), so the test holds under any load that slows both alike."""

from __future__ import annotations

import time

import numpy as np
import pytest

_kv_cells = pytest.importorskip("recurrent_cache._kv_cells", reason="the compiled engine is not built")

N_TOKENS = 64


def _table_with_head_near_the_end(size: int) -> object:
    """A table whose cells below ``size - 2 * N_TOKENS`` are held, with ``head`` just past them."""
    table = _kv_cells.KVCells(size, 1)
    held = size - 2 * N_TOKENS
    table.load(np.arange(held, dtype=np.int32), np.zeros(held, np.int32), np.arange(held + 1, dtype=np.int32))
    table.apply(np.arange(held, held + 1), [held], [0])
    assert table.head == held + 1
    return table


def _fastest_prepare(table: object, repeats: int = 300) -> float:
    tokens = (np.arange(N_TOKENS, dtype=np.int32) + 2**30, np.zeros(N_TOKENS, np.int32),
              np.arange(N_TOKENS + 1, dtype=np.int32))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        slots = table.prepare([tokens])
        best = min(best, time.perf_counter_ns() - start)
    assert slots is not None and slots[0][0] == table.head
    return best


def test_a_slot_found_from_head_does_not_scan_the_cells_below_head():
    small, large = _table_with_head_near_the_end(4 * N_TOKENS), _table_with_head_near_the_end(1 << 20)
    # scanning the 2**20 cells below head (16,384 words of the free bitset) costs ~7 µs, more than
    # the whole call on the small table; without it the two are alike
    assert _fastest_prepare(large) < 1.5 * _fastest_prepare(small)
