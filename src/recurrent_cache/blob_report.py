"""``python -m recurrent_cache inspect FILE``: describe a state blob or file in any framing.

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

A hybrid model's blob holds r and s sections of its recurrent layers only
(``n_layer`` is still the model's layer count): ``layers`` names them.  Without
it every layer is taken to hold state, except that a blob ending right after
its layer header holds none (the empty filter); one ending after the sections of
some of its layers is refused, its message saying how many (the bytes do not
say which).

A hybrid's state (``kv_section``) begins with the attention KV section: the report
gives its streams (``kv_streams``: each one's cells, whether V is stored transposed
and every attention layer's K and V type and row size; its rows are stepped over),
then the recurrent section as any blob.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import StateError
from ._args import INT32_END
from .formats.blob import BlobCell, check_cells
from .formats.dtypes import GGML_TYPES, STATE_TYPES
from .formats.files import read_file
from .formats.kv import KvCell, KvTensorHeader
from .formats.layouts import BARE, CONTEXT_BLOB, CONTEXT_BLOB_V9, GGSN, GGSN_V9, MAX_TOKENS, SEQ_BLOB
from .formats.messages import type_name

__all__ = ["describe", "describe_file"]

_LIMIT = INT32_END - 1   # the constructor's largest size, n_layer and n_embd
_BF16 = STATE_TYPES["bf16"].type_id   # stored as the upper half of a float32, widened by hand
_GGUF_MAGIC = b"GGUF"   # how a model file begins: given to inspect for a state file, it is named as such
_FORMAT_NAMES = {BARE: "state blob", SEQ_BLOB: "state blob (llama_state_seq_get_data)",
                 CONTEXT_BLOB: "state blob (llama_state_get_data)",
                 CONTEXT_BLOB_V9: "state blob (June-2025 llama_state_get_data)",
                 GGSN.name: f"session file ({GGSN.name})", GGSN_V9.name: f"session file ({GGSN_V9.name})"}


class _TensorSummary:
    """Checksum and min / max / mean of one tensor section, fed piece by piece."""

    def __init__(self, label: str, type_id: int, row_bytes: int, offset: int) -> None:
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
            "tensor": label, "type": GGML_TYPES[type_id].name,
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


def _kv_tensor(header: KvTensorHeader) -> dict[str, Any]:
    """A K or V tensor of a KV stream as the report gives it: type, bytes per cell's row (per
    element when transposed) and width (None: a type whose element size is not known here)."""
    known = GGML_TYPES.get(header.type_id)
    n_embd = header.n_embd
    if n_embd is None and known is not None and not header.row_bytes % known.itemsize:
        n_embd = header.row_bytes // known.itemsize
    return {"type": type_name(header.type_id), "type_id": header.type_id, "row_bytes": header.row_bytes,
            "n_embd": n_embd, "transposed": header.n_embd is not None}


class _Inspection:
    """Watches a blob as ``formats.files.read_file`` reads it: finds the smallest cache that
    reads it, or raises before a row is read; then summarises the rows as they stream by.

    A blob with no seq ids is a sequence blob (read with any seq_id, size 1
    suffices); otherwise a whole-cache blob (seq_id -1, size = the largest of
    its cell count and its largest seq id + 1).  Its cells must pass the cell
    rules of ``parse_blob`` for that size; every r tensor must have one known
    type and a row size of 1 to 2**31 - 1 whole elements, every s tensor too (or of 0: a
    conv-only state).
    """

    def __init__(self, layers: tuple[int, ...] | None = None) -> None:
        self.filter = layers          # the layers with state, None: every layer
        self.state_layers: Sequence[int] = ()
        self.fits: dict[str, Any] = {}
        self.tensors: list[_TensorSummary] = []
        self.kv_streams: list[dict[str, Any]] = []

    def cells(self, cells: tuple[BlobCell, ...]) -> None:
        sequence = not any(cell.seq_ids for cell in cells)
        largest_id = max((seq for cell in cells for seq in cell.seq_ids), default=-1)
        size = 1 if sequence else min(max(1, len(cells), largest_id + 1), _LIMIT)
        check_cells(cells, size, 0 if sequence else -1)
        self.fits.update(size=size, seq_id=0 if sequence else -1)

    def layers(self, n_layer: int, offset: int) -> None:
        if n_layer > _LIMIT:
            raise StateError(f"state blob has n_layer {n_layer} at byte {offset}, more than a cache's {_LIMIT}")
        # a filter naming a layer past n_layer is refused by the parse (read_file's layers)
        # a range, not a list: a damaged n_layer of 2**31 - 2 costs nothing until a section is read
        self.state_layers = range(n_layer) if self.filter is None else self.filter
        self.fits.update(n_layer=n_layer, n_embd_r=None, n_embd_s=None, dtype_r=None, dtype_s=None,
                         layers=None if self.filter is None else list(self.filter))

    def tensor(self, k: int, type_id: int, row_bytes: int, offset: int) -> None:
        n_state = len(self.state_layers)
        name, first = ("r", k == 0) if k < n_state else ("s", k == n_state)
        layer = self.state_layers[k % n_state]
        if type_id not in GGML_TYPES:
            raise StateError(f"state blob layer {layer} {name} has type {type_id} at byte {offset}: "
                             f"a cache stores {' or '.join(f'{t.name} ({t.type_id})' for t in GGML_TYPES.values())}")
        type_name, itemsize = GGML_TYPES[type_id].name, GGML_TYPES[type_id].itemsize
        if first:
            least = 1 if name == "r" else 0   # an s row may hold nothing (LFM2's conv-only state)
            if row_bytes % itemsize or not least <= row_bytes // itemsize <= _LIMIT:
                raise StateError(f"state blob layer {layer} {name} row size {row_bytes} at byte {offset + 4} is "
                                 f"not n_embd x {itemsize} bytes ({type_name}) with n_embd in [{least}, {_LIMIT}]")
            self.fits.update({f"dtype_{name}": type_name, f"n_embd_{name}": row_bytes // itemsize})
        elif (type_name, row_bytes) != (self.fits[f"dtype_{name}"], self.fits[f"n_embd_{name}"] * itemsize):
            # without a filter, a hybrid's first s section is read as the r of layer k (k < n_layer)
            hint = (f" (or a hybrid's state holding r and s sections of {k} of its {len(self.state_layers)} "
                    f"layers: name them, inspect --layers)") if self.filter is None and name == "r" else ""
            raise StateError(f"state blob layer {layer} {name} is {type_name} with row size {row_bytes} at "
                             f"byte {offset}, layer {self.state_layers[0]} {name} is {self.fits[f'dtype_{name}']} "
                             f"with n_embd {self.fits[f'n_embd_{name}']}: a cache has one {name} type and row "
                             f"size for every layer{hint}")
        self.tensors.append(_TensorSummary(f"layer {layer} {name}", type_id, row_bytes, offset + 12))

    def kv_stream(self, cells: tuple[KvCell, ...], v_trans: bool, k: tuple[KvTensorHeader, ...],
                  v: tuple[KvTensorHeader, ...]) -> None:
        """A hybrid's attention KV stream, read before the recurrent section: its cells and layers."""
        self.kv_streams.append({
            "cell_count": len(cells), "v_trans": v_trans, "n_layer": len(k),
            "cells": [{"pos": cell.pos, "seq_ids": list(cell.seq_ids),
                       **({} if cell.ext is None else {"ext": list(cell.ext)})} for cell in cells],
            "k": [_kv_tensor(header) for header in k], "v": [_kv_tensor(header) for header in v]})

    def rows(self, piece: bytes) -> None:
        self.tensors[-1].feed(piece)

    def trial(self) -> _Inspection:
        """A fresh inspection for a trial parse (telling two framings apart): the same checks."""
        return _Inspection(self.filter)


