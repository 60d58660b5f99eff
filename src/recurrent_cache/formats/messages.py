"""The wording of every defect of a state blob, and the blob error codes' exceptions.

Both engines report the same defect with the same message: ``formats.blob`` raises these
builders' exceptions as it parses, and the compiled core's ``check_blob`` reports a code
(``errors.BLOB_*``) plus where, which ``engine_error`` turns into the same ``StateError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import errors
from ..errors import ArgumentError, StateError
from .dtypes import GGML_TYPES

__all__ = [
    "tensor_name", "field_name", "type_name", "truncated", "trailing", "sequence_cell_count", "cell_count_too_large",
    "negative_pos", "sequence_n_seq_id", "no_seq_id", "n_seq_id_too_large", "seq_id_out_of_range", "seq_id_repeated",
    "v_trans_set", "n_layer_mismatch", "type_mismatch", "row_bytes_mismatch", "target_too_small",
    "target_aliases_cache", "BLOB_CODES", "engine_error",
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
