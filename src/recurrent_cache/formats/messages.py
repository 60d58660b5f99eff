"""The wording of every defect of the state formats, and the blob error codes' exceptions.

Both engines report the same defect of a memory section with the same message: ``formats.blob``
raises these builders' exceptions as it parses, and the compiled core's ``check_blob`` reports
a code (``errors.BLOB_*``) plus where, which ``engine_error`` turns into the same ``StateError``.
The defects of the framings around a section (a state file's header, the architecture string,
June-2025's output block, a hybrid's KV section, a stream) are worded here too; only the
messages that combine other readings' defects (an ambiguous state, one that fits no framing)
are put together where the readings are compared, in ``formats.framings``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import errors
from ..errors import ArgumentError, StateError
from .dtypes import GGML_TYPES
from .layouts import GGSN, GGSQ, MAX_ARCH, MAX_SKIPPED_BYTES, MIN_ARCH, SEQ_BLOB_MAGIC

__all__ = [
    "tensor_name", "field_name", "type_name", "truncated", "trailing", "sequence_cell_count", "cell_count_too_large",
    "negative_pos", "sequence_n_seq_id", "no_seq_id", "n_seq_id_too_large", "seq_id_out_of_range", "seq_id_repeated",
    "v_trans_set", "n_layer_mismatch", "type_mismatch", "row_bytes_mismatch", "target_too_small",
    "target_aliases_cache", "skip_cap", "filter_past_n_layer", "not_a_state_type", "odd_tensor_sections",
    "stream_trailing", "stream_goes_on", "file_shrank", "file_header_truncated", "not_a_state_file", "file_version",
    "too_many_tokens", "tokens_truncated", "arch_not_a_name", "arch_mismatch", "output_buffer_size",
    "negative_outputs", "too_many_outputs", "negative_output_position", "wrong_seq_id_for_framing", "seq_blob_magic",
    "kv_count_too_large", "kv_sequence_n_seq_id", "kv_v_trans", "BLOB_CODES", "engine_error",
]


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


def target_too_small(available: int, needed: int) -> ArgumentError:
    return ArgumentError(f"state_write_into: the target has {available} bytes, the blob needs {needed}")


def target_aliases_cache() -> ArgumentError:
    return ArgumentError("state_write_into: the target shares memory with the cache's state tensors "
                         "(writing the blob there would overwrite the rows it is made of)")


# -- the framings around a memory section (formats.framings, formats.streams) -----------------

def skip_cap(field: str, offset: int, n: int, skipped: int) -> StateError:
    before = f" after {skipped} bytes already stepped over" if skipped else ""
    return StateError(f"{field} at byte {offset} claims {n} bytes to step over{before}, more than "
                      f"MAX_SKIPPED_BYTES ({MAX_SKIPPED_BYTES}) of framing the cache does not read")


def filter_past_n_layer(n_layer: int, offset: int, layer: int) -> StateError:
    return StateError(f"state blob has n_layer {n_layer} at byte {offset}, but the layer filter names "
                      f"layer {layer}")


def not_a_state_type(k: int, type_id: int, offset: int) -> StateError:
    return StateError(f"state blob tensor section {k} has type {type_id} at byte {offset}, "
                      f"not a state type")


def odd_tensor_sections(k: int) -> StateError:
    return StateError(f"state blob ends after {k} tensor sections: a layer filter keeps r and s of the "
                      f"same layers (an even number)")


def stream_trailing(end: int, grew: bool) -> StateError:
    """Bytes after what the headers claim: a file that grew while it was read, or a stream."""
    return StateError(f"state blob has trailing bytes after byte {end} "
                      + ("(the file grew while it was read)" if grew else
                         f"(the stream goes on past the {end} bytes its headers claim)"))


def stream_goes_on(offset: int) -> StateError:
    return StateError(f"state blob has trailing bytes after byte {offset} (the stream goes on)")


def file_shrank(got: int, end: int) -> StateError:
    return StateError(f"state blob truncated: the file shrank to {got} of {end} bytes while it was read")


def file_header_truncated(length: int, need: int) -> StateError:
    return StateError(f"sequence file truncated: {length} bytes, the header needs {need}")


def not_a_state_file(magic: int, offset: int) -> StateError:
    return StateError(f"not a sequence file: magic 0x{magic:08x} at byte {offset}, "
                      f"expected 0x{GGSQ.magic:08x} ('ggsq') or 0x{GGSN.magic:08x} ('ggsn')")


def file_version(magic: int, version: int, offset: int, versions: Sequence[int]) -> StateError:
    kind = "sequence file" if magic == GGSQ.magic else "session file"
    return StateError(f"{kind} version {version} at byte {offset}, "
                      f"expected {' or '.join(str(known) for known in versions)}")


def too_many_tokens(n_tokens: int, count_at: int, max_tokens: int) -> StateError:
    return StateError(f"sequence file has {n_tokens} tokens (count at byte {count_at}), more than "
                      f"max_tokens {max_tokens}")


def tokens_truncated(n_tokens: int, count_at: int, need: int, left: int) -> StateError:
    return StateError(f"sequence file truncated: {n_tokens} tokens (count at byte {count_at}) need {need} bytes, "
                      f"{left} left")


def arch_not_a_name(offset: int, length: int) -> StateError:
    return StateError(f"the architecture string at byte {offset} is not a name (length {length}, "
                      f"expected {MIN_ARCH} to {MAX_ARCH} lower-case letters, digits, '-', '_', '.')")


def arch_mismatch(name: str, offset: int, arch: str) -> StateError:
    return StateError(f"state is for architecture {name!r} (string at byte {offset}), "
                      f"the caller's model is {arch!r}")


def output_buffer_size(name: str, size: int, offset: int, n_outputs: int, count_at: int) -> StateError:
    return StateError(f"the output block's {name} size {size} at byte {offset} is not a multiple of n_outputs "
                      f"{n_outputs} (at byte {count_at}): June-2025 llama.cpp writes n_outputs x the width, or 0")


def negative_outputs(n_outputs: int, offset: int) -> StateError:
    return StateError(f"the output block's n_outputs is {n_outputs} at byte {offset}, expected >= 0")


def too_many_outputs(n_outputs: int, offset: int, max_tokens: int) -> StateError:
    return StateError(f"the output block's n_outputs {n_outputs} at byte {offset} is more than max_tokens "
                      f"{max_tokens} (each output is a token of the batch)")


def negative_output_position(i: int, position: int, offset: int) -> StateError:
    return StateError(f"the output block's output {i} has batch position {position} at byte {offset}, "
                      f"expected >= 0")


def wrong_seq_id_for_framing(name: str, file: bool, whole: bool) -> StateError:
    """A framing of the whole cache read with a seq_id >= 0, or one of a sequence with -1; a
    file's message names the function that loads it."""
    kind = f"{name} file" if file else name
    if whole:
        return StateError(f"a {kind} holds the whole cache: read it with seq_id -1"
                          + (" (load_session_file loads it, not load_seq_file)" if file else ""))
    return StateError(f"a {kind} holds one sequence: read it with a seq_id >= 0, not -1"
                      + (" (load_seq_file loads it, not load_session_file)" if file else ""))


