# cython: language_level=3
"""The memory core: the one owner of a cache's cells, state rows, rollback history and change counter.

Every change of those goes through a ``core_*`` function below, whichever API the caller
uses: ``_placement`` (Python's ``MemoryState``), ``_capi`` (the C API) and the
``_core.MemoryCore`` methods the facade calls.  Each is ``noexcept nogil`` and reports failures
as the negative codes of ``_cells`` / ``_state_io``; each changing call first files the
step states the model wrote for the last applied ubatch (``core_file_steps``), so that
filing happens at the same point whichever API comes next, and bumps ``generation``
(a ``MemoryState`` or C batch prepared on another generation is stale).
"""

from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, uint8_t, uint64_t

from ._cells cimport Cells
from ._history cimport History
from ._moves cimport RowMover
from ._split cimport Split
from ._state_io cimport BlobDefect, BlobSource

cdef struct Core
# the owner's way to grow the step scratch (it allocates through the storage: Python, with the GIL)
ctypedef int (*GrowSteps)(Core* core, Py_ssize_t rows) noexcept nogil

cdef struct Core:
    PyObject* owner              # the object this struct lives in (a _core.MemoryCore), for grow_steps
    GrowSteps grow_steps         # makes the step scratch hold rows rows: RC_OK, RC_ERR_NO_MEMORY or RC_ERR_BROKEN
    Cells cells
    History history
    Py_ssize_t n_tensors         # r of each layer with state (layer order), then their s
    int32_t n_layer              # the model's layers (the blob's n_layer), with state or not
    Py_ssize_t* layer_tensor     # [2 * n_layer] r of layer il: [il], s: [n_layer + il] -> k, or -1 (no state)
    char** tensor_data           # [n_tensors] base pointers (the arrays never move; a logged core's: the staging copies)
    char** hist_data             # [n_tensors] the history of tensor k: cell c's slots at c * n_rollback * row_bytes[k]
    Py_ssize_t* row_bytes        # [n_tensors]
    int32_t* type_ids            # [n_tensors] ggml types, for state blobs
    int32_t* plan_copy_src       # [size] the copy plan of the ubatch being applied
    uint8_t* plan_zero           # [size]
    bint self_check              # debug builds: check every invariant after each placement
    uint64_t generation          # bumped by every change of cells, rows or history
    # step states (docs/rollback.md): the model writes them into this scratch after an apply; the next
    # changing call files them into the history of the cells the ubatch was placed in
    char** step_data             # [n_tensors] step_capacity rows each
    Py_ssize_t step_capacity
    int32_t pending_head         # the ubatch whose step states are still to be filed,
    int32_t pending_n_seqs       # 0: none pending
    int32_t pending_m            # step states per group
    int32_t* pending_last_pos    # [size] each group's last position
    # every move of rows (cells, history, step scratch) goes through the mover, which copies at once (host
    # memory) or records the move (a storage the core cannot address: the MemoryCore hands the log over
    # to the storage at the end of each call); history.mover points at it
    RowMover mover
    # a storage failed while carrying out a call's moves: the cells and the rows may disagree, so
    # every call refuses (RC_ERR_BROKEN; Python: BrokenCacheError) until a clear() succeeds
    bint broken

# a ubatch: find_slot, copy plan, row and history moves, start states filed, step states
# expected (m per group: core_steps); RC_OK or an RC_ERR_* code (the cells may then have moved)
cdef int core_apply_ubatch(Core* core, const Split* split, int32_t u, const int32_t* seq_ids) noexcept nogil
cdef int32_t core_steps(const Core* core, int32_t n_seq_tokens) noexcept nogil
cdef char* core_step_row(const Core* core, Py_ssize_t k, int32_t group, int32_t j) noexcept nogil
cdef void core_file_steps(Core* core) noexcept nogil

# sequence operations (p1 < 0 means +inf); seq_rm rolls back per docs/rollback.md when it can
cdef bint core_seq_rm(Core* core, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
cdef void core_seq_cp(Core* core, int32_t seq_src, int32_t seq_dst) noexcept nogil
cdef int core_seq_keep(Core* core, int32_t seq) noexcept nogil
cdef int core_seq_add(Core* core, int32_t seq, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
cdef int core_seq_div(Core* core, int32_t seq, int32_t p0, int32_t p1, int32_t d) noexcept nogil
cdef void core_clear(Core* core) noexcept nogil
cdef int32_t core_rollback_min(Core* core, int32_t seq) noexcept nogil

# seq (in no cell) gets a cell of its own at pos holding rows[k] (row_bytes[k] each), history
# cleared; every condition is checked before anything changes.  The cell, or an RC_ERR_* code.
cdef int32_t core_restore(Core* core, int32_t seq, int32_t pos, const char* const* rows) noexcept nogil

# state_read of a blob (seq_id -1: the whole cache): checked whole first (a BLOB_ERR_* code
# with *defect changes nothing), then restored with the history of what it replaced cleared
cdef int core_state_read(Core* core, int32_t seq_id, const unsigned char* data, Py_ssize_t length,
                         BlobDefect* defect) noexcept nogil

# whether bytes [p, p + n) overlap a state tensor (a restore or write would read its own output)
cdef bint shares_rows(const Core* core, const void* p, size_t n) noexcept nogil
# what a blob is composed from (``_state_io.blob_compose``): the core's cells and rows
cdef BlobSource blob_source(const Core* core) noexcept nogil

