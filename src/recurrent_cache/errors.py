"""The exceptions raised by recurrent_cache, and the one table of engine codes.

Every error the package raises derives from :class:`RecurrentCacheError`, and
each subclass also derives from the built-in a caller would reach for, so
``except ValueError`` keeps working for code written against plain Python
containers.  A call that raises has changed nothing — except one whose storage
failed half-way through its row moves: it raises ``BrokenCacheError`` and so
does every later call until ``clear()`` succeeds.
"""

from typing import Any

__all__ = [
    "RecurrentCacheError",
    "ConfigError",
    "BatchError",
    "SeqIdError",
    "PositionError",
    "StateError",
    "ArgumentError",
    "CoreError",
    "BrokenCacheError",
    "UsageError",
    "OutOfRangeError",
    "NoFreeCellError",
    "ModelError",
    "GGUFError",
    "SafetensorsError",
    "OutputError",
    "engine_error",
]


class RecurrentCacheError(Exception):
    """Base class of every exception raised by recurrent_cache."""


class ConfigError(RecurrentCacheError, ValueError):
    """A constructor argument makes no sense (width < 1, unknown dtype, ...)."""


class BatchError(RecurrentCacheError, ValueError):
    """A batch is malformed: empty, mismatched lengths, a token with no seq id, ..."""


class SeqIdError(BatchError, IndexError):
    """A sequence id lies outside ``[0, size)``.

    It is both an ``IndexError`` (an id is an index into the cell table) and a
    ``ValueError`` (it is bad input like any other batch defect).
    """


class PositionError(BatchError):
    """Positions would make a recurrent state skip or repeat tokens."""


class ArgumentError(RecurrentCacheError, ValueError):
    """A method argument is out of its domain (``seq_div`` by ``d <= 0``, ...)."""


class OutOfRangeError(RecurrentCacheError, IndexError):
    """A cell, layer or ubatch index outside its range (a seq id out of range is a SeqIdError)."""


class StateError(RecurrentCacheError, ValueError):
    """A state blob is truncated, has trailing bytes or does not fit this cache."""


class CoreError(RecurrentCacheError, RuntimeError):
    """An invariant of the cache is broken: a bug of recurrent_cache, never the caller's input."""


class BrokenCacheError(CoreError):
    """A storage failed while carrying out a call's row moves (a device out of memory), after the
    cell table had changed: the cells and the rows may disagree, so every later call raises this
    until ``clear()`` succeeds.  ``__cause__`` is the storage's exception."""


class UsageError(RecurrentCacheError, RuntimeError):
    """A call out of order: a ``MemoryState`` applied twice, stale, or read before ``apply()``;
    one cache used by two threads at once."""


class NoFreeCellError(RecurrentCacheError, RuntimeError):
    """``PrefixCache.restore`` found a snapshot but every cell of the cache is in use."""


class ModelError(RecurrentCacheError, ValueError):
    """Weights, a model file or an input that do not make a valid Mamba model run."""


class GGUFError(RecurrentCacheError, ValueError):
    """A file is not a well-formed GGUF file (the message says where and why)."""


class SafetensorsError(RecurrentCacheError, ValueError):
    """A file is not a well-formed safetensors file (the message says what and where)."""


class OutputError(RecurrentCacheError, RuntimeError):
    """A command could not write its output (a closed pipe, a full disk); ``__cause__`` is the
    failed write's ``OSError``.  Not an ``OSError`` itself: argparse swallows those when it
    prints ``--help``, and the command must still say that its output was lost."""


# -- the engine codes ------------------------------------------------------------------------
# Both engines (the Cython core and the pure-Python reference) report failures as these
# codes plus the values involved; ``engine_error`` is the one place a code becomes an
# exception.  The Cython enums (``_cells.pxd``, ``_split.pxd``) carry the same numbers, and
# a test checks that they agree and that every code below formats.

