"""Every fixed run of fields of the state formats, named once, with the magics and limits.

A blob (docs/concepts.md §5), all integers little-endian::

    u32 cell_count
    cell_count x { i32 pos; u32 n_seq_id; n_seq_id x i32 seq_id }   # meta
    u32 v_trans (= 0); u32 n_layer
    n_layer x { i32 r_type; u64 r_row_bytes; cell_count rows of r }
    n_layer x { i32 s_type; u64 s_row_bytes; cell_count rows of s }

With a layer filter (``Geometry.layers``, a hybrid model's recurrent layers) ``n_layer`` stays
the model's layer count and the r, then the s, sections are those of the filtered layers only,
in layer order (llama.cpp skips its null layers).

The framings current llama.cpp puts around that memory section (docs/llamacpp_formats.md) are
data here too: the state files (``SeqFileFormat``: ``GGSQ`` version 3, ``GGSQ_V2``, ``GGSN``,
``GGSN_V9``), the names of the framings of a blob without tokens (``BARE``, ``SEQ_BLOB``,
``CONTEXT_BLOB``, ``CONTEXT_BLOB_V9``), ``SEQ_BLOB_HEADER``, the architecture string, June-2025's
output block and a hybrid's attention KV section (cells with or without ``KV_CELL_EXT``).
Another framing is one more instance here and a reading in ``formats.framings``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "Layout", "CELL_COUNT", "CELL", "DATA_HEADER", "TENSOR_HEADER", "SeqFileFormat", "FILE_HEADER", "GGSQ",
    "GGSQ_V2", "GGSN", "GGSN_V9", "FILE_FORMATS", "BARE", "SEQ_BLOB", "CONTEXT_BLOB", "CONTEXT_BLOB_V9",
    "READ_FRAMINGS", "OUTPUT_COUNT", "OUTPUT_BUFFER", "SEQ_BLOB_HEADER", "SEQ_BLOB_MAGIC", "ARCH_LENGTH",
    "MIN_ARCH", "MAX_ARCH", "ARCH_CHARS", "KV_STREAMS", "KV_DATA_HEADER", "KV_V_TRANS_HEADER", "KV_CELL_EXT",
    "MAX_INFERRED_LAYERS", "MAX_TOKENS", "MAX_SKIPPED_BYTES",
]


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


FILE_HEADER = Layout(("magic", "I"), ("version", "I"), ("n_token_count", "I"))
# llama.cpp's llama_state_seq_save_file: LLAMA_STATE_SEQ_MAGIC 'ggsq', LLAMA_STATE_SEQ_VERSION 3
# (llama.cpp 0c1e57098); version 2 (June 2025) has the same bytes and is still read.
GGSQ = SeqFileFormat("'ggsq' version 3", FILE_HEADER, 0x67677371, 3)
GGSQ_V2 = SeqFileFormat("'ggsq' version 2", FILE_HEADER, 0x67677371, 2)
# llama_state_save_file: LLAMA_SESSION_MAGIC 'ggsn', LLAMA_SESSION_VERSION 10: tokens, then
# exactly a llama_state_get_data blob (the architecture string, the whole memory section).
GGSN = SeqFileFormat("'ggsn' version 10", FILE_HEADER, 0x6767736e, 10, whole=True, arch_string=True)
# LLAMA_SESSION_VERSION 9 (June 2025): tokens, then that llama.cpp's llama_state_get_data blob
# (the architecture string, the output block, then the whole memory section).
GGSN_V9 = SeqFileFormat("'ggsn' version 9", FILE_HEADER, 0x6767736e, 9, whole=True, arch_string=True,
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
ARCH_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")

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
