# cython: language_level=3
"""The KV cell table's C types: its failure codes, sliding-window kinds, and the table with its journal.

Declarations only (no module behind them): ``_kv_ops`` works on a ``KvTable``
(``_kv_cells.KVCells`` holds one) and the modules under it (``_kv_journal``, ``_kv_mask``) read
and restore one, so the types live here, below them all.
"""

from libc.stdint cimport int32_t, uint8_t, uint64_t

from ._kv_seq_pos cimport SeqPositions

cdef enum:
    KV_OK = 0
    KV_SEQ_RANGE = 1
    KV_POSITION = 2
    KV_DUPLICATE_SEQ = 3
    KV_CELL_INDEX = 4
    KV_CELL_TAKEN = 5
    KV_DIVISOR = 6
    KV_SHIFT_POSITION = 7
    KV_CELL_COUNT = 8
    KV_NO_MEMORY = 9
    KV_NO_SLOT = 10           # find_slot: the ubatch fits nowhere (not an error: None in Python)
    KV_SHIFT_RANGE = 11
    KV_TOO_MANY_CELLS = 12    # load: more cells than the table holds

cdef enum:
    SWA_NONE = 0
    SWA_STANDARD = 1
    SWA_CHUNKED = 2
    SWA_SYMMETRIC = 3

cdef enum:                   # bits of KvTable.mark
    MARK_LISTED = 1           # apply: the cell is in the slot already
    MARK_SAVED = 2            # the journal holds the cell's state from before the operation being undone

cdef struct KvJournal:        # cells' states to put back (_kv_journal): prepare and load_seq undo through it
    bint on                   # apply and seq_rm of one sequence save each cell before they first change it
    int32_t n                 # cells saved
    int32_t cap
    int32_t* cell             # [cap] the saved cell  (one block: cell, pos, shift, n_seq)
    int32_t* pos              # [cap] its position, shift and sequence count then
    int32_t* shift            # [cap]
    int32_t* n_seq            # [cap]
    uint64_t* seq_bits        # [cap * seq_words] its sequence set then
    int32_t head              # the table's head, used and top then
    int32_t used
    int32_t top

cdef struct KvTable:
    int32_t size
    int32_t n_seq_max
    int32_t n_swa
    int32_t swa_type
    int32_t head              # where the next slot search starts
    int32_t used              # cells holding a token
    int32_t top               # one past the last used cell (0 when none)
    bint has_shift
    int32_t seq_words         # uint64 words of one cell's sequence set
    int32_t free_words        # uint64 words of free_bits
    int32_t* pos              # [size] position, -1 = empty
    int32_t* shift            # [size] position change since the keys were last rotated
    int32_t* n_seq            # [size] sequences in the cell
    uint64_t* seq_bits        # [size * seq_words] bit s of cell i: sequence s holds cell i
    uint64_t* free_bits       # [free_words] bit i set: cell i is empty
    uint8_t* mark             # [size] scratch marks, all 0 between calls
    int32_t* scratch          # [size] cells collected by an operation
    int32_t* max_rm           # [n_seq_max] apply: the largest position overwritten per sequence
    SeqPositions seqs         # per sequence, its (position, cell) pairs ordered
    KvJournal journal