OK = 0
SEQ_RANGE = -1          # a seq id outside [0, size)
DUPLICATE_SEQ = -2      # a seq id listed twice in one ubatch
NO_FREE_CELL = -3       # a group needed a cell and none was free
NO_MEMORY = -4
PLACEMENT = -5          # groups did not end up in n_seqs consecutive cells
POSITION = -6           # a position would leave [0, 2**31 - 1)
ARGUMENT = -7           # seq_div by d <= 0
SEQ_HAS_CELL = -8       # a sequence to be placed already holds a cell
BROKEN = -9             # an invariant of the cell table is broken: a bug of ours
CELL_INDEX = -20        # a cell / layer / ubatch index `index` outside [0, `size`)
SPLIT_SEQ_RANGE = -10   # token `token` lists `seq` outside [0, size)
SPLIT_NEGATIVE_POS = -11
SPLIT_GAP = -12         # sequence `seq`: `pos` follows `prev` within the batch
SPLIT_CONTINUE = -13    # sequence `seq` starts at `pos`, its cell is at `prev`
SPLIT_FIND_SLOT = -14   # find_slot would see `pos` after `prev` with `n` new tokens
SPLIT_NO_MEMORY = -15
SPLIT_POS_MAX = -16     # token `token` at position 2**31 - 1, which means "to infinity"

# state blob defects (docs/concepts.md §5); their messages are worded once, in formats.messages
BLOB_TRUNCATED = -30      # `field` at `offset` needs `need` bytes of a blob of `length`
BLOB_TRAILING = -31       # bytes after the blob's end at `offset`
BLOB_SEQ_CELL_COUNT = -32 # a sequence blob with `value` > 1 cells
BLOB_CELL_COUNT = -33     # more cells (`value`) than the cache's `size`
BLOB_POSITION = -34       # cell `cell` has pos `value` at `offset`, outside [0, 2**31 - 1)
BLOB_SEQ_N_SEQ_ID = -35   # a sequence blob's cell lists `value` seq ids
BLOB_NO_SEQ_ID = -36      # a whole-cache blob's cell lists none
BLOB_N_SEQ_ID = -37       # a cell lists more seq ids (`value`) than the cache has
BLOB_SEQ_ID_RANGE = -38   # seq id `value` outside [0, size)
BLOB_SEQ_ID_REPEATED = -39  # seq id `value`, listed first by cell `other`
BLOB_V_TRANS = -40
BLOB_N_LAYER = -41        # `value` layers, the cache has `n_layer`
BLOB_TYPE = -42           # tensor `index` has type `value`, the cache `expected`
BLOB_ROW_BYTES = -43      # tensor `index` has rows of `value` bytes, the cache `expected`

# codes only the C API (recurrent_cache/capi.h) returns: checks of its raw arguments
CAPI_NULL = -50         # a NULL handle or array `what`
CAPI_N_TOKENS = -51     # n_tokens `n` < 1
CAPI_OFFSETS = -52      # seq_id_offsets[`index`] = `pos`: not starting at 0 / not growing
CAPI_N_UBATCH = -53     # n_ubatch `n` < 1
CAPI_STALE = -54        # a batch applied after the cache changed
CAPI_TARGET_SIZE = -55  # a target of `n` bytes for a blob of `need`
CAPI_OVERLAP = -56      # a state buffer overlapping the cache's own rows
CAPI_TENSOR_INDEX = -57 # tensor `index` outside [0, `size`)
CAPI_STATE_SEQ = -58    # a state seq_id `seq` outside [-1, `size`)
CAPI_OPEN_BATCHES = -59 # a context freed with `n` batches not released
CAPI_FLAGS = -60        # batch flags `n` with unknown bits
CAPI_FILTERED_LAYER = -61  # tensor `index` is of layer `n`, which the cache's layer filter keeps no state for

POS_MAX = 2**31 - 1     # llama_pos is int32; this value stands for +infinity in ranges

