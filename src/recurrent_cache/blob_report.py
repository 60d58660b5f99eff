"""``python -m recurrent_cache inspect FILE``: describe a state blob or a 'ggsq' sequence file.

Needs no cache: the blob is parsed on its own (``state_format.parse_blob``),
so any blob llama.cpp or this package wrote can be examined, whatever its
shapes.  Prints the cells (pos, seq ids), every tensor section (type, row
size, min / max / mean of the values, a checksum of the bytes) and whether
the blob holds one sequence or a whole cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from typing import Any

import numpy as np

from .errors import RecurrentCacheError
from .state_format import SEQ_FILE_MAGIC, Blob, BlobTensor, parse_blob, parse_seq_file_header

__all__ = ["main", "describe"]

_DECODE = {0: "<f4", 1: "<f2"}   # ggml type id -> numpy dtype; bf16 (30) is widened by hand


def _values(rows: np.ndarray, tensor: BlobTensor) -> np.ndarray | None:
    """The rows as float32 values, or None for a type this package does not know."""
    if tensor.n_embd is None:
        return None
    if tensor.type_id == 30:   # bf16: the upper half of a float32
        return (rows.view("<u2").astype(np.uint32) << 16).view(np.float32)
    return rows.view(_DECODE[tensor.type_id]).astype(np.float32)


def _tensor_summary(blob: Blob, data: Any, tensor: BlobTensor) -> dict[str, Any]:
    rows = blob.rows(data, tensor)
    summary: dict[str, Any] = {
        "tensor": f"layer {tensor.layer} {tensor.name}", "type": tensor.type_name,
        "type_id": tensor.type_id, "row_bytes": tensor.row_bytes, "n_embd": tensor.n_embd,
        "offset": tensor.offset, "sha256": hashlib.sha256(rows.tobytes()).hexdigest(),
        "min": None, "max": None, "mean": None, "non_finite": 0,
    }
    values = _values(rows, tensor)
    if values is not None and values.size:
        finite = values[np.isfinite(values)]
        summary["non_finite"] = int(values.size - finite.size)
        if finite.size:
            summary.update(min=float(finite.min()), max=float(finite.max()),
                           mean=float(finite.astype(np.float64).mean()))
    return summary


def describe(data: bytes) -> dict[str, Any]:
    """Everything ``inspect`` reports, as a dict; raises ``StateError`` for a bad blob or file."""
    report: dict[str, Any] = {"format": "state blob", "tokens": None, "blob_offset": 0}
    blob_data: Any = data
    if len(data) >= 4 and struct.unpack_from("<I", data)[0] == SEQ_FILE_MAGIC:
        tokens, start = parse_seq_file_header(data)
        report.update(format="sequence file ('ggsq' version 2)", tokens=tokens.tolist(), blob_offset=start)
        blob_data = memoryview(data)[start:]
    blob = parse_blob(blob_data)
    report.update(
        blob_bytes=blob.n_bytes, kind=blob.kind, cell_count=blob.cell_count, n_layer=blob.n_layer,
        cells=[{"pos": cell.pos, "seq_ids": list(cell.seq_ids)} for cell in blob.cells],
        tensors=[_tensor_summary(blob, blob_data, tensor) for tensor in blob.tensors])
    return report


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
    print(f"layers: {report['n_layer']} (v_trans 0)")
    print(f"  {'tensor':<12} {'type':<6} {'row bytes':>10} {'n_embd':>7} {'min':>12} {'max':>12} "
          f"{'mean':>12}  sha256")
    for t in report["tensors"]:
        extra = f"  ({t['non_finite']} non-finite values)" if t["non_finite"] else ""
        print(f"  {t['tensor']:<12} {t['type']:<6} {t['row_bytes']:>10} "
              f"{'-' if t['n_embd'] is None else t['n_embd']:>7} {_number(t['min']):>12} "
              f"{_number(t['max']):>12} {_number(t['mean']):>12}  {t['sha256'][:16]}{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recurrent_cache inspect",
                                     description="Describe a state blob (state_write) or a 'ggsq' "
                                                 "sequence file (llama_state_seq_save_file).")
    parser.add_argument("file", help="the blob or sequence file")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--max-cells", type=int, default=32, metavar="N",
                        help="list at most N cells (default 32; 0 lists all)")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open(options.file, "rb") as file:
            data = file.read()
    except OSError as exc:
        print(f"inspect: cannot read {options.file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        report = describe(data)
    except RecurrentCacheError as exc:
        print(f"inspect: {options.file} is not a valid state blob or sequence file: {exc}", file=sys.stderr)
        return 1
    if options.json:
        print(json.dumps({"file": options.file, **report}, indent=1))
    else:
        _print_report(options.file, report, options.max_cells)
    return 0