def seq_blob_magic(magic: int, offset: int) -> StateError:
    return StateError(f"sequence blob magic 0x{magic:08x} at byte {offset}, expected 0x{SEQ_BLOB_MAGIC:08x}")


def kv_count_too_large(where: str, field: str, value: int, offset: int, bound: int, bound_name: str) -> StateError:
    return StateError(f"{where} {field} {value} at byte {offset} is more than {bound_name} {bound}")


def kv_sequence_n_seq_id(where: str, cell: int, n_seq_id: int, offset: int) -> StateError:
    return StateError(f"{where} cell {cell} has n_seq_id {n_seq_id} at byte {offset} "
                      f"(a sequence's KV cell lists one seq id)")


def kv_v_trans(where: str, v_trans: int, offset: int) -> StateError:
    return StateError(f"{where} v_trans is {v_trans} at byte {offset}, expected 0 or 1")


def _tensor(d: dict[str, Any]) -> str:
    return tensor_name(d["index"], d["n_layer"])


# Blob code -> its StateError, from the values the core recorded (``engine_error``'s ``detail``).
_BLOB_DEFECTS: dict[int, Callable[[dict[str, Any]], StateError]] = {
    errors.BLOB_TRUNCATED: lambda d: truncated(field_name(d["field"], d["cell"], d["index"], d["n_layer"]),
                                               d["offset"], d["need"], d["length"]),
    errors.BLOB_TRAILING: lambda d: trailing(d["offset"], d["length"]),
    errors.BLOB_SEQ_CELL_COUNT: lambda d: sequence_cell_count(d["value"]),
    errors.BLOB_CELL_COUNT: lambda d: cell_count_too_large(d["value"], d["size"]),
    errors.BLOB_POSITION: lambda d: negative_pos(d["cell"], d["offset"], d["value"]),
    errors.BLOB_SEQ_N_SEQ_ID: lambda d: sequence_n_seq_id(d["cell"], d["offset"], d["value"]),
    errors.BLOB_NO_SEQ_ID: lambda d: no_seq_id(d["cell"], d["offset"]),
    errors.BLOB_N_SEQ_ID: lambda d: n_seq_id_too_large(d["cell"], d["offset"], d["value"], d["size"]),
    errors.BLOB_SEQ_ID_RANGE: lambda d: seq_id_out_of_range(d["cell"], d["offset"], d["value"], d["size"]),
    errors.BLOB_SEQ_ID_REPEATED: lambda d: seq_id_repeated(d["cell"], d["offset"], d["value"], d["other"]),
    errors.BLOB_V_TRANS: lambda d: v_trans_set(d["offset"], d["value"]),
    errors.BLOB_N_LAYER: lambda d: n_layer_mismatch(d["offset"], d["value"], d["n_layer"]),
    errors.BLOB_TYPE: lambda d: type_mismatch(_tensor(d), d["offset"], d["value"], d["expected"]),
    errors.BLOB_ROW_BYTES: lambda d: row_bytes_mismatch(_tensor(d), d["offset"], d["value"], d["expected"]),
}
BLOB_CODES = frozenset(_BLOB_DEFECTS)


def engine_error(code: int, **detail: Any) -> Exception:
    """The exception for any engine failure ``code``: a blob defect (one of ``BLOB_CODES``) is the
    ``StateError`` worded here from the values the core recorded (field, offset, need, length,
    cell, index, other, value, size, n_layer, expected); every other code is worded by
    ``errors.engine_error``, which knows no format."""
    defect = _BLOB_DEFECTS.get(code)
    return errors.engine_error(code, **detail) if defect is None else defect(detail)
