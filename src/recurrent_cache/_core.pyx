# cython: language_level=3
"""The memory core's Python-facing handle: ``MemoryCore`` owns a cache's ``Core`` (``_core_ops``: the only
code that changes its cells, rows and rollback history), allocates its tables, addresses the storage's
tensors (host views, or the move log a storage without host memory carries out at the end of every call),
and words the core's failures as the Python API's exceptions.  The facade (``cache``, ``_placement``) calls
its methods; the C API calls the ``core_*`` functions on the same ``Core``.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, uint8_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

import numpy as np

from ._cells cimport (Cells, cells_check, cells_check_message, cells_init, cells_release, cells_seq_pos_max,
                      cells_seq_pos_min)
from ._codes cimport RC_ERR_BROKEN, RC_ERR_NO_MEMORY, RC_OK
from ._core_ops cimport (core_apply_ubatch, core_clear, core_file_steps, core_restore, core_rollback_min,
                         core_seq_add, core_seq_cp, core_seq_div, core_seq_keep, core_seq_rm, core_state_read,
                         core_steps, shares_rows, blob_source)
from ._moves cimport SPACE_CELLS, SPACE_HIST, SPACE_STEPS, log_carry_out, log_reset, mover_init, mover_release
from ._split cimport Split
from ._state_io cimport (BLOB_ERR_TRUNCATED, BlobDefect, BlobPieces, BlobSource, blob_compose, blob_copy, blob_error,
                         blob_piece, blob_release, blob_size)

from . import errors
from .formats import messages
from .formats.streams import write_all
from .errors import CoreError
from .storage import has_host_access

cdef extern from "rc_debug.h":
    const bint RC_SELF_CHECK

cdef extern from "rc_hugepages.h":
    void rc_advise_hugepages(void* buffer, size_t n) noexcept nogil

cdef enum:
    DLPACK_CPU = 1            # DLPack's device types whose memory the host addresses: kDLCPU,
    DLPACK_CUDA_HOST = 3      # kDLCUDAHost (pinned)


# Where a row of no bytes points (a tensor 0 values wide: LFM2's s rows): an address no byte is read from
# or written to, so that a 0-byte memcpy / memset has a valid pointer and a bounds-checked build no index.
cdef char NO_ROW_BYTES[1]


cdef int grow_owner_steps(Core* core, Py_ssize_t rows) noexcept with gil:
    """``Core.grow_steps`` of a MemoryCore's core: its step scratch made room for ``rows`` rows."""
    try:
        (<MemoryCore>core.owner).reserve_steps(rows)
    except Exception:   # MemoryError, or a storage that could not allocate (a device out of memory)
        # a failed flush of the filed step states broke the core; a failed allocation changed nothing
        return RC_ERR_BROKEN if core.broken else RC_ERR_NO_MEMORY
    return RC_OK


# -- the Python-facing handle ---------------------------------------------------------------

def host_extent(tensor):
    """``(begin, end)``: the addresses of a storage tensor's bytes when they lie in host memory (a
    numpy array; a CPU tensor that gives its ``data_ptr``, as torch's do), else None: device memory
    cannot alias a host buffer.  Storage tensors are C-contiguous, so ``nbytes`` from the start."""
    if isinstance(tensor, np.ndarray):
        begin = tensor.__array_interface__["data"][0]
        return begin, begin + tensor.nbytes
    if (hasattr(tensor, "__dlpack_device__") and hasattr(tensor, "data_ptr")
            and tensor.__dlpack_device__()[0] in (DLPACK_CPU, DLPACK_CUDA_HOST)):
        begin = tensor.data_ptr()
        return begin, begin + tensor.nbytes
    return None