_TABLE: dict[int, tuple[type[Exception], str]] = {
    SEQ_RANGE: (SeqIdError, "{what}: seq_id {seq} is out of range [0, {size})"),
    DUPLICATE_SEQ: (CoreError, "{what}: find_slot: a seq id appears twice in one ubatch"),
    NO_FREE_CELL: (CoreError, "{what}: find_slot: no free cell left for a sequence"),
    NO_MEMORY: (MemoryError, "{what}: out of memory in the cell table"),
    PLACEMENT: (CoreError, "{what}: find_slot: groups do not fit in consecutive cells"),
    POSITION: (PositionError, "{what}: the position would leave [0, 2**31 - 1)"),
    ARGUMENT: (ArgumentError, "{what}: argument out of its domain"),
    SEQ_HAS_CELL: (ArgumentError, "{what}: seq_id {seq} already holds a cell"),
    BROKEN: (CoreError, "{what}: an invariant of the cell table is broken after placement"),
    CELL_INDEX: (OutOfRangeError, "{what} index {index} is out of range [0, {size})"),
    SPLIT_SEQ_RANGE: (SeqIdError, "token {token}: seq_id {seq} is out of range [0, {size}) (cache size {size})"),
    SPLIT_NEGATIVE_POS: (PositionError, "token {token} has negative position {pos}"),
    SPLIT_GAP: (PositionError, "sequence {seq} has non-consecutive positions in the batch: {pos} follows {prev}"),
    SPLIT_CONTINUE: (PositionError, "sequence {seq} continues at position {pos}, "
                                    "but its cached state is at position {prev}"),
    SPLIT_FIND_SLOT: (PositionError, "find_slot: non-consecutive token position {pos} after {prev} "
                                     "for sequence {seq} with {n} new tokens"),
    SPLIT_NO_MEMORY: (MemoryError, "out of memory while splitting a batch"),
    SPLIT_POS_MAX: (PositionError, "token {token} has position {pos}: positions must be < 2**31 - 1 "
                                   "(2**31 - 1 means \"to the end\" in sequence ranges)"),
    CAPI_NULL: (ArgumentError, "{what}: a NULL pointer where a handle or an array is required"),
    CAPI_N_TOKENS: (BatchError, "{what}: n_tokens must be >= 1, got {n}"),
    CAPI_OFFSETS: (BatchError, "{what}: seq_id_offsets[{index}] = {pos} is out of order: offsets start at 0 and "
                               "strictly grow (every token has at least one seq id)"),
    CAPI_N_UBATCH: (ArgumentError, "{what}: n_ubatch must be >= 1, got {n}"),
    CAPI_STALE: (UsageError, "{what}: the cache changed since the batch was prepared (or last applied); "
                             "init the batch again"),
    CAPI_TARGET_SIZE: (StateError, "{what}: the target holds {n} bytes, the blob needs {need}"),
    CAPI_OVERLAP: (StateError, "{what}: the buffer overlaps the cache's own state rows"),
    CAPI_TENSOR_INDEX: (OutOfRangeError, "{what}: tensor index {index} is out of range [0, {size})"),
    CAPI_STATE_SEQ: (SeqIdError, "{what}: seq_id {seq} is out of range [-1, {size})"),
    CAPI_OPEN_BATCHES: (UsageError, "{what}: {n} batches of this context are not released"),
    CAPI_FLAGS: (ArgumentError, "{what}: unknown flags {n} (RC_BATCH_LOGITS_ALL = 1, RC_BATCH_EMBD_POOLED = 2)"),
    CAPI_FILTERED_LAYER: (OutOfRangeError, "{what}: tensor index {index} is of layer {n}, which holds no recurrent "
                                           "state (the cache's layer filter excludes it)"),
}


def engine_error(code: int, **detail: Any) -> Exception:
    """The exception for an engine's failure ``code``; ``detail`` fills its message.  The blob
    defect codes (``BLOB_*``) are worded with the formats, by ``formats.messages.engine_error``."""
    try:
        cls, template = _TABLE[code]
    except KeyError:
        return CoreError(f"{detail.get('what', 'engine')}: unknown engine code {code}")
    return cls(template.format(**detail))
