"""The bytes of a recurrent state, described once: docs/concepts.md §5 (llama.cpp's recurrent ``state_write``).

This module is the one source of the byte formats: the ggml type table
(``STATE_TYPES`` / ``GGML_TYPES``), the fixed runs of fields (``Layout``:
``CELL_COUNT``, ``CELL``, ``DATA_HEADER``, ``TENSOR_HEADER``), the sequence-file
framing (``SeqFileFormat``: ``GGSQ``; another framing is one more instance),
the cache ``Geometry`` every blob, sequence file, snapshot and store key is
checked against, and the wording of every defect.  The framings current
llama.cpp puts around the memory section (docs/llamacpp_formats.md) are data
here too: ``GGSQ`` (version 3) / ``GGSQ_V2`` / ``GGSN`` / ``GGSN_V9`` files,
``SEQ_BLOB_HEADER`` (``llama_state_seq_get_data``), the architecture string
(``llama_state_get_data``), June-2025's output block after it (``OUTPUT_COUNT``),
and a hybrid's attention KV section (cells with or without ``KV_CELL_EXT``);
``unframe`` / ``read_file`` find them from the bytes (``read_framing``: where two
readings are possible both are parsed whole, and a state both fit is refused) and
hand on the bare memory section, the only bytes the engines read.  ``state_read``,
``seqfile``, ``inspect``, the snapshot codec and the reference engine build
and read their bytes from it; the compiled ``_state_io`` keeps its own loops,
held to the same bytes by the tests.

A blob is, all integers little-endian::

    u32 cell_count
    cell_count x { i32 pos; u32 n_seq_id; n_seq_id x i32 seq_id }   # meta
    u32 v_trans (= 0); u32 n_layer
    n_layer x { i32 r_type; u64 r_row_bytes; cell_count rows of r }
    n_layer x { i32 s_type; u64 s_row_bytes; cell_count rows of s }

With a layer filter (``Geometry.layers``, a hybrid model's recurrent layers)
``n_layer`` stays the model's layer count and the r, then the s, sections are
those of the filtered layers only, in layer order (llama.cpp skips its null layers).

:func:`parse_blob` reads one into a :class:`Blob` without a cache (for
``inspect``) or checks it against a cache's :class:`Geometry` in the order
the compiled core does, so both implementations report the same defect with
the same message.  The message builders below are the only wording of those
defects; the core maps its error codes onto them.
"""

from __future__ import annotations

import io
import os
import stat
import struct
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _args
from .errors import ArgumentError, StateError

__all__ = [
    "StateType", "STATE_TYPES", "GGML_TYPES", "Layout", "CELL_COUNT", "CELL", "DATA_HEADER", "TENSOR_HEADER",
    "SeqFileFormat", "GGSQ", "MAX_TOKENS", "Geometry", "sequence_blob_header", "seq_file_header",
    "Blob", "BlobCell", "BlobTensor", "FileContents", "parse_blob", "parse_seq_file_header", "read_file",
    "blob_view", "target_view", "target_too_small", "target_aliases_cache", "read_rest", "write_all",
    "check_cells", "GGSQ_V2", "GGSN", "FILE_FORMATS", "BARE", "SEQ_BLOB", "CONTEXT_BLOB", "SEQ_BLOB_HEADER",
    "SEQ_BLOB_MAGIC", "ARCH_LENGTH", "KV_STREAMS", "KV_DATA_HEADER", "KV_V_TRANS_HEADER", "seq_file_format",
    "arch_string", "framing_prefix", "Framing", "Unframed", "unframe", "in_section", "GGSN_V9", "CONTEXT_BLOB_V9",
    "OUTPUT_COUNT", "OUTPUT_BUFFER", "KV_CELL_EXT", "READ_FRAMINGS", "Outputs", "read_framing", "MAX_INFERRED_LAYERS",
    "MAX_SKIPPED_BYTES",
]


# -- the ggml types a state tensor can have ------------------------------------

def _bf16_storage() -> np.dtype:
    """bfloat16 as a real numpy dtype when ml_dtypes is installed, else its raw bits (uint16):
    the upper half of the float32 bit pattern, exactly llama.cpp's layout."""
    try:
        from ml_dtypes import bfloat16
    except ImportError:  # pragma: no cover - exercised only without the extra
        return np.dtype(np.uint16)
    storage: np.dtype = np.dtype(bfloat16)
    return storage


@dataclass(frozen=True)
class StateType:
    """A type a state tensor can have: its name, ggml type id, element size and numpy forms."""

    name: str            # "f32", "f16", "bf16": a cache's dtype_r / dtype_s
    type_id: int         # ggml's type id, in a blob's tensor headers
    itemsize: int
    numpy: np.dtype      # how a cache stores it (bf16: ml_dtypes.bfloat16, or raw uint16 bits)
    bits: np.dtype       # the little-endian bits of one element in a blob


# The one table of the state types (the cache's dtypes, the blob's type ids).
STATE_TYPES = {t.name: t for t in (StateType("f32", 0, 4, np.dtype(np.float32), np.dtype("<f4")),
                                   StateType("f16", 1, 2, np.dtype(np.float16), np.dtype("<f2")),
                                   StateType("bf16", 30, 2, _bf16_storage(), np.dtype("<u2")))}
GGML_TYPES = {t.type_id: t for t in STATE_TYPES.values()}


# -- the layouts: every fixed run of fields, named once -------------------------

class Layout(struct.Struct):
    """A fixed run of little-endian fields: a ``struct.Struct`` that knows its fields' names.

    Each field is ``(name, code)`` with a one-character ``struct`` code, packed without padding."""

    def __init__(self, *fields: tuple[str, str]) -> None:
        super().__init__("<" + "".join(code for _, code in fields))
        self.names = tuple(name for name, _ in fields)

    def offset(self, field: str) -> int:
        """Where ``field`` starts, from the start of the layout."""
        index = self.names.index(field)
        return struct.calcsize("<" + self.format[1:][:index]) if index else 0


# A state blob (docs/concepts.md §5): CELL_COUNT, cell_count x (CELL, n_seq_id x i32), DATA_HEADER,
# 2 * n_layer x (TENSOR_HEADER, cell_count rows).
CELL_COUNT = Layout(("cell_count", "I"))
CELL = Layout(("pos", "i"), ("n_seq_id", "I"))
DATA_HEADER = Layout(("v_trans", "I"), ("n_layer", "I"))
TENSOR_HEADER = Layout(("type", "i"), ("row_bytes", "Q"))


@dataclass(frozen=True)
class SeqFileFormat:
    """One framing of a state file: ``header`` (a magic, a version, the token count), the
    tokens as i32, then (``arch_string``) the architecture name or (``outputs``) June-2025
    llama.cpp's output block, then the memory section: of one sequence (``whole`` False) or
    of the whole cache."""

    name: str
    header: Layout
    magic: int
    version: int
    whole: bool = False
    arch_string: bool = False
    outputs: bool = False


_FILE_HEADER = Layout(("magic", "I"), ("version", "I"), ("n_token_count", "I"))
# llama.cpp's llama_state_seq_save_file: LLAMA_STATE_SEQ_MAGIC 'ggsq', LLAMA_STATE_SEQ_VERSION 3
# (llama.cpp 0c1e57098); version 2 (June 2025) has the same bytes and is still read.
GGSQ = SeqFileFormat("'ggsq' version 3", _FILE_HEADER, 0x67677371, 3)
GGSQ_V2 = SeqFileFormat("'ggsq' version 2", _FILE_HEADER, 0x67677371, 2)
# llama_state_save_file: LLAMA_SESSION_MAGIC 'ggsn', LLAMA_SESSION_VERSION 10: tokens, then
# exactly a llama_state_get_data blob (the architecture string, the whole memory section).
GGSN = SeqFileFormat("'ggsn' version 10", _FILE_HEADER, 0x6767736e, 10, whole=True, arch_string=True)
# LLAMA_SESSION_VERSION 9 (June 2025): tokens, then that llama.cpp's llama_state_get_data blob
# (the architecture string, the output block, then the whole memory section).
GGSN_V9 = SeqFileFormat("'ggsn' version 9", _FILE_HEADER, 0x6767736e, 9, whole=True, arch_string=True,
                        outputs=True)
FILE_FORMATS = (GGSQ, GGSQ_V2, GGSN, GGSN_V9)

# The framings of a blob without tokens (``Framing.name``): the bare memory section (what this
# package wrote before, and llama.cpp's memory itself writes), llama_state_seq_get_data's
# (SEQ_BLOB_HEADER first), llama_state_get_data's (the architecture string first) and June-2025
# llama.cpp's llama_state_get_data (the architecture string, then the output block).
BARE = "bare"
SEQ_BLOB = "llama sequence blob"
CONTEXT_BLOB = "llama context blob"
CONTEXT_BLOB_V9 = "llama context blob (June 2025)"
# What ``state_read(framing=...)`` accepts instead of detecting: the bare section, current
# llama.cpp's framing of a sequence (seq_id >= 0) or of the whole cache (-1), June-2025's.
READ_FRAMINGS = {"bare": BARE, "llama": None, "llama-june-2025": CONTEXT_BLOB_V9}
# June-2025 llama.cpp's output block (after the architecture string): i32 n_outputs, n_outputs x
# i32 (the batch position of each output row), u64 logits_size + logits_size x f32, u64 embd_size
# + embd_size x f32.  Each size is n_outputs x (the vocabulary or embedding width), or 0.
OUTPUT_COUNT = Layout(("n_outputs", "i"))
OUTPUT_BUFFER = Layout(("size", "Q"))
SEQ_BLOB_HEADER = Layout(("magic", "I"), ("seq_id", "i"))
SEQ_BLOB_MAGIC = 0xaf143cd8
ARCH_LENGTH = Layout(("arch_length", "I"))
# Every recurrent or hybrid architecture name llama.cpp has is 4 to 64 of these characters.  Read
# as a bare section, 4 of them make cell 0's pos at least 0x2d2d2d2d, which no sequence reaches:
# that is what tells an architecture string from a bare section's cell count.
MIN_ARCH, MAX_ARCH = 4, 64
_ARCH_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")

