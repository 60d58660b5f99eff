"""The C API's function table (recurrent_cache/capi.h), reached from Python through ctypes.

Lets the tests call every entry with hostile arguments (NULL handles, bad lengths,
bad offsets) without compiling anything: the capsule's pointer is the very table a
C extension's ``import_recurrent_cache()`` gets.  ``ctx_new`` / ``ctx_free`` run with
the GIL (PYFUNCTYPE); the rest release it, as C callers do (``error_message`` takes it).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import recurrent_cache
from recurrent_cache import _capi

HEADER = Path(recurrent_cache.get_include()) / "recurrent_cache" / "capi.h"

i32, u32, i64, size_t = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_size_t
P = ctypes.c_void_p
i32p, i8p, i64p = ctypes.POINTER(i32), ctypes.POINTER(ctypes.c_int8), ctypes.POINTER(i64)
C = ctypes.CFUNCTYPE


class Ubatch(ctypes.Structure):
    _fields_ = [("index", i32), ("head", i32), ("n_seqs", i32), ("n_seq_tokens", i32), ("n_tokens", i32),
                ("first_output", i32), ("n_outputs", i32), ("token_order", i32p),
                ("output", ctypes.POINTER(ctypes.c_uint8))]


class Table(ctypes.Structure):
    _fields_ = [
        ("abi_version", u32), ("api_version", u32),
        ("ctx_new", ctypes.PYFUNCTYPE(P, ctypes.py_object)),
        ("ctx_free", ctypes.PYFUNCTYPE(ctypes.c_int, P)),
        ("error_message", C(ctypes.c_int, P, ctypes.c_int, ctypes.c_char_p, size_t)),
        ("size", C(i32, P)), ("n_layer", C(i32, P)), ("used", C(i32, P)),
        ("tensor", C(ctypes.c_int, P, i32, ctypes.POINTER(P), ctypes.POINTER(size_t))),
        ("batch_init", C(ctypes.c_int, P, i32, i32p, i32p, i32p, i8p, i32, u32, ctypes.POINTER(P))),
        ("batch_apply", C(ctypes.c_int, P, ctypes.POINTER(Ubatch))),
        ("batch_n_ubatches", C(i32, P)),
        ("batch_out_ids", C(i64p, P, i32p)),
        ("batch_release", C(None, P)),
        ("seq_rm", C(ctypes.c_int, P, i32, i32, i32)),
        ("seq_cp", C(ctypes.c_int, P, i32, i32)),
        ("seq_keep", C(ctypes.c_int, P, i32)),
        ("seq_add", C(ctypes.c_int, P, i32, i32, i32, i32)),
        ("seq_div", C(ctypes.c_int, P, i32, i32, i32, i32)),
        ("seq_pos_min", C(i32, P, i32)), ("seq_pos_max", C(i32, P, i32)),
        ("clear", C(ctypes.c_int, P)),
        ("state_size", C(ctypes.c_int, P, i32, ctypes.POINTER(size_t))),
        ("state_write", C(ctypes.c_int, P, i32, P, size_t, ctypes.POINTER(size_t))),
        ("state_read", C(ctypes.c_int, P, i32, P, size_t)),
        # API version 2: rollback
        ("n_rollback", C(i32, P)),
        ("seq_rollback_min", C(i32, P, i32)),
        ("batch_n_steps", C(i32, P)),
        ("batch_step_row", C(ctypes.c_int, P, i32, i32, i32, ctypes.POINTER(P))),
        # API version 3: a HybridCache's context
        ("n_attn", C(i32, P)), ("attn_layer", C(i32, P, i32)),
        ("kv_size", C(i32, P)), ("kv_used", C(i32, P)),
        ("kv_tensor", C(ctypes.c_int, P, i32, i32, ctypes.POINTER(P), i32p, ctypes.POINTER(size_t),
                        ctypes.POINTER(ctypes.c_int))),
        ("batch_kv_cells", C(ctypes.c_int, P, ctypes.POINTER(i32p), i32p)),
        ("batch_kv_mask", C(ctypes.c_int, P, i32, ctypes.POINTER(ctypes.c_float), size_t)),
        ("seq_cp_range", C(ctypes.c_int, P, i32, i32, i32, i32)),
        ("kv_has_shift", C(i32, P)),
        ("kv_shifts", C(ctypes.c_int, P, ctypes.POINTER(i32p))),
        ("kv_reset_shift", C(ctypes.c_int, P)),
    ]


def capsule_pointer(capsule: object, name: bytes) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = P, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)  # type: ignore[no-any-return]


def table() -> Table:
    # the capsule is the C API's published table (its underscore keeps it out of the Python API)
    return Table.from_address(capsule_pointer(_capi._C_API, b"recurrent_cache._capi._C_API"))  # noqa: SLF001


def header_codes() -> dict[str, int]:
    """Every ``#define RC_ERR_*`` / ``RC_OK`` of the header with its value."""
    found = re.findall(r"#define (RC_(?:ERR_\w+|OK))\s+\(?(-?\d+)\)?", HEADER.read_text())
    return {name: int(value) for name, value in found}


def ints(values: list[int]) -> ctypes.Array:
    return (i32 * max(1, len(values)))(*values)


def message(t: Table, ctx: int | None, code: int) -> str:
    buffer = ctypes.create_string_buffer(1024)
    n = t.error_message(ctx, code, buffer, len(buffer))
    assert n == len(buffer.value), (n, buffer.value)
    return buffer.value.decode()
