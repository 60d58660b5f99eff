"""``python -m recurrent_cache inspect FILE``: describe a state blob or a 'ggsq' sequence file.

Needs no cache: the blob is parsed on its own, so any blob llama.cpp or this
package wrote can be examined, whatever its shapes.  Prints the cells (pos,
seq ids), every tensor section (type, row size, min / max / mean of the
values, a checksum of the bytes), whether the blob holds one sequence or a
whole cache, and the smallest cache that reads it.

A blob is reported only when some ``RecurrentCache`` (within the
constructor's limits) accepts it in ``state_read``: every r tensor has one
known type and a row size of whole elements, every s tensor too, and the
cells pass ``parse_blob`` against the smallest such cache - size 1 for a
sequence blob; for a whole-cache blob the largest of its cell count and its
largest seq id + 1.  Anything else is a one-line error and exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from typing import Any, NoReturn

import numpy as np

from .errors import RecurrentCacheError, StateError
from ._args import INT32_END
from .state_format import GGML_TYPES, GGSQ, MAX_TOKENS, STATE_TYPES, BlobCell, check_cells, read_file

__all__ = ["main", "describe", "describe_file"]

_LIMIT = INT32_END - 1   # the constructor's largest size, n_layer and n_embd
_BF16 = STATE_TYPES["bf16"].type_id   # stored as the upper half of a float32, widened by hand


class _TensorSummary:
    """Checksum and min / max / mean of one tensor section, fed piece by piece."""

    def __init__(self, k: int, n_layer: int, type_id: int, row_bytes: int, offset: int) -> None:
        self.type_id = type_id
        self.dtype = GGML_TYPES[type_id].bits
        self.sha256 = hashlib.sha256()
        self.carry = b""          # an element split between two pieces
        self.non_finite = 0
        self.n_finite = 0
        self.total = 0.0
        self.min: float | None = None
        self.max: float | None = None
        self.summary: dict[str, Any] = {
            "tensor": f"layer {k % n_layer} {'r' if k < n_layer else 's'}", "type": GGML_TYPES[type_id].name,
            "type_id": type_id, "row_bytes": row_bytes, "n_embd": row_bytes // self.dtype.itemsize,
            "offset": offset}

    def feed(self, piece: bytes) -> None:
        self.sha256.update(piece)
        data = self.carry + piece
        whole = len(data) - len(data) % self.dtype.itemsize
        self.carry = data[whole:]
        stored = np.frombuffer(data, dtype=self.dtype, count=whole // self.dtype.itemsize)
        if self.type_id == _BF16:
            values = (stored.astype(np.uint32) << 16).view(np.float32)
        else:
            values = stored.astype(np.float32)
        finite = values[np.isfinite(values)]
        self.non_finite += values.size - finite.size
        if finite.size:
            low, high = float(finite.min()), float(finite.max())
            self.min = low if self.min is None else min(self.min, low)
            self.max = high if self.max is None else max(self.max, high)
            self.total += float(finite.astype(np.float64).sum())
            self.n_finite += finite.size

    def result(self) -> dict[str, Any]:
        return {**self.summary, "sha256": self.sha256.hexdigest(), "min": self.min, "max": self.max,
                "mean": self.total / self.n_finite if self.n_finite else None,
                "non_finite": self.non_finite}


class _Inspection:
    """Watches a blob as ``state_format.read_file`` reads it: finds the smallest cache that
    reads it, or raises before a row is read; then summarises the rows as they stream by.

    A blob with no seq ids is a sequence blob (read with any seq_id, size 1
    suffices); otherwise a whole-cache blob (seq_id -1, size = the largest of
    its cell count and its largest seq id + 1).  Its cells must pass the cell
    rules of ``parse_blob`` for that size; every r tensor must have one known
    type and a row size of 1 to 2**31 - 1 whole elements, every s tensor too.
    """

    def __init__(self) -> None:
        self.n_layer = 0
        self.fits: dict[str, Any] = {}
        self.tensors: list[_TensorSummary] = []

    def cells(self, cells: tuple[BlobCell, ...]) -> None:
        sequence = not any(cell.seq_ids for cell in cells)
        largest_id = max((seq for cell in cells for seq in cell.seq_ids), default=-1)
        size = 1 if sequence else min(max(1, len(cells), largest_id + 1), _LIMIT)
        check_cells(cells, size, 0 if sequence else -1)
        self.fits.update(size=size, seq_id=0 if sequence else -1)

    def layers(self, n_layer: int, offset: int) -> None:
        if n_layer > _LIMIT:
            raise StateError(f"state blob has n_layer {n_layer} at byte {offset}, more than a cache's {_LIMIT}")
        self.n_layer = n_layer
        self.fits.update(n_layer=n_layer, n_embd_r=None, n_embd_s=None, dtype_r=None, dtype_s=None)

    def tensor(self, k: int, type_id: int, row_bytes: int, offset: int) -> None:
        name, layer = ("r", k) if k < self.n_layer else ("s", k - self.n_layer)
        if type_id not in GGML_TYPES:
            raise StateError(f"state blob layer {layer} {name} has type {type_id} at byte {offset}: "
                             f"a cache stores {' or '.join(f'{t.name} ({t.type_id})' for t in GGML_TYPES.values())}")
        type_name, itemsize = GGML_TYPES[type_id].name, GGML_TYPES[type_id].itemsize
        if layer == 0:
            if row_bytes % itemsize or not 1 <= row_bytes // itemsize <= _LIMIT:
                raise StateError(f"state blob layer 0 {name} row size {row_bytes} at byte {offset + 4} is "
                                 f"not n_embd x {itemsize} bytes ({type_name}) with n_embd in [1, {_LIMIT}]")
            self.fits.update({f"dtype_{name}": type_name, f"n_embd_{name}": row_bytes // itemsize})
        elif (type_name, row_bytes) != (self.fits[f"dtype_{name}"], self.fits[f"n_embd_{name}"] * itemsize):
            raise StateError(f"state blob layer {layer} {name} is {type_name} with row size {row_bytes} at "
                             f"byte {offset}, layer 0 {name} is {self.fits[f'dtype_{name}']} with n_embd "
                             f"{self.fits[f'n_embd_{name}']}: a cache has one {name} type and row size "
                             f"for every layer")
        self.tensors.append(_TensorSummary(k, self.n_layer, type_id, row_bytes, offset + 12))

    def rows(self, piece: bytes) -> None:
        self.tensors[-1].feed(piece)


def describe_file(file: Any, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Everything ``inspect`` reports about the blob or sequence file at a binary file's position.

    Reads only what the headers claim (``state_format.read_file``) and keeps
    only the cells in memory; raises a ``RecurrentCacheError`` for anything no
    cache's ``state_read`` accepts, before reading the rows of a header that
    no cache could hold.
    """
    inspection = _Inspection()
    try:
        contents = read_file(file, "inspect", watch=inspection, rows=inspection.rows, max_tokens=max_tokens)
    except StateError as exc:
        raise StateError(f"not a valid state blob or sequence file: {exc}") from None
    blob = contents.blob
    return {
        "format": "state blob" if contents.tokens is None else f"sequence file ({GGSQ.name})",
        "tokens": None if contents.tokens is None else contents.tokens.tolist(),
        "blob_offset": contents.blob_offset, "blob_bytes": blob.n_bytes, "kind": blob.kind,
        "cell_count": blob.cell_count, "n_layer": blob.n_layer, "reads_into": inspection.fits,
        "cells": [{"pos": cell.pos, "seq_ids": list(cell.seq_ids)} for cell in blob.cells],
        "tensors": [tensor.result() for tensor in inspection.tensors]}


