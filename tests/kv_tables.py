"""The KV tests' two tables — the compiled ``_kv_cells.KVCells`` and its readable twin
``kv_reference.KVCells`` — and all a caller can read of one."""

from __future__ import annotations

from typing import Any

from recurrent_cache import kv_reference
from recurrent_cache._kv_cells import KVCells as CompiledCells

ENGINES = {"compiled": CompiledCells, "reference": kv_reference.KVCells}


def snapshot(table: Any) -> tuple[Any, ...]:
    """Every cell, head, used, the last used cell, the shifts and each sequence's position range."""
    return (table.cells(), table.head, table.used, table.used_max_p1, table.has_shift, table.shifts().tolist(),
            [(table.seq_pos_min(s), table.seq_pos_max(s)) for s in range(table.n_seq_max)])
