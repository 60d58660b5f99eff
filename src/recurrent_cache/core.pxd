# cython: language_level=3
"""DEPRECATED: use ``cimport recurrent_cache.capi`` (Cython) or ``recurrent_cache/capi.h`` (C, C++).

This was recurrent_cache's first C-level API: it exposes the engine's internals (the
``Cells`` struct and its journal, ``Split`` and its group arrays), so a decode step
mirrors the core's own loop, nothing is checked (``split_batch`` reads the seq-id
offsets without a NULL check) and it changes whenever the engine does.  The memory
context of ``recurrent_cache.capi`` does the same step in three checked calls with
opaque handles and a versioned table; it is the supported way in.  This file stays
for existing extensions until a release after the new API has been out for one, and
a C compiler building a module that cimports it prints a deprecation message.

recurrent_cache's C-level API, for Cython extensions that drive a cache without the interpreter.

    from recurrent_cache.core cimport CellTable, cells_find_slot, ...

    table = cache.cell_table            # the memory core (a CellTable here): table.core is its C struct
    with nogil:
        code = cells_find_slot(&table.core.cells, ...)

Build with ``include_path=[recurrent_cache.get_include()]`` (Cython also finds
this file on ``sys.path``). Every function is ``noexcept nogil`` and reports
failure as a negative ``RC_ERR_*`` / ``SPLIT_ERR_*`` code; nothing raises.

Contract:
- ``CellTable.core.cells`` is the table (see ``_cells.pxd`` for every field, and
  ``_core_ops.pxd`` for the core around it); read it freely, change it only through
  these functions (a change made here bypasses the core's change counter and
  rollback history: the reason this API is deprecated).
- The state tensors never move: ``cache.r[il]`` / ``cache.s[il]`` are
  allocated once, C-contiguous, and live as long as the cache;
  ``table.core.tensor_data[k]`` / ``table.core.row_bytes[k]`` are their base pointers
  and row sizes (k = il for r, n_layer + il for s).
- One thread owns a cache: the functions may run with the GIL released, in
  parallel on different caches, but two threads must not use one cache at once.
- Positions are validated by ``split_batch`` (as ``init_batch`` does); a
  ubatch handed straight to ``cells_find_slot`` is placed as given.

A decode step, as ``init_batch`` + ``apply`` do it::

    split_batch(&split, &table.core.cells, n_tokens, seq_ids, offsets, pos, NULL, False,
                n_ubatch, False, &detail)              # validate + split
    split_prepare(&split, &table.core.cells, seq_ids)  # prove every ubatch fits
    for each ubatch u:                                 # groups g0 .. g1-1
        cells_find_slot(&table.core.cells, g1 - g0, n_tokens_u, seq_ids,
                        split.group_seq_offset + g0, split.group_n_seq_id + g0,
                        split.group_last_pos + g0)
        cells_copy_plan(&table.core.cells, copy_src, zero)  # [table.core.cells.n] each
        for k in range(table.core.n_tensors):
            rows_apply_plan(table.core.tensor_data[k], table.core.row_bytes[k], table.core.row_bytes[k],
                            table.core.cells.head, table.core.cells.n, copy_src, zero)
        # group s of ubatch u now lives in row table.core.cells.head + s
    split_release(&split)

(The new API's loop: examples/capi/cython/continuous_batching.pyx.)
"""

cdef extern from *:
    """
    #pragma message("recurrent_cache.core is deprecated: cimport recurrent_cache.capi instead (see its docstring)")
    """

from recurrent_cache._split cimport (SPLIT_ERR_CONTINUE, SPLIT_ERR_FIND_SLOT, SPLIT_ERR_GAP,
                                     SPLIT_ERR_NEGATIVE_POS, SPLIT_ERR_NO_MEMORY, SPLIT_ERR_SEQ_RANGE,
                                     SPLIT_OK, Split, SplitDetail, split_batch, split_prepare,
                                     split_release)
from recurrent_cache._core cimport MemoryCore as CellTable
from recurrent_cache._cells cimport (RC_ERR_ARGUMENT, RC_ERR_DUPLICATE_SEQ, RC_ERR_NO_FREE_CELL,
                                     RC_ERR_NO_MEMORY, RC_ERR_PLACEMENT, RC_ERR_POSITION,
                                     RC_ERR_SEQ_RANGE, RC_OK, Cells, cells_clear,
                                     cells_copy_plan, cells_find_slot, cells_seq_add, cells_seq_cp,
                                     cells_seq_div, cells_seq_keep, cells_seq_pos_max,
                                     cells_seq_pos_min, cells_seq_rm, rows_apply_plan)