cdef class MemoryCore:
    """A cache's memory core: the cells, the state tensors' rows, the rollback history and the
    change counter (compiled engine object; ``_engines.Core`` is its interface).

    The tensors come from a storage (``recurrent_cache.storage``): one per kind (r, s) of
    shape ``[n_state, size, n_embd]``.  A storage with host views is moved in C; any other
    gets the recorded moves at the end of every call (``flush``).  The facade validates
    arguments; this class trusts them and only guards what could corrupt memory.
    """

    def __cinit__(self, int32_t size, object storage, tuple kinds, tuple dtypes, int32_t n_rollback, type_ids,
                  int32_t n_layer, tuple layers):
        cdef Py_ssize_t k, n, n_state = len(layers), n_tensors = 2 * n_state
        cdef int32_t[:, ::1] tag_view
        if (size < 1 or n_rollback < 0 or len(type_ids) != n_tensors or len(kinds) != 2 or len(dtypes) != 2
                or list(layers) != sorted(set(layers)) or any(not 0 <= il < n_layer for il in layers)
                or any(tuple(t.shape)[:2] != (n_state, size) for t in kinds)):
            raise ValueError(f"size {size}, n_rollback {n_rollback}, {len(type_ids)} type ids "
                             f"for the tensors of layers {layers} of {n_layer}")
        memset(&self.core, 0, sizeof(Core))
        self.core.owner = <PyObject*>self
        self.core.grow_steps = grow_owner_steps
        if cells_init(&self.core.cells, size) != RC_OK:
            raise MemoryError(f"cannot allocate a cell table of {size} cells")
        self.storage, self.kinds, self.dtypes, self.layers = storage, kinds, dtypes, layers
        self.core.n_tensors = n_tensors
        self.core.n_layer = n_layer
        self.core.layer_tensor = <Py_ssize_t*>malloc(max(1, 2 * n_layer) * sizeof(Py_ssize_t))
        if self.core.layer_tensor == NULL:
            raise MemoryError("cannot allocate the layer table")
        for k in range(2 * n_layer):
            self.core.layer_tensor[k] = -1
        for k in range(n_state):
            self.core.layer_tensor[<Py_ssize_t>layers[k]] = k
            self.core.layer_tensor[n_layer + <Py_ssize_t>layers[k]] = n_state + k
        n = max(1, n_tensors)
        self.core.tensor_data = <char**>calloc(n, sizeof(char*))
        self.core.row_bytes = <Py_ssize_t*>malloc(n * sizeof(Py_ssize_t))
        self.core.type_ids = <int32_t*>malloc(n * sizeof(int32_t))
        self.core.step_data = <char**>calloc(n, sizeof(char*))
        self.core.hist_data = <char**>calloc(n, sizeof(char*))
        # allocated once: a plan covers at most every cell, a ubatch at most size groups
        self.core.plan_copy_src = <int32_t*>malloc(size * sizeof(int32_t))
        self.core.plan_zero = <uint8_t*>malloc(size)
        self.core.pending_last_pos = <int32_t*>malloc(size * sizeof(int32_t))
        if (self.core.tensor_data == NULL or self.core.row_bytes == NULL or self.core.type_ids == NULL
                or self.core.step_data == NULL or self.core.hist_data == NULL
                or self.core.plan_copy_src == NULL or self.core.plan_zero == NULL
                or self.core.pending_last_pos == NULL):
            raise MemoryError("cannot allocate the tensor table")
        for k in range(n_tensors):
            self.core.row_bytes[k] = dtypes[k // n_state].itemsize * kinds[k // n_state].shape[2]
            self.core.type_ids[k] = type_ids[k]
        self.host_views = {}
        self.core.self_check = RC_SELF_CHECK
        self.core.history.n_rollback = n_rollback
        # history[kind][k, c * n_rollback + q % n_rollback]: the state after position q of cell c
        self.history_kinds = tuple(storage.allocate((n_state, size * n_rollback, t.shape[2]), dtype)
                                   for t, dtype in zip(kinds, dtypes)) if n_rollback and n_state else ()
        self.tags = np.zeros((size, max(1, n_rollback)), dtype=np.int32)
        tag_view = self.tags
        self.core.history.tags = &tag_view[0, 0]
        self.tags = self.tags[:, :n_rollback]
        if not mover_init(&self.core.mover, not has_host_access(storage), n_tensors, self.core.row_bytes, size,
                          <Py_ssize_t>size * n_rollback):
            raise MemoryError("cannot allocate the move log")
        self.core.mover.rows[SPACE_CELLS] = self.core.tensor_data
        self.core.mover.rows[SPACE_HIST] = self.core.hist_data
        self.core.mover.rows[SPACE_STEPS] = self.core.step_data
        self.core.history.mover = &self.core.mover
        if not self.core.mover.logged:
            self.address("cells", self.host_of(kinds), self.core.tensor_data)
            self.address("history", self.host_of(self.history_kinds), self.core.hist_data)
        self.stage = []
        self.step_kinds = ()
        self.reserve_steps(0)

    def __dealloc__(self):
        cells_release(&self.core.cells)
        mover_release(&self.core.mover)
        free(self.core.hist_data)
        free(self.core.tensor_data)
        free(self.core.layer_tensor)
        free(self.core.row_bytes)
        free(self.core.type_ids)
        free(self.core.step_data)
        free(self.core.plan_copy_src)
        free(self.core.plan_zero)
        free(self.core.pending_last_pos)

    cdef list host_of(self, tuple tensors):
        """The storage's host views of ``tensors`` (r, s; checked: the C code writes through them)."""
        views = [self.storage.host_view(t) for t in tensors]
        for view, tensor, dtype in zip(views, tensors, self.dtypes):
            if (not isinstance(view, np.ndarray) or not view.flags.c_contiguous
                    or view.shape != tuple(tensor.shape) or view.dtype.itemsize != dtype.itemsize):
                raise ValueError(f"{self.storage!r} gave no C-contiguous host view of its own tensor")
        return views

    cdef address(self, str space, list host, char** pointers):
        """Set pointers[kind * n_state + k] to layer k's rows of each kind's host array (kept alive)."""
        cdef Py_ssize_t kind, k, n_state = len(self.layers)
        cdef char[:, ::1] view
        self.host_views[space] = host
        for kind in range(len(host)):
            for k in range(n_state):
                if not host[kind].shape[2]:
                    pointers[kind * n_state + k] = NO_ROW_BYTES
                elif host[kind].shape[1]:
                    view = host[kind][k].view(np.uint8).reshape(host[kind].shape[1], -1)
                    pointers[kind * n_state + k] = &view[0, 0]

    cdef int reserve_steps(self, Py_ssize_t rows) except -1:
        """Room for ``rows`` step states per tensor.  Grown as new tensors: a view the model
        still holds of the old scratch keeps its memory (its writes are then lost, never stray)."""
        if rows <= self.core.step_capacity and self.step_kinds:
            return 0
        rows = max(rows, 2 * self.core.step_capacity, 1)
        if self.core.mover.logged:
            self.flush()   # pending moves may read the old scratch
        kinds = tuple(self.storage.allocate((len(self.layers), rows, t.shape[2]), dtype)
                      for t, dtype in zip(self.kinds, self.dtypes))
        if not self.core.mover.logged:
            self.address("steps", self.host_of(kinds), self.core.step_data)
        self.step_kinds = kinds
        self.core.step_capacity = rows
        return 0

    cdef int usable(self, str what) except -1:
        """Raise ``BrokenCacheError`` (the storage's failure chained) if a storage failure broke the core."""
        if self.core.broken:
            raise errors.BrokenCacheError(f"{what}: the cache is broken: {self.storage!r} failed while "
                                          f"moving its rows ({type(self.broken_by).__name__}: "
                                          f"{self.broken_by}); clear() it to use it again") from self.broken_by
        return 0

    cdef int break_on(self, object failure) except -1:
        """Mark the core broken by ``failure``, a storage call that failed after the cells changed."""
        self.core.broken = True
        self.broken_by = failure
        return 0

    cdef int flush(self) except -1:
        """Hand the recorded moves to the storage.  The cells have changed already: a storage that
        fails breaks the core (``BrokenCacheError``, the storage's exception chained)."""
        try:
            self.flush_log()
        except BaseException as failure:   # an interrupt mid-flush leaves rows as partly written
            self.break_on(failure)
            if isinstance(failure, Exception):
                self.usable("flush")
            raise
        return 0

    cdef int flush_log(self) except -1:
        """The recorded moves carried out by the storage: all rows taken first, then written."""
        try:
            if self.core.n_tensors:   # else no layer keeps state (an empty layer filter): no rows to move
                log_carry_out(&self.core.mover.log, self.storage,
                              (self.kinds, self.history_kinds, self.step_kinds, tuple(self.stage)), self.dtypes)
        finally:
            log_reset(&self.core.mover.log)
        return 0

    cdef int finish(self) except -1:
        """The end of every entry point that changes cells, rows or history (apply included): the
        moves it recorded are carried out now, on a logged storage (nothing is pending otherwise).
        A storage failing here breaks the core (``flush``)."""
        if self.core.mover.logged:
            self.flush()
        return 0

    cdef int apply_ubatch(self, const Split* split, int32_t u, const int32_t* seq_ids) except 1:
        """Ubatch ``u`` of ``split`` placed (``core_apply_ubatch``), its moves carried out: an engine
        code.  A storage that failed while the step scratch grew or while the moves were carried out
        broke the core: ``BrokenCacheError``."""
        cdef int code
        self.usable("apply")
        with nogil:
            code = core_apply_ubatch(&self.core, split, u, seq_ids)
        self.finish()   # a failed apply may have moved some rows too
        self.usable("apply")
        return code

    @property
    def host_rows(self):
        """Whether the C code moves the rows itself (a storage with host views: the C API works)."""
        return not self.core.mover.logged

    cdef stage_cells(self, int32_t seq_id):
        """A logged core's staging copies of the rows ``state_write(seq_id)`` reads, made equal to
        the cells' rows: one gather and one transfer per kind, of those rows only."""
        cdef Py_ssize_t kind
        cdef int32_t cell
        cdef list rows = []
        if not (self.core.mover.logged and self.core.n_tensors):
            return
        if seq_id >= 0:
            if self.core.cells.tail[seq_id] >= 0:
                rows.append(self.core.cells.tail[seq_id])
        else:
            for cell in range(self.core.cells.size):
                if self.core.cells.n_seq[cell] > 0:
                    rows.append(cell)
        if not rows:
            return
        stage = self.staged()
        selected = np.array(rows, dtype=np.int64)
        for kind in range(2):
            stage[kind][:, selected] = self.storage.to_host(self.storage.take(self.kinds[kind], selected))

    cdef list staged(self):
        """The host copies of the cells' tensors a logged core reads blobs into and writes them from."""
        cdef Py_ssize_t kind
        if self.core.mover.logged and not self.stage and self.core.n_tensors:
            self.stage = [np.zeros(tuple(t.shape), dtype=dtype.numpy) for t, dtype in zip(self.kinds, self.dtypes)]
            self.address("stage", self.stage, self.core.tensor_data)
        return self.stage

    # -- what the facade reads -----------------------------------------------------------

    @property
    def size(self):
        return self.core.cells.size

    @property
    def head(self):
        return self.core.cells.head

    @property
    def used(self):
        return self.core.cells.used

    @property
    def n(self):
        return self.core.cells.n

    @property
    def n_rollback(self):
        return self.core.history.n_rollback

    @property
    def generation(self):
        """Bumped by every change of the cells, rows or history, made through any API."""
        return self.core.generation

    @property
    def self_check(self):
        return self.core.self_check

    def cell(self, int32_t i):
        """(pos, src, tail, sorted seq ids) of cell i."""
        cdef list members = []
        cdef int32_t seq
        self.usable("cell")
        if not 0 <= i < self.core.cells.size:
            raise errors.engine_error(errors.CELL_INDEX, what="cell", index=i, size=self.core.cells.size)
        seq = self.core.cells.first[i]
        while seq >= 0:
            members.append(seq)
            seq = self.core.cells.next[seq]
        members.sort()
        return self.core.cells.pos[i], self.core.cells.src[i], self.core.cells.tail[i], tuple(members)

    def seq_cell(self, int32_t seq):
        """The cell holding ``seq`` (in range), or -1."""
        self.usable("seq_cell")
        return self.core.cells.tail[seq]

    def seq_pos_min(self, int32_t seq):
        self.usable("seq_pos_min")
        return cells_seq_pos_min(&self.core.cells, seq)

    def seq_pos_max(self, int32_t seq):
        self.usable("seq_pos_max")
        return cells_seq_pos_max(&self.core.cells, seq)

    def check(self):
        """None, or a sentence naming the first broken invariant of docs/concepts.md §1 (the facade raises it)."""
        cdef Cells* c = &self.core.cells
        cdef int32_t at
        cdef int broken
        self.usable("check")
        broken = cells_check(c, &at)
        if not broken:
            return None
        return cells_check_message(c, broken, at)

    def history(self):
        """Copies of the rollback history: ``(tags, [history of tensor k, ...])`` (docs/rollback.md);
        ``tags[c, q % n_rollback] == q + 1`` marks the state after ``q`` as held in cell c."""
        cdef int32_t size = self.core.cells.size, n = self.core.history.n_rollback
        self.usable("history")
        core_file_steps(&self.core)
        self.finish()
        history = [self.storage.to_host(t) for t in self.history_kinds]
        return self.tags.copy(), [array[k].reshape(size, n, array.shape[2]) for array in history
                                  for k in range(array.shape[0])]

    def step_rows(self, int32_t k, int32_t n_seqs, int32_t m):
        """[n_seqs, m, n_embd] view of the scratch the model writes tensor k's step states into
        (a tensor of the cache's storage)."""
        cdef Py_ssize_t n_state = len(self.layers)
        self.usable("step_rows")
        tensor = self.step_kinds[k // n_state][k % n_state]
        return tensor[:n_seqs * m].reshape(n_seqs, m, tensor.shape[1])

    def steps(self, int32_t n_seq_tokens):
        """m: step states per group the model writes for a ubatch of n_seq_tokens tokens per group."""
        self.usable("steps")
        return core_steps(&self.core, n_seq_tokens)

    # -- changes -------------------------------------------------------------------------

    # each call below ends in finish(): a logged storage carries out its recorded moves before it returns

    def clear(self):
        """Empty every cell and zero every row; also the one call a broken core takes: once the storage
        has zeroed every row, nothing of the broken state is left, so the core is usable again."""
        core_clear(&self.core)
        self.finish()
        self.core.broken = False
        self.broken_by = None

    def seq_rm(self, int32_t seq, int32_t p0, int32_t p1):
        self.usable("seq_rm")
        removed = core_seq_rm(&self.core, seq, p0, p1)
        self.finish()
        return removed

    def seq_cp(self, int32_t seq_src, int32_t seq_dst):
        self.usable("seq_cp")
        core_seq_cp(&self.core, seq_src, seq_dst)
        self.finish()

    def seq_keep(self, int32_t seq):
        self.usable("seq_keep")
        code = core_seq_keep(&self.core, seq)
        self.finish()
        return code

    def seq_add(self, int32_t seq, int32_t p0, int32_t p1, int32_t shift):
        self.usable("seq_add")
        code = core_seq_add(&self.core, seq, p0, p1, shift)
        self.finish()
        return code

    def seq_div(self, int32_t seq, int32_t p0, int32_t p1, int32_t d):
        self.usable("seq_div")
        code = core_seq_div(&self.core, seq, p0, p1, d)
        self.finish()
        return code

    def rollback_min(self, int32_t seq):
        self.usable("rollback_min")
        q = core_rollback_min(&self.core, seq)
        self.finish()
        return q

    def restore(self, int32_t seq, int32_t pos, list rows):
        """``seq`` (in no cell) gets a cell at ``pos`` holding ``rows`` (one row per tensor: r of each
        layer with state, then s; numpy arrays of its row size, or tensors of the cache's storage),
        history cleared; the cell, or a negative code (nothing changed)."""
        cdef Py_ssize_t k, n_state = len(self.layers)
        cdef const unsigned char[::1] row
        cdef const char** pointers
        cdef list views = []
        cdef int32_t cell
        self.usable("restore")
        if len(rows) != self.core.n_tensors:
            raise ValueError(f"{len(rows)} rows for {self.core.n_tensors} tensors")
        if self.core.mover.logged:
            # rows of the storage's own type are written by it (on its device: no host transfer)
            kinds = [self.as_storage_rows(rows[kind * n_state:(kind + 1) * n_state], kind) if n_state else None
                     for kind in range(2)]
            cell = core_restore(&self.core, seq, pos, NULL)
            self.finish()
            if cell >= 0 and n_state:
                try:
                    for kind in range(2):
                        self.storage.put(self.kinds[kind], np.array([cell], dtype=np.int64), kinds[kind])
                except Exception as failure:   # seq already holds the cell: its rows would be another's
                    self.break_on(failure)
                    self.usable("restore")
            return cell
        for k in range(self.core.n_tensors):
            row = self.host_row(rows[k], k)
            views.append(row)
        pointers = <const char**>malloc(max(1, self.core.n_tensors) * sizeof(char*))
        if pointers == NULL:
            raise MemoryError("cannot allocate the row table")
        try:
            for k in range(self.core.n_tensors):
                row = views[k]
                if not row.shape[0]:
                    pointers[k] = NO_ROW_BYTES
                    continue
                if shares_rows(&self.core, &row[0], row.shape[0]):   # a row of this cache: copy it first
                    row = bytes(row)
                    views[k] = row
                pointers[k] = <const char*>&row[0]
            cell = core_restore(&self.core, seq, pos, pointers)
            self.finish()
            return cell
        finally:
            free(pointers)

    cdef const unsigned char[::1] host_row(self, object given, Py_ssize_t k):
        """Row ``given`` (a numpy array) of tensor k as bytes."""
        cdef const unsigned char[::1] row
        row = np.ascontiguousarray(given).reshape(-1).view(np.uint8)
        if row.shape[0] != self.core.row_bytes[k]:
            raise ValueError(f"row {k} has {row.shape[0]} bytes, the tensor's rows {self.core.row_bytes[k]}")
        return row

    cdef object as_storage_rows(self, list rows, Py_ssize_t kind):
        """[n_state, 1, n_embd] tensor of the storage holding one row per layer of ``kind``."""
        cdef Py_ssize_t n_state = len(self.layers)
        width = self.kinds[kind].shape[2]
        if any(tuple(row.shape) != (width,) for row in rows):
            raise ValueError(f"rows of kind {kind} must have shape ({width},)")
        return self.storage.stack(rows, self.dtypes[kind])[:, None]

    # -- state serialisation (docs/concepts.md §5) ---------------------------------------------------

    def state_size(self, int32_t seq_id):
        """Bytes of ``state_write(seq_id)``."""
        self.usable("state_size")
        return blob_size(&self.core.cells, seq_id, self.core.n_tensors, self.core.row_bytes)

    cdef Py_ssize_t write(self, unsigned char* out, Py_ssize_t capacity, int32_t seq_id) except -1:
        """Write the blob to out, which has room for capacity bytes; returns the blob's length."""
        cdef BlobSource src
        cdef BlobPieces pieces
        cdef Py_ssize_t n
        self.stage_cells(seq_id)
        # Composed with the GIL held and no Python code in between; the copies then need only the
        # pieces, so another thread cannot make the rows disagree with the meta or overflow out.
        src = blob_source(&self.core)
        if blob_compose(&pieces, &src, seq_id) != RC_OK:
            raise MemoryError("cannot allocate the blob's headers")
        try:
            if pieces.size > capacity:
                raise messages.target_too_small(capacity, pieces.size)
            with nogil:
                n = blob_copy(&pieces, out)
        finally:
            blob_release(&pieces)
        return n

    def aliases(self, const unsigned char[::1] buffer):
        """Whether ``buffer`` shares a byte with any tensor of this core: the cells' rows (host views
        or, on the index path, the storage's own tensors when they are in host memory), the
        rollback history, the step scratch and the staging copies."""
        cdef uintptr_t begin, end
        if buffer.shape[0] == 0:
            return False
        if shares_rows(&self.core, &buffer[0], buffer.shape[0]):
            return True
        begin = <uintptr_t>&buffer[0]
        end = begin + <uintptr_t>buffer.shape[0]
        for tensor in self.kinds + self.history_kinds + self.step_kinds + tuple(self.stage):
            extent = host_extent(tensor)
            if extent is not None and begin < extent[1] and extent[0] < end:
                return True
        return False

    def state_write_into(self, unsigned char[::1] out, int32_t seq_id):
        """Write the blob to the start of out; returns its length.  A target sharing memory with
        the cache (``aliases``) is refused before a byte is written, whichever path moves the rows."""
        self.usable("state_write_into")
        if self.aliases(out):
            raise messages.target_aliases_cache()
        return self.write(&out[0] if out.shape[0] else NULL, out.shape[0], seq_id)

    def state_write_bytes(self, int32_t seq_id):
        """The blob as a new bytes object, written in place (no intermediate copy)."""
        cdef Py_ssize_t n
        cdef bytes blob
        self.usable("state_write")
        n = self.state_size(seq_id)
        blob = PyBytes_FromStringAndSize(NULL, n)
        rc_advise_hugepages(PyBytes_AS_STRING(blob), n)
        if self.write(<unsigned char*>PyBytes_AS_STRING(blob), n, seq_id) != n:
            # only another thread changing the cache meanwhile can shrink the blob
            raise CoreError("state_write: the cache changed while it was written")
        return blob

    def state_write_file(self, object file, int32_t seq_id):
        """Write the blob to a binary file, piece by piece: the rows straight from the tensors."""
        cdef BlobSource src
        cdef BlobPieces pieces
        cdef const unsigned char* p
        cdef Py_ssize_t i, n, total = 0
        self.usable("state_write_file")
        self.stage_cells(seq_id)
        src = blob_source(&self.core)
        if blob_compose(&pieces, &src, seq_id) != RC_OK:
            raise MemoryError("cannot allocate the blob's headers")
        try:
            # the pieces are fixed now: file.write may run other threads, not move these rows
            for i in range(pieces.n_pieces):
                n = blob_piece(&pieces, i, &p)
                write_all(file, <unsigned char[:n]><unsigned char*>p if n else b"")
                total += n
        finally:
            blob_release(&pieces)
        return total

    def state_read(self, const unsigned char[::1] data, int32_t seq_id):
        """Check the whole blob, then restore it (docs/concepts.md §5); returns the bytes read."""
        cdef Py_ssize_t length = data.shape[0]
        cdef const unsigned char* p = &data[0] if length else NULL
        cdef BlobDefect defect
        cdef int code
        self.usable("state_read")
        if shares_rows(&self.core, p, length):
            # the blob lies in the cache's own rows, which the restore overwrites: read a
            # copy, so the blob is read as it was when the call began
            return self.state_read(bytes(data), seq_id)
        self.staged()
        with nogil:
            code = core_state_read(&self.core, seq_id, p, length, &defect)
        self.finish()
        if code != RC_OK:
            if code <= BLOB_ERR_TRUNCATED:   # the blob codes are -30 and below
                raise self.blob_error(code, &defect, length)
            raise CoreError(f"state_read: find_slot failed (code {code}) for seq {seq_id}")
        return length

    cdef object blob_error(self, int code, const BlobDefect* d, Py_ssize_t length):
        """The StateError for a check_blob code of this cache (``_state_io.blob_error``)."""
        return blob_error(code, d, length, self.layers, self.core.n_layer, self.core.type_ids, self.core.row_bytes,
                          self.core.cells.size)