def describe_file(file: Any, max_tokens: int = MAX_TOKENS, kv_section: bool = False,
                  layers: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Everything ``inspect`` reports about the blob or sequence file at a binary file's position.

    Reads only what the headers claim (``formats.files.read_file``) and keeps
    only the cells in memory; raises a ``RecurrentCacheError`` for anything no
    cache's ``state_read`` accepts, before reading the rows of a header that
    no cache could hold.  ``kv_section``: a hybrid model's state, whose
    attention KV section comes before the recurrent section.  ``layers``: the
    layers whose r and s sections the blob holds (see the module's docstring).
    """
    inspection = _Inspection(layers)
    head = _first_bytes(file, len(_GGUF_MAGIC))
    try:
        contents = read_file(file, "inspect", seq_id=None, watch=inspection, rows=inspection.rows,
                             max_tokens=max_tokens, kv_section=kv_section, layers=layers,
                             infer_layers=layers is None)
    except StateError as exc:
        if head == _GGUF_MAGIC:
            raise StateError("not a valid state blob or sequence file: this is a GGUF model file (a model's "
                             "weights, which demo and generate load with --model)") from None
        raise StateError(f"not a valid state blob or sequence file: {exc}") from None
    blob, framing = contents.blob, contents.framing
    if layers is None and blob.n_layer and not blob.tensors:   # inferred: the empty filter
        layers = ()
        inspection.fits["layers"] = []
    return {
        "format": _FORMAT_NAMES.get(framing.name, f"sequence file ({framing.name})"),
        "framing": framing.name, "source_seq_id": framing.source_seq_id, "arch": framing.arch,
        "kv_section": None if framing.kv_offset is None else [framing.kv_offset, contents.blob_offset],
        "kv_streams": None if framing.kv_offset is None else inspection.kv_streams,
        "tokens": None if contents.tokens is None else contents.tokens.tolist(),
        "blob_offset": contents.blob_offset, "blob_bytes": blob.n_bytes, "kind": blob.kind,
        "cell_count": blob.cell_count, "n_layer": blob.n_layer, "reads_into": inspection.fits,
        "layers": None if layers is None else list(layers),
        "outputs": None if framing.outputs is None else {
            "positions": list(framing.outputs.positions), "n_logits": framing.outputs.n_logits,
            "n_embd": framing.outputs.n_embd},
        "kv_cell_ext": framing.kv_cell_ext,
        "cells": [{"pos": cell.pos, "seq_ids": list(cell.seq_ids)} for cell in blob.cells],
        "tensors": [tensor.result() for tensor in inspection.tensors]}


def _first_bytes(file: Any, n: int) -> bytes:
    """Up to ``n`` bytes from the file's position, left there to be read again: by seeking back,
    or (a pipe) from a buffered reader's buffer; b"" when the file allows neither."""
    if file.seekable():
        start = file.tell()
        head = bytes(file.read(n))
        file.seek(start)
        return head
    peek = getattr(file, "peek", None)
    return bytes(peek(n)[:n]) if peek is not None else b""


def describe(data: Any) -> dict[str, Any]:
    """``describe_file`` of a blob or sequence file in memory."""
    return describe_file(io.BytesIO(data))