# llama.cpp's attention KV section (llama_kv_cache::state_write), before a hybrid's recurrent section.
KV_STREAMS = Layout(("n_stream", "I"))
KV_DATA_HEADER = Layout(("v_trans", "I"), ("n_layer", "I"))
KV_V_TRANS_HEADER = Layout(("type", "i"), ("element_bytes", "I"), ("n_embd_v_gqa", "I"))
# llama_kv_cell_ext, between a KV cell's n_seq_id and its seq ids when the model uses M-RoPE or
# per-layer n-gram embeddings (llama_kv_cache::has_cell_ext): a property of the model the bytes
# do not record, so a reader is told or tries both (see ``read_framing``).
KV_CELL_EXT = Layout(("x", "i"), ("y", "i"), ("token", "i"))


# The largest n_layer of a section read with the empty filter without being told (inspect): more
# layers than any model has, and a cache of that many (empty) layers is cheap to build.
MAX_INFERRED_LAYERS = 2**16


# The most tokens a sequence file may hold unless the caller allows more (llama.cpp's
# llama_state_seq_load_file takes the same bound as n_token_capacity): 2**26 tokens,
# 256 MiB, beyond any context window, so a header claiming 2**32 - 1 from a stream
# cannot make a reader buffer 16 GiB.
MAX_TOKENS = 2**26

# The most bytes of framing a read steps over without handing them to the cache: June-2025's
# output block (its logits and embeddings) and a hybrid's attention KV section (its cells' seq
# ids, K and V rows), all of them together.  The cache's geometry bounds neither (it holds no
# logits and no attention rows), so this cap does: 16 GiB, more than a full batch's logits of any
# vocabulary or the KV cache of a long context, and far below a hostile header's 2**40.  A stream
# is stepped over in pieces that are not kept, so this bounds the time spent, not the memory.
MAX_SKIPPED_BYTES = 2**34


def seq_file_header(n_tokens: int, framing: SeqFileFormat = GGSQ) -> bytes:
    """The header of a sequence file of ``n_tokens`` tokens (the tokens follow it)."""
    return framing.header.pack(framing.magic, framing.version, n_tokens)


def seq_file_format(version: Any) -> SeqFileFormat:
    """The 'ggsq' framing of ``version`` (3, llama.cpp's current, or 2); ``ArgumentError`` else."""
    for framing in (GGSQ, GGSQ_V2):
        if version == framing.version and isinstance(version, int) and not isinstance(version, bool):
            return framing
    raise ArgumentError(f"unknown sequence file version {version!r} (expected 3 or 2)")


def arch_string(arch: Any) -> bytes:
    """llama_state_get_data's architecture string (u32 length + name); ``ArgumentError`` for a
    name llama.cpp has no architecture for (4 to 64 lower-case letters, digits, '-', '_', '.')."""
    if not isinstance(arch, str):
        raise ArgumentError(f"arch must be an architecture name (str, e.g. 'mamba'), got {type(arch).__name__}")
    name = arch.encode("ascii", "replace")
    if not MIN_ARCH <= len(name) <= MAX_ARCH or not set(name) <= _ARCH_CHARS:
        raise ArgumentError(f"arch {arch!r} is not an architecture name ({MIN_ARCH} to {MAX_ARCH} lower-case "
                            f"letters, digits, '-', '_' or '.')")
    return ARCH_LENGTH.pack(len(name)) + name


def framing_prefix(framing: str, seq_id: int, arch: Any = None) -> bytes:
    """The bytes before the memory section in ``framing`` ("bare" or "llama") of ``seq_id``'s
    state: llama_state_seq_get_data's header for a sequence, llama_state_get_data's architecture
    string ``arch`` for the whole cache (seq_id -1)."""
    if framing == BARE:
        if arch is not None:
            raise ArgumentError("arch is written only with framing='llama' (the bare section has no name)")
        return b""
    if framing != "llama":
        raise ArgumentError(f"unknown framing {framing!r} (expected 'bare' or 'llama')")
    if seq_id >= 0:
        if arch is not None:
            raise ArgumentError("arch is written only for the whole cache (seq_id -1): "
                                "llama_state_seq_get_data's header has no name")
        return SEQ_BLOB_HEADER.pack(SEQ_BLOB_MAGIC, seq_id)
    if arch is None:
        raise ArgumentError("framing='llama' of the whole cache needs arch= (llama_state_get_data "
                            "begins with the model's architecture name, e.g. 'mamba')")
    return arch_string(arch)


def sequence_blob_header(pos: int, n_layer: int) -> bytes:
    """The bytes before the first tensor header of a one-cell sequence blob at ``pos``."""
    return CELL_COUNT.pack(1) + CELL.pack(pos, 0) + DATA_HEADER.pack(0, n_layer)


# -- the defects, worded once --------------------------------------------------

def tensor_name(k: int, n_layer: int) -> str:
    """Tensor ``k`` of a blob: r of layers 0..n_layer-1, then s of the same layers."""
    return f"layer {k} r" if k < n_layer else f"layer {k - n_layer} s"


def field_name(field: str, cell: int = 0, tensor: int = 0, n_layer: int = 0) -> str:
    """How a truncation message names the field that did not fit."""
    if field == "cell_count":
        return "cell_count"
    if field == "cell":
        return f"cell {cell} pos and n_seq_id"
    if field == "seq_ids":
        return f"cell {cell} seq ids"
    if field == "data_header":
        return "v_trans and n_layer"
    if field == "tensor_header":
        return f"{tensor_name(tensor, n_layer)} type and row size"
    return f"{tensor_name(tensor, n_layer)} rows"


def type_name(type_id: int) -> str:
    return GGML_TYPES[type_id].name if type_id in GGML_TYPES else "unknown type"


def truncated(field: str, offset: int, need: int, length: int) -> StateError:
    return StateError(f"state blob truncated at byte {offset} of {length}: "
                      f"{field} needs {need} bytes, {length - offset} left")


def trailing(end: int, length: int) -> StateError:
    return StateError(f"state blob has {length - end} trailing bytes after byte {end} "
                      f"(blob length {length}, expected {end})")


def sequence_cell_count(count: int) -> StateError:
    return StateError(f"sequence state blob has {count} cells at byte 0 "
                      f"(a sequence state is one cell, expected 0 or 1)")


def cell_count_too_large(count: int, size: int) -> StateError:
    return StateError(f"state blob has {count} cells at byte 0, more than the cache's {size}")


def negative_pos(cell: int, offset: int, pos: int) -> StateError:
    return StateError(f"state blob cell {cell} has pos {pos} at byte {offset}: "
                      f"positions must be in [0, 2**31 - 1)")


def sequence_n_seq_id(cell: int, offset: int, n_seq_id: int) -> StateError:
    return StateError(f"sequence state blob cell {cell} has n_seq_id {n_seq_id} at byte {offset} "
                      f"(must be 0)")


def no_seq_id(cell: int, offset: int) -> StateError:
    return StateError(f"state blob cell {cell} has no seq id (n_seq_id 0 at byte {offset}, "
                      f"a whole-cache blob lists only non-empty cells)")


def n_seq_id_too_large(cell: int, offset: int, n_seq_id: int, size: int) -> StateError:
    return StateError(f"state blob cell {cell} has n_seq_id {n_seq_id} at byte {offset}, "
                      f"more than the cache's {size} sequences")


def seq_id_out_of_range(cell: int, offset: int, seq_id: int, size: int) -> StateError:
    return StateError(f"state blob cell {cell} has seq_id {seq_id} at byte {offset}, "
                      f"out of range [0, {size})")


def seq_id_repeated(cell: int, offset: int, seq_id: int, first_cell: int) -> StateError:
    return StateError(f"state blob cell {cell} lists seq_id {seq_id} at byte {offset}, "
                      f"already listed by cell {first_cell}")


def v_trans_set(offset: int, v_trans: int) -> StateError:
    return StateError(f"state blob v_trans is {v_trans} at byte {offset}, expected 0 "
                      f"(transposed state rows are not supported)")