def describe(data: Any) -> dict[str, Any]:
    """``describe_file`` of a blob or sequence file in memory."""
    return describe_file(io.BytesIO(data))


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _print_report(path: str, report: dict[str, Any], max_cells: int) -> None:
    print(f"{path}: {report['format']}")
    if report["tokens"] is not None:
        tokens = report["tokens"]
        shown = ", ".join(map(str, tokens[:16])) + (", ..." if len(tokens) > 16 else "")
        print(f"tokens: {len(tokens)} [{shown}]")
    print(f"blob: {report['blob_bytes']} bytes at byte {report['blob_offset']}, {report['kind']}"
          f"{' (0 cells: either kind)' if report['kind'] == 'empty' else ''}")
    cells = report["cells"]
    print(f"cells: {len(cells)}")
    for i, cell in enumerate(cells if max_cells <= 0 else cells[:max_cells]):
        ids = " ".join(map(str, cell["seq_ids"])) or "- (a sequence blob's cell)"
        print(f"  cell {i:>5}  pos {cell['pos']:>10}  seq ids {ids}")
    if 0 < max_cells < len(cells):
        print(f"  ... {len(cells) - max_cells} more (--max-cells 0 lists all)")
    print(f"reads into: {_fits(report['reads_into'])}")
    print(f"layers: {report['n_layer']} (v_trans 0)")
    print(f"  {'tensor':<12} {'type':<6} {'row bytes':>10} {'n_embd':>7} {'min':>12} {'max':>12} "
          f"{'mean':>12}  sha256")
    for t in report["tensors"]:
        extra = f"  ({t['non_finite']} non-finite values)" if t["non_finite"] else ""
        print(f"  {t['tensor']:<12} {t['type']:<6} {t['row_bytes']:>10} "
              f"{t['n_embd']:>7} {_number(t['min']):>12} "
              f"{_number(t['max']):>12} {_number(t['mean']):>12}  {t['sha256'][:16]}{extra}")


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        print(f"inspect: {message} (try --help)", file=sys.stderr)
        sys.exit(2)


def _fits(fits: dict[str, Any]) -> str:
    shape = ", ".join(f"{key}={fits[key]!r}" for key in ("n_layer", "n_embd_r", "n_embd_s", "dtype_r", "dtype_s")
                      if fits[key] is not None)
    how = "seq_id -1" if fits["seq_id"] == -1 else "any seq_id"
    return f"RecurrentCache({shape}, size >= {fits['size']}), state_read with {how}"


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m recurrent_cache inspect",
                     description="Describe a state blob (state_write) or a 'ggsq' sequence file "
                                 "(llama_state_seq_save_file); exit status 1 unless a cache's "
                                 "state_read accepts it.")
    parser.add_argument("file", help="the blob or sequence file")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--max-cells", type=int, default=32, metavar="N",
                        help="list at most N cells (default 32; 0 lists all)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, metavar="N",
                        help=f"refuse a sequence file of more than N tokens (default {MAX_TOKENS})")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open(options.file, "rb") as file:
            report = describe_file(file, options.max_tokens)
    except RecurrentCacheError as exc:   # before ValueError: StateError and ArgumentError are ValueErrors
        print(f"inspect: {options.file}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:   # ValueError: a path with a NUL character
        print(f"inspect: cannot read {options.file!r}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"inspect: {options.file}: not enough memory to read it", file=sys.stderr)
        return 1
    try:
        if options.json:
            print(json.dumps({"file": options.file, **report}, indent=1))
        else:
            _print_report(options.file, report, options.max_cells)
        sys.stdout.flush()
    except BrokenPipeError:   # `inspect FILE | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