def n_layer_mismatch(offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob has n_layer {got} at byte {offset}, the cache has {expected}")


def type_mismatch(tensor: str, offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob {tensor} type {got} ({type_name(got)}) at byte {offset} != "
                      f"the cache's {expected} ({type_name(expected)}) (a read does not convert types)")


def row_bytes_mismatch(tensor: str, offset: int, got: int, expected: int) -> StateError:
    return StateError(f"state blob {tensor} row size {got} at byte {offset} != the cache's {expected}")


def charge_skip(skipped: int, n: int, field: str, offset: int) -> int:
    """The bytes of framing stepped over once ``n`` more (``field`` at ``offset``) are; a
    ``StateError`` naming the field and its claim, before any of them is read, past
    ``MAX_SKIPPED_BYTES``."""
    total = skipped + n
    if total > MAX_SKIPPED_BYTES:
        before = f" after {skipped} bytes already stepped over" if skipped else ""
        raise StateError(f"{field} at byte {offset} claims {n} bytes to step over{before}, more than "
                         f"MAX_SKIPPED_BYTES ({MAX_SKIPPED_BYTES}) of framing the cache does not read")
    return total


# -- the parsed form -----------------------------------------------------------

def _geometry_fields(error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any,
                     dtype_s: Any, size: Any, layers: Any) -> dict[str, Any]:
    """The fields of a ``Geometry``, checked (``error`` for a bad one) and normalised to int."""
    fields: dict[str, Any] = {
        "n_layer": _args.count(n_layer, "n_layer", 0, error), "n_embd_r": _args.count(n_embd_r, "n_embd_r", 1, error),
        "n_embd_s": _args.count(n_embd_s, "n_embd_s", 1, error)}
    for name, value in (("dtype_r", dtype_r), ("dtype_s", dtype_s)):
        if not isinstance(value, str) or value not in STATE_TYPES:
            raise error(f"unknown {name} {value!r} (expected one of {', '.join(STATE_TYPES)})")
        fields[name] = value
    fields["size"] = _args.count(size, "size", 1, error)
    fields["layers"] = _args.layer_filter(layers, fields["n_layer"], error)
    return fields


@dataclass(frozen=True)
class Geometry:
    """The shape of a cache's state: what a blob or a snapshot must match to be read into it.

    ``n_layer`` layers of one r row (``n_embd_r`` values of ``dtype_r``) and
    one s row per cell; ``dtype_r`` / ``dtype_s`` are names of
    ``STATE_TYPES``.  ``size`` (cells) matters only to a whole-cache blob: a
    snapshot is one sequence's state, which any size holds, so a store key
    (``key_text``) leaves it out.  Bad fields raise ``ArgumentError``.

    ``layers``: the layers that hold recurrent state (a hybrid model's recurrent
    layers, llama.cpp's layer filter), sorted; None (also what a filter naming
    every layer becomes) is every layer.  A blob still records ``n_layer``, the
    model's layer count, but holds the r sections, then the s sections, of these
    layers only.
    """

    n_layer: int
    n_embd_r: int
    n_embd_s: int
    dtype_r: str = "f32"
    dtype_s: str = "f32"
    size: int = 1
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        fields = _geometry_fields(ArgumentError, self.n_layer, self.n_embd_r, self.n_embd_s, self.dtype_r,
                                  self.dtype_s, self.size, self.layers)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @classmethod
    def checked(cls, error: type[Exception], n_layer: Any, n_embd_r: Any, n_embd_s: Any, dtype_r: Any = "f32",
                dtype_s: Any = "f32", size: Any = 1, layers: Any = None) -> Geometry:
        """A geometry, raising ``error`` (a constructor's ``ConfigError``) for a bad field."""
        return cls(**_geometry_fields(error, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, size, layers))

    @classmethod
    def of(cls, cache: Any) -> Geometry:
        """The geometry of a ``RecurrentCache`` of either engine, from its public attributes."""
        return cls(cache.n_layer, cache.n_embd_r, cache.n_embd_s, cache.dtype_r, cache.dtype_s, cache.size,
                   cache.layers)

    @classmethod
    def of_tensors(cls, size: int, type_ids: Sequence[int], tensors: Sequence[np.ndarray], n_layer: int,
                   layers: Sequence[int]) -> Geometry:
        """The geometry of an engine's state tensors: r of each of ``layers`` (of the model's
        ``n_layer``), then their s, (size, n_embd) arrays of ggml types ``type_ids``.  Without
        tensors no row width or type is recorded anywhere; 1 and f32 are taken (no row of them
        is ever read or written)."""
        n_state = len(tensors) // 2
        if not n_state:
            return cls(n_layer, 1, 1, size=size, layers=tuple(layers))
        return cls(n_layer, tensors[0].shape[1], tensors[n_state].shape[1], GGML_TYPES[type_ids[0]].name,
                   GGML_TYPES[type_ids[n_state]].name, size, tuple(layers))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with state, sorted (every layer unless filtered)."""
        return tuple(range(self.n_layer)) if self.layers is None else self.layers

    @property
    def n_state_layers(self) -> int:
        """How many layers hold state: a blob's r sections (and s sections)."""
        return self.n_layer if self.layers is None else len(self.layers)

    @property
    def type_r(self) -> StateType:
        return STATE_TYPES[self.dtype_r]

    @property
    def type_s(self) -> StateType:
        return STATE_TYPES[self.dtype_s]

    @property
    def row_bytes_r(self) -> int:
        return self.n_embd_r * self.type_r.itemsize

    @property
    def row_bytes_s(self) -> int:
        return self.n_embd_s * self.type_s.itemsize

    @property
    def type_ids(self) -> tuple[int, ...]:
        """The ggml type of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.type_r.type_id,) * n_state + (self.type_s.type_id,) * n_state

    @property
    def row_bytes(self) -> tuple[int, ...]:
        """The row size of every tensor section of a blob: r of every layer with state, then s."""
        n_state = self.n_state_layers
        return (self.row_bytes_r,) * n_state + (self.row_bytes_s,) * n_state

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's rows (r and s of every layer with state)."""
        return self.n_state_layers * (self.row_bytes_r + self.row_bytes_s)

    def sequence_blob_size(self) -> int:
        """Length of a one-cell sequence blob of this geometry."""
        return (CELL_COUNT.size + CELL.size + DATA_HEADER.size + 2 * self.n_state_layers * TENSOR_HEADER.size
                + self.state_bytes)

    def check_rows(self, rows: Sequence[Any], which: str) -> list[np.ndarray]:
        """One sequence's ``which`` ("r" or "s") rows, one per layer with state (in layer order),
        as contiguous arrays; ``ArgumentError`` unless they have exactly this geometry's widths and
        storage dtype."""
        n_embd, dtype = (self.n_embd_r, self.type_r.numpy) if which == "r" else (self.n_embd_s, self.type_s.numpy)
        if len(rows) != self.n_state_layers:
            raise ArgumentError(f"{which}_rows has {len(rows)} rows, the geometry has {self.n_state_layers} "
                                f"layers with state")
        out = []
        for il, row in enumerate(rows):
            array = np.asarray(row)
            if array.shape != (n_embd,) or array.dtype != dtype:
                raise ArgumentError(f"{which}_rows[{il}] has shape {array.shape} and dtype {array.dtype}, "
                                    f"the geometry has ({n_embd},) and {dtype}")
            out.append(np.ascontiguousarray(array))
        return out

    def key_text(self) -> str:
        """What a store key holds of the geometry: every field but ``size``.  A filter is appended
        (``;layers=0,2``, ``;layers=`` for none); an unfiltered geometry's text is as it always was."""
        text = (f"n_layer={self.n_layer};n_embd_r={self.n_embd_r};n_embd_s={self.n_embd_s};"
                f"dtype_r={self.dtype_r};dtype_s={self.dtype_s}")
        if self.layers is not None:
            text += ";layers=" + ",".join(map(str, self.layers))
        return text


@dataclass(frozen=True)
class BlobCell:
    pos: int
    seq_ids: tuple[int, ...]     # empty in a single-sequence blob


@dataclass(frozen=True)
class BlobTensor:
    """One tensor section: ``cell_count`` rows of ``row_bytes`` bytes at ``offset``."""

    name: str                    # "r" or "s"
    layer: int
    type_id: int
    row_bytes: int
    offset: int                  # where the rows start in the blob

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def n_embd(self) -> int | None:
        """Elements per row, when the type is one of GGML_TYPES and divides the row."""
        if self.type_id not in GGML_TYPES or self.row_bytes % GGML_TYPES[self.type_id].itemsize:
            return None
        return self.row_bytes // GGML_TYPES[self.type_id].itemsize


@dataclass(frozen=True)
class Blob:
    cells: tuple[BlobCell, ...]
    n_layer: int
    tensors: tuple[BlobTensor, ...]   # r of every layer with state, then s
    n_bytes: int

    @property
    def cell_count(self) -> int:
        return len(self.cells)

    @property
    def kind(self) -> str:
        """"single-sequence", "whole-cache", "empty" (0 cells: either) or "mixed" (neither)."""
        if not self.cells:
            return "empty"
        if all(not cell.seq_ids for cell in self.cells):
            return "single-sequence" if len(self.cells) == 1 else "mixed"
        return "whole-cache" if all(cell.seq_ids for cell in self.cells) else "mixed"

    def rows(self, data: Any, tensor: BlobTensor) -> np.ndarray:
        """The raw rows of one tensor section: a read-only (cell_count, row_bytes) uint8 view."""
        count = self.cell_count * tensor.row_bytes
        return np.frombuffer(blob_view(data), dtype=np.uint8, count=count,
                             offset=tensor.offset).reshape(self.cell_count, tensor.row_bytes)


class _Reader:
    """A cursor over a blob in memory; raises ``truncated`` for a field that does not fit.

    ``_FileReader`` offers the same four calls over a file, so one parser
    (``_parse``) serves both and reports the same defect with the same words.
    """

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.offset = 0
        self.length = len(data)
        self.skipped = 0             # bytes of framing stepped over (``charge_skip``)

    def _need(self, n: int, field: str) -> int:
        start = self.offset
        if self.length - start < n:
            raise truncated(field, start, n, self.length)
        self.offset += n
        return start

    def unpack(self, layout: struct.Struct, field: str) -> tuple[tuple[Any, ...], int]:
        """The values of ``layout`` at the cursor, and the offset they were read at."""
        at = self._need(layout.size, field)
        return layout.unpack_from(self.data, at), at

    def ids(self, count: int, field: str) -> tuple[tuple[int, ...], int]:
        """``count`` int32 at the cursor, and their offset."""
        at = self._need(4 * count, field)
        return struct.unpack_from(f"<{count}i", self.data, at), at

    def skip(self, n: int, field: str) -> int:
        """Step over n bytes (rows); returns where they start."""
        return self._need(n, field)

    def step_over(self, n: int, field: str) -> int:
        """Step over n bytes of a framing (not rows); returns where they start."""
        if self.length - self.offset >= n:   # a claim past the end is a truncation first
            self.skipped = charge_skip(self.skipped, n, field, self.offset)
        return self._need(n, field)

    def take(self, n: int, short: Any) -> memoryview:
        """The next n bytes; ``short(offset, n, length)`` is the error when fewer are left."""
        at = self.offset
        if self.length - at < n:
            raise short(at, n, self.length)
        self.offset += n
        return self.data[at:at + n]

    def peek(self, n: int) -> bytes:
        """Up to n bytes at the cursor, without moving it."""
        return bytes(self.data[self.offset:self.offset + n])

    def rebase(self) -> None:
        """Make the current position offset 0 (the blob of a sequence file starts here)."""
        self.data = self.data[self.offset:]
        self.length -= self.offset
        self.offset = 0

    def finish(self) -> memoryview:
        """The blob's bytes, once the parse ended exactly at the end of the data."""
        if self.offset != self.length:
            raise trailing(self.offset, self.length)
        return self.data


def _check_cell_header(i: int, pos: int, pos_at: int, n_seq_id: int, size: int, seq_id: int) -> None:
    """The rules for a cell's pos and n_seq_id when read into a cache of ``size`` cells at ``seq_id``."""
    if not 0 <= pos < 2**31 - 1:   # 2**31 - 1 means "to the end" in ranges
        raise negative_pos(i, pos_at, pos)
    if seq_id >= 0 and n_seq_id != 0:
        raise sequence_n_seq_id(i, pos_at + 4, n_seq_id)
    if seq_id < 0 and n_seq_id == 0:
        raise no_seq_id(i, pos_at + 4)
    if n_seq_id > size:
        raise n_seq_id_too_large(i, pos_at + 4, n_seq_id, size)


def _check_cell_ids(i: int, ids: tuple[int, ...], ids_at: int, size: int, first_cell: dict[int, int]) -> None:
    """The rules for a cell's seq ids: in ``[0, size)``, none listed by an earlier cell."""
    for j, seq in enumerate(ids):
        if not 0 <= seq < size:
            raise seq_id_out_of_range(i, ids_at + 4 * j, seq, size)
        if seq in first_cell:
            raise seq_id_repeated(i, ids_at + 4 * j, seq, first_cell[seq])
        first_cell[seq] = i


def _check_cell_count(count: int, size: int, seq_id: int) -> None:
    if seq_id >= 0 and count > 1:
        raise sequence_cell_count(count)
    if seq_id < 0 and count > size:
        raise cell_count_too_large(count, size)


def check_cells(cells: tuple[BlobCell, ...], size: int, seq_id: int) -> None:
    """The cell rules of ``parse_blob`` for the cells of a blob parsed without a cache, in blob order."""
    _check_cell_count(len(cells), size, seq_id)
    first_cell: dict[int, int] = {}
    at = 4
    for i, cell in enumerate(cells):
        _check_cell_header(i, cell.pos, at, len(cell.seq_ids), size, seq_id)
        _check_cell_ids(i, cell.seq_ids, at + 8, size, first_cell)
        at += 8 + 4 * len(cell.seq_ids)


def _parse(reader: Any, cache: Geometry | None, seq_id: int, watch: Any = None,
           layers: Sequence[int] | None = None, infer_layers: bool = False) -> Blob:
    """The checks of ``parse_blob`` over a ``_Reader`` or a ``_FileReader``.

    ``layers`` (without ``cache``): the layers whose sections the blob holds, each below the
    blob's n_layer (None: every layer).  ``infer_layers`` (without either): data that ends
    right after the layer header holds no layer (the empty filter, a hybrid draft's state; up
    to ``MAX_INFERRED_LAYERS``); data that ends after the sections of some of the layers says
    so in its truncation error.

    ``watch`` (optional) sees the blob as it is read, before any row:
    ``watch.cells(blob_cells)`` once the cells are read, ``watch.layers(n_layer,
    offset)`` and ``watch.tensor(k, type_id, row_bytes, offset)``; it may raise
    to stop the read there.
    """
    (cell_count,), _ = reader.unpack(CELL_COUNT, field_name("cell_count"))
    if cache is not None:
        _check_cell_count(cell_count, cache.size, seq_id)
    cells = []
    first_cell: dict[int, int] = {}   # seq id -> the cell that listed it
    for i in range(cell_count):
        (pos, n_seq_id), pos_at = reader.unpack(CELL, field_name("cell", cell=i))
        if cache is not None:
            _check_cell_header(i, pos, pos_at, n_seq_id, cache.size, seq_id)
        ids, ids_at = reader.ids(n_seq_id, field_name("seq_ids", cell=i))
        if cache is not None:
            _check_cell_ids(i, ids, ids_at, cache.size, first_cell)
        cells.append(BlobCell(pos, ids))
    (v_trans, n_layer), data_at = reader.unpack(DATA_HEADER, field_name("data_header"))
    if v_trans != 0:
        raise v_trans_set(data_at, v_trans)
    if cache is not None and n_layer != cache.n_layer:
        raise n_layer_mismatch(data_at + 4, n_layer, cache.n_layer)
    if watch is not None:
        watch.cells(tuple(cells))
        watch.layers(n_layer, data_at + 4)
    tensors = []
    # a blob cannot say which layers its sections are: the cache's filter names them (and
    # decides their count); without a cache the caller's ``layers`` or every layer (a range: a
    # damaged n_layer of 2**32 costs nothing before the first section that is not there)
    if cache is not None:
        layers = range(n_layer) if cache.layers is None else cache.layers
    elif layers is None:
        layers = range(n_layer)
    elif layers and layers[-1] >= n_layer:
        raise StateError(f"state blob has n_layer {n_layer} at byte {data_at + 4}, but the layer filter names "
                         f"layer {layers[-1]}")
    n_state = len(layers)
    for k in range(2 * n_state):
        model_tensor = layers[k] if k < n_state else n_layer + layers[k - n_state]
        name = tensor_name(model_tensor, n_layer)
        if infer_layers and not reader.peek(1):   # the data ends before this section
            if k == 0 and n_layer <= MAX_INFERRED_LAYERS:
                layers, n_state = (), 0
                break
            short = truncated(f"{name} type and row size", reader.offset, TENSOR_HEADER.size, reader.offset)
            hint = (f" (or a hybrid's state holding r and s sections of {k // 2} of its {n_layer} layers: "
                    f"name them, inspect --layers)") if k % 2 == 0 else ""
            raise StateError(f"{short}{hint}")
        (type_id, row_bytes), header_at = reader.unpack(TENSOR_HEADER, f"{name} type and row size")
        if cache is not None:
            if type_id != cache.type_ids[k]:
                raise type_mismatch(name, header_at, type_id, cache.type_ids[k])
            if row_bytes != cache.row_bytes[k]:
                raise row_bytes_mismatch(name, header_at + 4, row_bytes, cache.row_bytes[k])
        if watch is not None:
            watch.tensor(k, type_id, row_bytes, header_at)
        rows_at = reader.skip(cell_count * row_bytes, f"{name} rows")
        tensors.append(BlobTensor("r" if k < n_state else "s", layers[k % n_state], type_id, row_bytes, rows_at))
    return Blob(tuple(cells), n_layer, tuple(tensors), reader.offset)


def _parse_any_filter(reader: Any, watch: Any = None) -> None:
    """The structure of a memory section whose layer filter is unknown: its cells, then tensor
    sections up to the end of the data, an even number of them and at most 2 x n_layer (a
    filter keeps r and s of the same layers)."""
    (cell_count,), _ = reader.unpack(CELL_COUNT, field_name("cell_count"))
    cells = []
    for i in range(cell_count):
        (pos, n_seq_id), _ = reader.unpack(CELL, field_name("cell", cell=i))
        ids, _ = reader.ids(n_seq_id, field_name("seq_ids", cell=i))
        cells.append(BlobCell(pos, ids))
    (v_trans, n_layer), data_at = reader.unpack(DATA_HEADER, field_name("data_header"))
    if v_trans != 0:
        raise v_trans_set(data_at, v_trans)
    if watch is not None:
        watch.cells(tuple(cells))
        watch.layers(n_layer, data_at + 4)
    k = 0
    while reader.peek(1):
        if k == 2 * n_layer:
            raise trailing(reader.offset, reader.offset + len(reader.peek(1 << 16)))
        (type_id, row_bytes), header_at = reader.unpack(TENSOR_HEADER, f"tensor section {k} type and row size")
        if type_id not in GGML_TYPES:
            raise StateError(f"state blob tensor section {k} has type {type_id} at byte {header_at}, "
                             f"not a state type")
        reader.skip(cell_count * row_bytes, f"tensor section {k} rows")
        k += 1
    if k % 2:
        raise StateError(f"state blob ends after {k} tensor sections: a layer filter keeps r and s of the "
                         f"same layers (an even number)")


def parse_blob(data: Any, cache: Geometry | None = None, seq_id: int = -1) -> Blob:
    """Parse a state blob, raising ``StateError`` at its first defect.

    Without ``cache`` only the structure is checked (lengths, ``v_trans == 0``,
    no trailing bytes).  With it, every rule of docs/concepts.md §5 for reading the blob
    into that cache at ``seq_id`` is checked too, in blob order: a sequence
    blob (``seq_id >= 0``) has at most one cell and no seq ids; a whole-cache
    blob (``seq_id == -1``) has at most ``size`` cells, each with at least one
    seq id in ``[0, size)``, no seq id twice; no cell has a negative pos; the
    layer count, types and row sizes are the cache's.
    """
    reader = _Reader(blob_view(data))
    blob = _parse(reader, cache, seq_id)
    reader.finish()
    return blob


# -- buffers and files ---------------------------------------------------------

def _byte_view(obj: Any) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (numpy arrays of any dtype too).

    Raises TypeError for an object that is no buffer, ArgumentError for one
    that cannot be used (released, not contiguous, an unreadable format).
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ArgumentError("the array must be C-contiguous")
        # a custom dtype (bfloat16) cannot export a buffer itself, its bytes can
        obj = obj.reshape(-1).view(np.uint8)
    try:
        view = memoryview(obj)
    except (ValueError, BufferError) as exc:   # a released memoryview, a failing exporter
        raise ArgumentError(f"the {type(obj).__name__} cannot be used as a buffer: {exc}") from None
    if not view.c_contiguous:
        raise ArgumentError("the buffer must be C-contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (TypeError, ValueError) as exc:
        raise ArgumentError(f"the {type(obj).__name__} (format {view.format!r}, shape {view.shape}) "
                            f"cannot be read as bytes: {exc}") from None


def blob_view(data: Any) -> memoryview:
    """The bytes of a blob given as any bytes-like object."""
    try:
        return _byte_view(data)
    except TypeError:
        raise ArgumentError(f"a state blob must be a bytes-like object, got {type(data).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"a state blob: {exc}") from None


def _check_file(file: Any, op: str, method: str, mode: str) -> None:
    """ArgumentError unless ``file`` is an open binary file that can ``method`` ("read" or "write")."""
    if isinstance(file, io.TextIOBase):
        raise ArgumentError(f"{op}: the file is a text file; open it in binary mode")
    if not callable(getattr(file, method, None)):
        raise ArgumentError(f"{op} takes a binary file, got {type(file).__name__}")
    if getattr(file, "closed", False) is True:
        raise ArgumentError(f"{op}: the file is closed")
    able = getattr(file, {"read": "readable", "write": "writable"}[method], None)
    if callable(able):
        try:
            usable = able()
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"{op}: the file cannot be used: {exc}") from None
        if usable is False:
            raise ArgumentError(f"{op}: the file is not open for {mode}")


def target_view(target: Any) -> memoryview | None:
    """A writable byte view of ``target``, or None when it is not a buffer (a file, then)."""
    if isinstance(target, io.TextIOBase):
        raise ArgumentError("state_write_into: the target is a text file; open it in binary mode")
    try:
        view = _byte_view(target)
    except TypeError:
        if callable(getattr(target, "write", None)):
            _check_file(target, "state_write_into", "write", "writing")
            return None
        raise ArgumentError(f"state_write_into: the target must be a writable buffer or a binary "
                            f"file, got {type(target).__name__}") from None
    except ArgumentError as exc:
        raise ArgumentError(f"state_write_into: {exc}") from None
    if view.readonly:
        raise ArgumentError(f"state_write_into: the target ({type(target).__name__}) is read-only")
    return view


def target_too_small(available: int, needed: int) -> ArgumentError:
    return ArgumentError(f"state_write_into: the target has {available} bytes, the blob needs {needed}")


def target_aliases_cache() -> ArgumentError:
    return ArgumentError("state_write_into: the target shares memory with the cache's state tensors "
                         "(writing the blob there would overwrite the rows it is made of)")


def write_all(file: Any, chunk: Any) -> None:
    """Write every byte of ``chunk`` to a binary file; never loops without progress.

    ``file.write`` may write less than asked (a raw file); the rest is written
    again.  What it returns decides:

    * an integer ``n`` with ``0 < n <= len``: ``n`` bytes were written;
    * ``None`` from an ``io.RawIOBase``: nothing was written, the file would
      block (io's protocol) - an ``ArgumentError``;
    * ``None`` from any other object: everything was written.  Duck-typed
      writers (a class with ``write`` appending to a list) return None, and
      ``shutil.copyfileobj`` and ``print(file=...)`` read it the same way;
    * 0, a negative number, more than asked or a non-integer: an
      ``ArgumentError`` naming the value, since retrying could spin forever.

    Bytes already written stay written: a file cannot be un-written.
    """
    view = memoryview(chunk).cast("B")
    total = len(view)
    while len(view):
        written = file.write(view)
        done = total - len(view)
        if written is None:
            if isinstance(file, io.RawIOBase):
                raise ArgumentError(f"state_write_into: the file would block (a non-blocking raw file "
                                    f"returned None) after {done} of {total} bytes of this part")
            return
        written = _args.integer(written, f"state_write_into: the file's write() result after {done} of "
                                         f"{total} bytes of this part")
        if not 0 < written <= len(view):
            raise ArgumentError(f"state_write_into: the file's write() of {len(view)} bytes returned "
                                f"{int(written)} (after {done} of {total} bytes of this part; "
                                f"expected 1 to {len(view)})")
        view = view[int(written):]


# -- reading a blob or a sequence file from a file, bounded by its headers -----

_CHUNK = 1 << 20   # a stream is read in pieces: memory grows with the data that came, not the claims


def _remaining(file: Any) -> int | None:
    """Bytes from the file's position to its end when that is known (a non-empty regular
    file, a seekable in-memory file); None for a pipe, FIFO, device or socket."""
    try:
        fileno = file.fileno()
    except (AttributeError, OSError, ValueError, TypeError):
        fileno = None
    try:
        if isinstance(fileno, int):
            info = os.fstat(fileno)
            # st_size 0 is also what /proc files report, so such a file is read as a stream
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                return None
            return max(0, info.st_size - int(file.tell()))
        if file.seekable():
            here = file.tell()
            end = file.seek(0, io.SEEK_END)
            file.seek(here)
            return max(0, end - here) if isinstance(end, int) and isinstance(here, int) else None
    except (AttributeError, OSError, ValueError, TypeError):
        pass
    return None


class _FileReader:
    """The ``_Reader`` calls over a binary file, from its position.

    Nothing is read before a header asks for it.  When the file's length is
    known, every claim is checked against it before a byte is read, rows are
    stepped over with ``seek`` and read in one piece at the end; a stream
    (pipe, FIFO, device) is read piece by piece up to what the headers claim,
    then one byte more to prove it ends there.  With ``rows`` the rows are
    handed to it piece by piece as they are read and not kept at all.
    """

    def __init__(self, file: Any, op: str, rows: Any = None) -> None:
        self.file = file
        self.op = op                 # who reads, for the messages: "state_read_from", a path, ...
        self.rows = rows
        self.offset = 0              # relative to the start (see ``rebase``)
        self.skipped = 0             # bytes of framing stepped over (``charge_skip``)
        self.pending = b""           # bytes read by ``peek``, served first
        self.length = _remaining(file)
        self.start = file.tell() if self.length is not None else 0
        # a stream keeps what it read (it cannot be read again); not with a rows consumer
        self.kept: bytearray | None = bytearray() if self.length is None and rows is None else None

    def read_up_to(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the file)."""
        if self.pending:
            piece, self.pending = self.pending[:n], self.pending[n:]
            return piece
        piece = self.file.read(n)
        if piece is None:
            raise ArgumentError(f"{self.op}: the file would block (a non-blocking file with no data ready)")
        try:
            size = memoryview(piece).nbytes
        except TypeError:
            raise ArgumentError(f"{self.op}: the file's read() returned {type(piece).__name__}, "
                                f"not bytes") from None
        if size > n:
            raise ArgumentError(f"{self.op}: the file's read({n}) returned {size} bytes")
        return bytes(piece)

    def _pieces(self, n: int) -> Any:
        """n bytes in pieces of at most _CHUNK; stops early at the end of the file."""
        while n > 0:
            piece = self.read_up_to(min(n, _CHUNK))
            if not piece:
                return
            n -= len(piece)
            yield piece

    def take(self, n: int, short: Any) -> bytes:
        """The next n bytes; ``short(offset, n, length)`` is the error when fewer are left."""
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise short(at, n, self.length)
        data = bytearray()
        for piece in self._pieces(n):
            data += piece
        if len(data) < n:   # a stream ended (or a file shrank since its length was taken)
            raise short(at, n, at + len(data))
        if self.kept is not None:
            self.kept += data
        self.offset += n
        return bytes(data)

    def peek(self, n: int) -> bytes:
        """Up to n bytes at the cursor, without moving it."""
        data = b"".join(self._pieces(n))
        self.pending = data + self.pending
        return data

    def unpack(self, layout: struct.Struct, field: str) -> tuple[tuple[Any, ...], int]:
        at = self.offset
        return layout.unpack(self.take(layout.size, _truncation(field))), at

    def ids(self, count: int, field: str) -> tuple[tuple[int, ...], int]:
        at = self.offset
        return struct.unpack(f"<{count}i", self.take(4 * count, _truncation(field))), at

    def step_over(self, n: int, field: str) -> int:
        """Step over n bytes of a framing: the rows consumer does not see them, and a stream's
        are read in pieces and dropped (framing is never part of the blob that is kept)."""
        if self.length is None or self.length - self.offset >= n:   # past a file's end: truncated
            self.skipped = charge_skip(self.skipped, n, field, self.offset)
        if self.rows is None and self.length is not None:
            return self.skip(n, field)
        if self.length is None:
            at = self.offset
            got = sum(len(piece) for piece in self._pieces(n))
            if got < n:
                raise truncated(field, at, n, at + got)
            self.offset += n
            return at
        rows, self.rows = self.rows, None
        try:
            return self.skip(n, field)
        finally:
            self.rows = rows

    def skip(self, n: int, field: str) -> int:
        at = self.offset
        if self.length is not None and self.length - at < n:
            raise truncated(field, at, n, self.length)
        if self.rows is None and self.kept is None:
            served = min(n, len(self.pending))   # bytes a peek read ahead, then the rest by seeking
            self.pending = self.pending[served:]
            if n > served:
                self.file.seek(n - served, io.SEEK_CUR)
        else:
            got = 0
            for piece in self._pieces(n):
                got += len(piece)
                if self.rows is not None:
                    self.rows(piece)
                else:
                    self.kept += piece
            if got < n:
                raise truncated(field, at, n, at + got)
        self.offset += n
        return at

    def rebase(self) -> None:
        """Make the current position offset 0 (the blob of a sequence file starts here)."""
        if self.length is not None:
            self.start += self.offset
            self.length -= self.offset
        if self.kept is not None:
            del self.kept[:]
        self.offset = 0

    def finish(self) -> bytearray | None:
        """The bytes from offset 0 to the cursor (None with a rows consumer), once the file
        is proven to end there."""
        end = self.offset
        if self.length is not None and end != self.length:
            raise trailing(end, self.length)
        if self.read_up_to(1):
            raise StateError(f"state blob has trailing bytes after byte {end} "
                             + ("(the file grew while it was read)" if self.length is not None else
                                f"(the stream goes on past the {end} bytes its headers claim)"))
        if self.kept is not None or self.rows is not None:
            return self.kept   # a stream is never read past what a header claims: exactly the blob
        self.file.seek(self.start)
        data = bytearray(end)
        view = memoryview(data)
        got = 0
        for piece in self._pieces(end):
            view[got:got + len(piece)] = piece
            got += len(piece)
        view.release()
        if got < end:
            raise StateError(f"state blob truncated: the file shrank to {got} of {end} bytes while it was read")
        return data


def _truncation(field: str) -> Any:
    return lambda at, n, length: truncated(field, at, n, length)


def read_rest(file: Any, cache: Geometry | None = None, seq_id: int = -1) -> bytearray:
    """The blob of ``state_read_from``: one blob from a binary file's position to its end.

    Reads only what the blob's headers claim (and one byte more to prove the
    file ends there), so ``/dev/zero``, an endless pipe or a huge file with a
    short header are rejected without reading them; with ``cache`` every
    check of ``parse_blob`` is made on the way, which bounds the read by the
    cache's own state size.
    """
    data: bytearray = read_file(file, "state_read_from", cache, seq_id, sequence_file=False).data
    return data


def _seq_file_header(reader: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, SeqFileFormat]:
    """The tokens and framing of a state file's header (one of ``FILE_FORMATS``); leaves the
    reader after the tokens."""
    header = _FILE_HEADER
    head = reader.take(header.size, lambda at, n, length: StateError(
        f"sequence file truncated: {length} bytes, the header needs {header.size}"))
    fields = dict(zip(header.names, header.unpack(head), strict=True))
    magic, version, n_tokens = fields["magic"], fields["version"], fields["n_token_count"]
    same_magic = [framing for framing in FILE_FORMATS if framing.magic == magic]
    if not same_magic:
        raise StateError(f"not a sequence file: magic 0x{magic:08x} at byte {header.offset('magic')}, "
                         f"expected 0x{GGSQ.magic:08x} ('ggsq') or 0x{GGSN.magic:08x} ('ggsn')")
    framing = next((framing for framing in same_magic if framing.version == version), None)
    if framing is None:
        kind = "sequence file" if magic == GGSQ.magic else "session file"
        raise StateError(f"{kind} version {version} at byte {header.offset('version')}, "
                         f"expected {' or '.join(str(framing.version) for framing in same_magic)}")
    count_at = header.offset("n_token_count")
    if n_tokens > max_tokens:
        raise StateError(f"sequence file has {n_tokens} tokens (count at byte {count_at}), more than "
                         f"max_tokens {max_tokens}")
    tokens = reader.take(4 * n_tokens, lambda at, n, length: StateError(
        f"sequence file truncated: {n_tokens} tokens (count at byte {count_at}) need {n} bytes, "
        f"{length - at} left"))
    return np.frombuffer(tokens, dtype="<i4").astype(np.int32), framing


def _file_magic(head: bytes) -> bool:
    """Whether a file's first bytes are a state file's magic (its first field, a u32)."""
    return len(head) == 4 and any(head == framing.magic.to_bytes(4, "little") for framing in FILE_FORMATS)


def parse_seq_file_header(data: Any, max_tokens: int = MAX_TOKENS) -> tuple[np.ndarray, int]:
    """The tokens of a 'ggsq' sequence file in memory and the offset where its state blob starts."""
    reader = _Reader(blob_view(data))
    tokens, _ = _seq_file_header(reader, max_tokens)
    return tokens, reader.offset


def _arch_name(reader: Any) -> str | None:
    """The architecture name when the cursor is at an architecture string, else None.

    Its length is peeked first and its characters only if it is a name's: a stream is never
    asked for bytes the string does not claim (a FIFO would block for them)."""
    head = reader.peek(ARCH_LENGTH.size)
    if len(head) < ARCH_LENGTH.size:
        return None
    (length,) = ARCH_LENGTH.unpack_from(head)
    if not MIN_ARCH <= length <= MAX_ARCH:
        return None
    name = bytes(reader.peek(ARCH_LENGTH.size + length))[ARCH_LENGTH.size:]
    if len(name) != length or not set(name) <= _ARCH_CHARS:
        return None
    return name.decode("ascii")


def _read_arch(reader: Any, arch: str | None) -> str:
    """The architecture string at the cursor (it must be one), checked against ``arch``."""
    at = reader.offset
    name = _arch_name(reader)
    if name is None:
        (length,), _ = reader.unpack(ARCH_LENGTH, "architecture string length")
        raise StateError(f"the architecture string at byte {at} is not a name (length {length}, "
                         f"expected {MIN_ARCH} to {MAX_ARCH} lower-case letters, digits, '-', '_', '.')")
    if arch is not None and name != arch:
        raise StateError(f"state is for architecture {name!r} (string at byte {at}), "
                         f"the caller's model is {arch!r}")
    reader.take(ARCH_LENGTH.size + len(name), _truncation("architecture string"))
    return name


@dataclass(frozen=True)
class Outputs:
    """June-2025 llama.cpp's output block (``OUTPUT_COUNT``, ``OUTPUT_BUFFER``): the batch position
    of each output row, and how many logits and embedding values follow them."""

    positions: tuple[int, ...]
    n_logits: int
    n_embd: int

    @property
    def n_outputs(self) -> int:
        return len(self.positions)


def _read_output_buffer(reader: Any, name: str, n_outputs: int, count_at: int) -> int:
    """One of the output block's u64-counted float runs (``name`` "logits" or "embeddings");
    its count must be a multiple of n_outputs (n_outputs x the width), 0 without outputs."""
    (size,), at = reader.unpack(OUTPUT_BUFFER, f"{name} size")
    if (size % n_outputs) if n_outputs else size:
        raise StateError(f"the output block's {name} size {size} at byte {at} is not a multiple of n_outputs "
                         f"{n_outputs} (at byte {count_at}): June-2025 llama.cpp writes n_outputs x the width, or 0")
    reader.step_over(4 * size, f"{size} {name} (f32)")
    return int(size)


def _read_outputs(reader: Any, max_tokens: int) -> Outputs:
    """The output block at the cursor (see ``OUTPUT_COUNT``), checked field by field; an output
    is a token of the batch, so there are at most ``max_tokens`` of them."""
    (n_outputs,), count_at = reader.unpack(OUTPUT_COUNT, "output block n_outputs")
    if n_outputs < 0:
        raise StateError(f"the output block's n_outputs is {n_outputs} at byte {count_at}, expected >= 0")
    if n_outputs > max_tokens:
        raise StateError(f"the output block's n_outputs {n_outputs} at byte {count_at} is more than max_tokens "
                         f"{max_tokens} (each output is a token of the batch)")
    positions, at = reader.ids(n_outputs, f"{n_outputs} output positions")
    for i, position in enumerate(positions):
        if position < 0:
            raise StateError(f"the output block's output {i} has batch position {position} at byte {at + 4 * i}, "
                             f"expected >= 0")
    n_logits = _read_output_buffer(reader, "logits", n_outputs, count_at)
    n_embd = _read_output_buffer(reader, "embeddings", n_outputs, count_at)
    return Outputs(positions, n_logits, n_embd)


@dataclass(frozen=True)
class Framing:
    """What came before the memory section: the framing's name (``BARE``, ``SEQ_BLOB``,
    ``CONTEXT_BLOB``, ``CONTEXT_BLOB_V9`` or a ``SeqFileFormat``'s name), the tokens of a file,
    the source seq id of a llama sequence blob, the architecture name, June-2025's output
    block, the attention KV section's span and whether its cells carry ``KV_CELL_EXT``."""

    name: str
    tokens: np.ndarray | None = None
    source_seq_id: int | None = None
    arch: str | None = None
    kv_offset: int | None = None        # where a hybrid's KV section starts (None: not read)
    section_offset: int = 0             # where the recurrent memory section starts
    outputs: Outputs | None = None
    kv_cell_ext: bool | None = None     # None: no KV section was read
    other_readings: str | None = None   # the defects of the framings the bytes might have been

    @property
    def whole(self) -> bool | None:
        """True when the framing holds the whole cache, False one sequence, None: the bytes say neither."""
        if self.name in (SEQ_BLOB, GGSQ.name, GGSQ_V2.name):
            return False
        if self.name in (CONTEXT_BLOB, CONTEXT_BLOB_V9, GGSN.name, GGSN_V9.name):
            return True
        return None


def _check_whole(name: str, seq_id: int | None) -> None:
    """A framing of the whole cache is read with seq_id -1, one of a sequence with a seq_id >= 0;
    a file's message names the function that loads it."""
    whole = Framing(name).whole
    if seq_id is None or whole is None or whole == (seq_id < 0):
        return
    file = " file" if name in (format.name for format in FILE_FORMATS) else ""
    if whole:
        raise StateError(f"a {name}{file} holds the whole cache: read it with seq_id -1"
                         + (" (load_session_file loads it, not load_seq_file)" if file else ""))
    raise StateError(f"a {name}{file} holds one sequence: read it with a seq_id >= 0, not -1"
                     + (" (load_seq_file loads it, not load_session_file)" if file else ""))


def _read_prefix(reader: Any, prefix: str, arch: str | None,
                 max_tokens: int) -> tuple[int | None, str | None, Outputs | None]:
    """The fields of a blob framing ``prefix`` at the cursor: (source seq id, arch, outputs)."""
    if prefix == SEQ_BLOB:
        (magic, source), at = reader.unpack(SEQ_BLOB_HEADER, "sequence blob header (magic and seq id)")
        if magic != SEQ_BLOB_MAGIC:
            raise StateError(f"sequence blob magic 0x{magic:08x} at byte {at}, expected 0x{SEQ_BLOB_MAGIC:08x}")
        return source, None, None
    if prefix == CONTEXT_BLOB:
        return None, _read_arch(reader, arch), None
    if prefix == CONTEXT_BLOB_V9:
        name = _read_arch(reader, arch)
        return None, name, _read_outputs(reader, max_tokens)
    return None, None, None


def _kv_count_bound(where: str, field: str, value: int, at: int, bound: int, bound_name: str) -> None:
    if value > bound:
        raise StateError(f"{where} {field} {value} at byte {at} is more than {bound_name} {bound}")


def _skip_kv_section(reader: Any, seq_id: int | None, ext: bool, cache: Geometry | None, max_tokens: int) -> None:
    """Step over llama.cpp's attention KV section (docs/llamacpp_formats.md), checking that it
    is whole and, for a sequence (``seq_id >= 0``), that every cell lists exactly one seq id.
    ``ext``: every cell carries ``KV_CELL_EXT`` after its n_seq_id.

    Every count is bounded before what it counts is read: streams and seq ids by the cache's
    sequences (``cache.size``; llama.cpp's KV cache has one stream per sequence at most), layers
    by the model's (``cache.n_layer``), cells by ``max_tokens`` (a KV cell holds a token of the
    context), and the seq ids and rows it steps over by ``MAX_SKIPPED_BYTES``."""
    (n_stream,), at = reader.unpack(KV_STREAMS, "KV section n_stream")
    if cache is not None:
        _kv_count_bound("KV section", "n_stream", n_stream, at, cache.size, "the cache's sequences")
    for stream in range(n_stream):
        where = f"KV section stream {stream}"
        (cell_count,), at = reader.unpack(CELL_COUNT, f"{where} cell_count")
        if cell_count == 0:
            continue
        _kv_count_bound(where, "cell_count", cell_count, at, max_tokens, "max_tokens")
        for i in range(cell_count):
            (_, n_seq_id), at = reader.unpack(CELL, f"{where} cell {i} pos and n_seq_id")
            if seq_id is not None and seq_id >= 0 and n_seq_id != 1:
                raise StateError(f"{where} cell {i} has n_seq_id {n_seq_id} at byte {at + 4} "
                                 f"(a sequence's KV cell lists one seq id)")
            if cache is not None:
                _kv_count_bound(where, f"cell {i} n_seq_id", n_seq_id, at + 4, cache.size, "the cache's sequences")
            if ext:
                reader.unpack(KV_CELL_EXT, f"{where} cell {i} extended position (x, y, token)")
            field = f"{where} cell {i} seq ids"
            reader.skipped = charge_skip(reader.skipped, 4 * n_seq_id, field, reader.offset)
            reader.ids(n_seq_id, field)
        (v_trans, n_layer), at = reader.unpack(KV_DATA_HEADER, f"{where} v_trans and n_layer")
        if v_trans not in (0, 1):
            raise StateError(f"{where} v_trans is {v_trans} at byte {at}, expected 0 or 1")
        if cache is not None:
            _kv_count_bound(where, "n_layer", n_layer, at + 4, cache.n_layer, "the model's layers")
        for il in range(n_layer):
            (_, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} K type and row size")
            reader.step_over(cell_count * row_bytes, f"{where} layer {il} K rows")
        for il in range(n_layer):
            if v_trans:
                (_, element_bytes, n_embd), _ = reader.unpack(
                    KV_V_TRANS_HEADER, f"{where} layer {il} V type, element size and width")
                reader.step_over(n_embd * cell_count * element_bytes, f"{where} layer {il} V rows")
            else:
                (_, row_bytes), _ = reader.unpack(TENSOR_HEADER, f"{where} layer {il} V type and row size")
                reader.step_over(cell_count * row_bytes, f"{where} layer {il} V rows")


# -- telling framings apart: every candidate parsed whole --------------------------------

class _Recording:
    """A stream as a file for a trial parse: reads through the reader (its peeked bytes first)
    and keeps what it read, to be handed back (``give_back``) so the real read sees it again."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.read_bytes = bytearray()

    def read(self, n: int) -> bytes:
        piece: bytes = self.reader.read_up_to(n)
        self.read_bytes += piece
        return piece

    def seekable(self) -> bool:
        return False

    def give_back(self) -> None:
        self.reader.pending = bytes(self.read_bytes) + self.reader.pending


def _discard(piece: bytes) -> None:
    """A trial's rows consumer: a stream's rows are recorded by ``_Recording``, not kept twice."""


def _at_end(reader: Any) -> bool:
    """Whether the reader's cursor is the end of the data."""
    if isinstance(reader, _Reader) or reader.length is not None:
        return bool(reader.offset == reader.length)
    return not reader.read_up_to(1)


@dataclass(frozen=True)
class _Attempt:
    """A candidate's trial parse: whether its framing's own fields fitted, where the memory
    section started, and the defect that stopped it (None: all of it fitted exactly)."""

    framing_parsed: bool
    section_offset: int
    error: StateError | None

    @property
    def parsed(self) -> bool:
        return self.error is None


def _attempt(reader: Any, prefix: str, ext: bool | None, arch: str | None, seq_id: int | None,
             cache: Geometry | None, layers: Sequence[int] | None, watch: Any, max_tokens: int) -> _Attempt:
    """Parse everything from the cursor as framing ``prefix`` (KV cells with ``ext``; None: no KV
    section) without moving the reader: a copy of the cursor in memory, a file read again from
    the same position, or a stream whose bytes are handed back.  ``watch.trial()`` (optional)
    is a fresh watch for the parse: its checks stop a stream's read where the real read would."""
    recording = None
    if isinstance(reader, _Reader):
        trial: Any = _Reader(reader.data[reader.offset:])
    elif reader.length is not None:
        here = reader.file.tell()
        reader.file.seek(here - len(reader.pending))
        trial = _FileReader(reader.file, reader.op)
    else:
        recording = _Recording(reader)
        trial = _FileReader(recording, reader.op, rows=_discard)
    framing_parsed, section_at = False, 0
    try:
        _check_whole(prefix, seq_id)
        _read_prefix(trial, prefix, arch, max_tokens)
        framing_parsed = True
        if ext is not None:
            _skip_kv_section(trial, seq_id, ext, cache, max_tokens)
        section_at = trial.offset
        trial_watch = None if watch is None else watch.trial()
        if cache is None and layers is None:   # which layers hold state is not known: any filter fits
            _parse_any_filter(trial, trial_watch)
        else:
            _parse(trial, cache, -1 if seq_id is None else seq_id, trial_watch, layers)
        if not _at_end(trial):
            raise trailing(trial.offset, trial.length) if trial.length is not None else StateError(
                f"state blob has trailing bytes after byte {trial.offset} (the stream goes on)")
        return _Attempt(True, section_at, None)
    except StateError as exc:
        return _Attempt(framing_parsed, section_at, exc)
    finally:
        if recording is not None:
            recording.give_back()
        elif not isinstance(reader, _Reader):
            reader.file.seek(here)


def _candidate_name(prefix: str, ext: bool | None, exts: Sequence[bool | None]) -> str:
    if len(exts) == 1:
        return prefix
    return f"{prefix} with KV cells {'with' if ext else 'without'} the extended position"


def _pick(reader: Any, prefixes: Sequence[str], exts: Sequence[bool | None], arch: str | None,
          seq_id: int | None, cache: Geometry | None, layers: Sequence[int] | None,
          watch: Any, max_tokens: int) -> tuple[str, bool | None, str | None]:
    """The one candidate (framing prefix, KV cell ext) whose parse fits the bytes exactly, and
    the defects of the other readings that got past their framing's fields (or None).

    Candidates are parsed whole, the last of ``prefixes`` (the default: current llama.cpp's
    framing) last: when every other one fails, the default is the only reading left and the
    section's reader checks it (no second parse, so a stream is read once); the others'
    defects are kept for its message.  Two readings that fit are refused; when none fits and
    more than one got past its framing's fields, the ``StateError`` gives each reading's
    defect (offsets from the cursor); when only one did, it is read, to report its defect.
    """
    combos = [(prefix, ext) for prefix in prefixes for ext in exts]
    if len(combos) == 1:
        return combos[0][0], combos[0][1], None
    default = prefixes[-1]
    attempts: dict[tuple[str, bool | None], _Attempt] = {}
    for prefix, ext in sorted(combos, key=lambda combo: combo[0] == default):
        if prefix == default and len(exts) == 1 and not any(a.parsed for a in attempts.values()):
            others = "; ".join(f"as a {_candidate_name(other, other_ext, exts)}: {attempt.error}"
                               for (other, other_ext), attempt in attempts.items() if attempt.framing_parsed)
            return prefix, ext, others or None
        attempts[prefix, ext] = _attempt(reader, prefix, ext, arch, seq_id, cache, layers, watch, max_tokens)
    fitting = [combo for combo in combos if attempts[combo].parsed]
    if len({(prefix, attempts[prefix, ext].section_offset) for prefix, ext in fitting}) > 1:
        names = " and ".join(f"a {_candidate_name(prefix, ext, exts)}" for prefix, ext in fitting)
        hints = []
        if len({prefix for prefix, _ in fitting}) > 1:
            keys = dict.fromkeys(next((key for key, value in READ_FRAMINGS.items() if value == prefix), "llama")
                                 for prefix, _ in fitting)
            hints.append("framing= (" + " or ".join(map(repr, keys)) + ")")
        if len({ext for _, ext in fitting}) > 1:
            hints.append("kv_cell_ext= (True or False)")
        raise StateError(f"the state is ambiguous: it parses whole as {names}; pass {' and '.join(hints)} "
                         f"to say which")
    if fitting:
        return fitting[0][0], fitting[0][1], None
    started = sorted((combo for combo in combos if attempts[combo].framing_parsed),
                     key=lambda combo: (combo[0] != default, bool(combo[1])))
    if len(started) == 1:
        return started[0][0], started[0][1], None
    if not started:   # every framing failed in its own fields: the first reading's defect
        return combos[0][0], combos[0][1], None
    where = f" from byte {reader.offset}" if reader.offset else ""
    readings = "; ".join(f"as a {_candidate_name(prefix, ext, exts)}: {attempts[prefix, ext].error}"
                         for prefix, ext in started)
    raise StateError(f"the state{where} fits no framing: read {readings}")


def _framing_hint(framing: Any, seq_id: int | None) -> str | None:
    """The framing prefix ``state_read(framing=...)`` names (None: detect it)."""
    if framing is None:
        return None
    if not isinstance(framing, str) or framing not in READ_FRAMINGS:
        raise ArgumentError(f"unknown framing {framing!r} (None to detect it, or one of "
                            f"{', '.join(map(repr, READ_FRAMINGS))})")
    prefix = READ_FRAMINGS[framing]
    if prefix is None:   # current llama.cpp: the sequence header or the architecture string
        if seq_id is None:
            raise ArgumentError("framing='llama' needs a seq_id: a sequence's header or the whole cache's "
                                "architecture string")
        return SEQ_BLOB if seq_id >= 0 else CONTEXT_BLOB
    return prefix


def read_framing(reader: Any, seq_id: int | None, arch: str | None = None, kv_section: bool = False,
                 max_tokens: int = MAX_TOKENS, sequence_file: bool | None = None, cache: Geometry | None = None,
                 framing: str | None = None, kv_cell_ext: bool | None = None,
                 layers: Sequence[int] | None = None, watch: Any = None) -> Framing:
    """Read every framing field up to the recurrent memory section (see ``Framing``).

    ``seq_id`` None: any framing (``inspect``); -1: one of the whole cache; >= 0: one of a
    sequence.  ``sequence_file`` True: a state file is required, False: a blob, None: either.
    ``framing``: a key of ``READ_FRAMINGS`` instead of detecting.  ``kv_cell_ext``: whether a
    KV section's cells carry ``KV_CELL_EXT`` (None: found from the bytes).

    Detection: a state file by its magic and version; a llama sequence blob by its magic; an
    architecture string by its characters (see ``MIN_ARCH``), anything else is a bare section.
    After an architecture string (a blob's; a 'ggsn' file's version says) the i32 is current
    llama.cpp's cell count or June-2025's n_outputs: both readings are parsed whole (``cache``
    and ``layers`` shape the memory section), and the state is read only if exactly one fits
    its length (``_pick``).
    """
    if kv_cell_ext is not None and not isinstance(kv_cell_ext, bool):
        raise ArgumentError(f"kv_cell_ext must be True, False or None (found from the bytes), got {kv_cell_ext!r}")
    tokens = None
    hinted = _framing_hint(framing, seq_id)
    if hinted is not None:
        prefixes = [hinted]
        label = hinted
    else:
        head = reader.peek(4)
        if sequence_file or (sequence_file is None and _file_magic(head)):
            tokens, file_format = _seq_file_header(reader, max_tokens)
            label = file_format.name
            prefixes = [CONTEXT_BLOB_V9 if file_format.outputs else CONTEXT_BLOB if file_format.arch_string
                        else BARE]
        elif len(head) == 4 and struct.unpack("<I", head)[0] == SEQ_BLOB_MAGIC:
            prefixes = [SEQ_BLOB]
        elif _arch_name(reader) is not None:
            prefixes = [CONTEXT_BLOB_V9, CONTEXT_BLOB]
        else:
            prefixes = [BARE]
    exts: list[bool | None] = [None] if not kv_section else [False, True] if kv_cell_ext is None else [kv_cell_ext]
    prefix, ext, others = _pick(reader, prefixes, exts, arch, seq_id, cache, layers, watch, max_tokens)
    if tokens is None:
        label = prefix
    _check_whole(label, seq_id)
    source, name, outputs = _read_prefix(reader, prefix, arch, max_tokens)
    kv_at = None
    if ext is not None:
        kv_at = reader.offset
        _skip_kv_section(reader, seq_id, ext, cache, max_tokens)
    return Framing(label, tokens, source, name, kv_at, reader.offset, outputs, ext, others)


@dataclass(frozen=True)
class Unframed:
    """A blob or file in memory split at its memory section: ``framing`` and ``section``
    (a zero-copy view of the recurrent memory section)."""

    framing: Framing
    section: memoryview


def unframe(data: Any, seq_id: int | None = None, arch: str | None = None, kv_section: bool = False,
            max_tokens: int = MAX_TOKENS, framing: str | None = None, cache: Geometry | None = None,
            kv_cell_ext: bool | None = None) -> Unframed:
    """Find the framing of ``data`` (any of them, see ``read_framing``) without being told which;
    ``StateError`` naming the field and byte offset of a damaged header.  ``kv_section``: the
    state is a hybrid model's, whose memory begins with an attention KV section (skipped).
    ``framing``: a key of ``READ_FRAMINGS``; "bare": ``data`` is a memory section, nothing is
    detected.  ``cache``: the geometry the section is read into (it decides which readings fit)."""
    reader = _Reader(blob_view(data))
    if framing == "bare" and not kv_section:
        return Unframed(Framing(BARE), reader.data)
    found = read_framing(reader, seq_id, arch, kv_section, max_tokens, cache=cache, framing=framing,
                         kv_cell_ext=kv_cell_ext)
    return Unframed(found, reader.data[reader.offset:])


def in_section(exc: StateError, framing: Framing) -> StateError:
    """A defect of the memory section, placed in the framed bytes (with the other readings'
    defects when another framing was possible)."""
    others = f" (read otherwise it fails too: {framing.other_readings})" if framing.other_readings else ""
    if not framing.section_offset:
        return StateError(f"{exc}{others}") if others else exc
    return StateError(f"the state blob at byte {framing.section_offset}: {exc}{others}")


@dataclass(frozen=True)
class FileContents:
    """A state blob or file, read and checked."""

    tokens: np.ndarray | None    # a state file's tokens (int32); None for a blob
    blob_offset: int             # where the recurrent memory section starts in the file
    blob: Blob
    data: Any                    # the section's bytes (bytes-like); None when read with ``rows``
    framing: Framing


def read_file(file: Any, op: str, cache: Geometry | None = None, seq_id: int | None = -1,
              sequence_file: bool | None = None, watch: Any = None, rows: Any = None,
              max_tokens: int = MAX_TOKENS, arch: str | None = None, kv_section: bool = False,
              framing: str | None = None, kv_cell_ext: bool | None = None,
              layers: Sequence[int] | None = None, infer_layers: bool = False) -> FileContents:
    """Read a blob (``sequence_file=False``), a state file (True) or either (None: by its magic)
    in any framing (``read_framing``) from a binary file's position to its end, with every
    check of ``parse_blob`` on its memory section.

    Only what the headers claim is read, and one byte more to prove the file
    ends there: ``/dev/zero``, an endless FIFO or a huge file with a short
    header are rejected after a few bytes.  With ``cache`` the claims are
    checked against the cache on the way (a sequence blob of one cell, the
    cache's row sizes), so no more than the cache's own state is ever read.
    A defect of the memory section is reported at its offset in the file;
    a state file with more than ``max_tokens`` tokens is refused at its header.
    ``watch`` and ``rows`` are for ``inspect`` (``seq_id`` None: any framing): ``watch`` sees
    the headers before any row (see ``_parse``), ``rows(piece)`` takes the rows as they are
    read, which are then not kept (``data`` is None).  ``layers``: without ``cache``, the
    layers whose r and s sections the memory section holds (a hybrid's; None: every layer);
    ``infer_layers``: without either, a section with no layer's rows is read (see ``_parse``).
    Telling a bare section from a June-2025 context blob reads a stream's blob twice (the
    first time kept in memory).
    """
    _check_file(file, op, "read", "reading")
    reader = _FileReader(file, op, rows)
    found = read_framing(reader, seq_id, arch, kv_section, max_tokens, sequence_file, cache, framing,
                         kv_cell_ext, layers, watch)
    blob_offset = reader.offset
    reader.rebase()
    try:
        blob = _parse(reader, cache, -1 if seq_id is None else seq_id, watch, layers, infer_layers)
        data = reader.finish()
    except StateError as exc:
        raise in_section(exc, found) from None
    return FileContents(found.tokens, blob_offset, blob, data, found)

