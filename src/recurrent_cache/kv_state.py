"""The KV half's state bytes: a ``KvSection`` (``formats.kv``) from a KV cell table and its K and V
tensors, and a section checked against them and turned into what a load writes
(docs/hybrid.md, "State bytes").

What is written follows ``llama_kv_cache::state_write``: one stream; the cells holding a token (the
whole cache) or holding the sequence and not outside its sliding window (one sequence), in cell
order; each with its position and its sequences (a sequence's section lists that sequence only);
then per attention layer the K rows of those cells, then the V rows — one row per cell, or with
``v_trans`` one run of the cells' values per dimension.  A section read back may have either V
layout: each is turned into the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._engines import KVTable
from .errors import POS_MAX, StateError
from .formats.dtypes import GGML_TYPES, StateType
from .formats.kv import KvCell, KvSection, KvStream, KvTensor
from .kv_reference import is_masked_swa
from .storage import Storage

__all__ = ["KvRows", "KvLoad", "written_cells", "kv_section", "checked_load"]


@dataclass(frozen=True)
class KvRows:
    """A KV half's rows and their shape: K ``[n_attn, kv_size, n_embd_k]`` and V seen one row per
    cell, ``[n_attn, kv_size, n_embd_v]`` (a transposed view of the V tensor with ``v_trans``)."""

    storage: Storage
    k_by_cell: Any
    v_by_cell: Any
    type_k: StateType
    type_v: StateType
    n_embd_k: int
    n_embd_v: int
    v_trans: bool
    n_swa: int
    swa_type: str

    @property
    def n_layer(self) -> int:
        return int(self.k_by_cell.shape[0])


@dataclass(frozen=True)
class KvLoad:
    """A checked section, ready to load: its tokens (positions, seq ids back to back, offsets) and
    the rows of its cells, one per cell, ``[n_attn, n_cells, n_embd]`` in the cache's dtypes."""

    pos: np.ndarray
    flat: np.ndarray
    offsets: np.ndarray
    k: np.ndarray
    v: np.ndarray

    @property
    def n_cells(self) -> int:
        return int(self.pos.size)


def written_cells(table: KVTable, rows: KvRows, seq_id: int) -> tuple[np.ndarray, list[KvCell]]:
    """The cells a state of ``seq_id`` (-1: the whole cache) holds, in cell order, and each as written.
    One sequence's come from its own cells (no scan of the table)."""
    if seq_id < 0:
        held = [(i, cell) for i, cell in enumerate(table.cells()) if cell is not None]
        return np.array([i for i, _ in held], dtype=np.int64), [KvCell(pos, seqs) for _, (pos, seqs) in held]
    last = table.seq_pos_max(seq_id)
    chosen, written = [], []
    for i in np.sort(table.seq_cells(seq_id)).tolist():
        cell = table.cell(i)
        if cell is not None and not is_masked_swa(rows.n_swa, rows.swa_type, cell[0], last):
            chosen.append(i)
            written.append(KvCell(cell[0], (seq_id,)))
    return np.array(chosen, dtype=np.int64), written


def _as_bytes(rows: np.ndarray) -> np.ndarray:
    """(n, width) rows of any dtype as (n, width * itemsize) uint8."""
    contiguous = np.ascontiguousarray(rows)
    return contiguous.view(np.uint8).reshape(contiguous.shape[0], -1)


def kv_section(table: KVTable, rows: KvRows, seq_id: int) -> KvSection:
    """The KV section of ``seq_id`` (-1: the whole cache), as llama.cpp writes it."""
    chosen, written = written_cells(table, rows, seq_id)
    if not written:
        return KvSection((KvStream(()),), False, 0)
    storage = rows.storage
    k_host = storage.to_host(storage.take(rows.k_by_cell, chosen))   # [n_attn, n_cells, n_embd_k]
    v_host = storage.to_host(storage.take(rows.v_by_cell, chosen))
    k = tuple(KvTensor(rows.type_k.type_id, rows.n_embd_k * rows.type_k.itemsize, _as_bytes(layer)) for layer in k_host)
    if rows.v_trans:
        element = rows.type_v.itemsize
        v = tuple(KvTensor(rows.type_v.type_id, element, _as_bytes(layer.T).reshape(rows.n_embd_v, -1), rows.n_embd_v)
                  for layer in v_host)
    else:
        v = tuple(KvTensor(rows.type_v.type_id, rows.n_embd_v * rows.type_v.itemsize, _as_bytes(layer))
                  for layer in v_host)
    return KvSection((KvStream(tuple(written), rows.v_trans, k, v),), False, 0)


def _layer_rows(tensors: tuple[KvTensor, ...], kind: str, state_type: StateType, n_embd: int,
                n_cells: int) -> np.ndarray:
    """A section's K or V rows of every layer, checked against the cache, as ``[n_attn, n_cells, n_embd]``."""
    by_layer = []
    for il, tensor in enumerate(tensors):
        where = f"KV section layer {il} {kind}"
        if tensor.type_id != state_type.type_id:
            found = GGML_TYPES[tensor.type_id].name if tensor.type_id in GGML_TYPES else f"ggml type {tensor.type_id}"
            raise StateError(f"{where}: rows of {found}, but the cache's dtype_{kind.lower()} is {state_type.name}")
        if tensor.transposed:
            fits = tensor.n_embd == n_embd and tensor.row_bytes == state_type.itemsize
            found = f"{tensor.n_embd} values of {tensor.row_bytes} bytes per cell"
        else:
            fits = tensor.row_bytes == n_embd * state_type.itemsize
            found = f"rows of {tensor.row_bytes} bytes"
        if not fits:
            raise StateError(f"{where}: {found}, but the cache's n_embd_{kind.lower()} is {n_embd} of "
                             f"{state_type.name} ({n_embd * state_type.itemsize} bytes)")
        by_layer.append(tensor.by_cell().view(state_type.numpy).reshape(n_cells, n_embd))
    return np.stack(by_layer) if by_layer else np.zeros((0, n_cells, n_embd), state_type.numpy)


def checked_load(section: KvSection, rows: KvRows, kv_size: int, n_seq_max: int, seq_id: int) -> KvLoad:
    """``section`` checked against the cache (one stream; no more cells than it has; seq ids and
    positions in range; the attention layers, dtypes and widths its own) and turned into a load.
    ``StateError`` naming the defect; nothing is changed here."""
    if len(section.streams) != 1:
        raise StateError(f"KV section: {len(section.streams)} streams, but the cache keeps one (a unified KV "
                         "cache); states of llama.cpp's per-sequence streams are not read")
    stream = section.streams[0]
    n_cells = len(stream.cells)
    if n_cells > kv_size:
        raise StateError(f"KV section: {n_cells} cells, but the cache has kv_size = {kv_size}")
    if n_cells and stream.n_layer != rows.n_layer:
        raise StateError(f"KV section: {stream.n_layer} attention layers, but the cache has {rows.n_layer}")
    pos = np.array([cell.pos for cell in stream.cells], dtype=np.int64)
    bad = np.flatnonzero((pos < 0) | (pos >= POS_MAX))
    if bad.size:
        raise StateError(f"KV section cell {int(bad[0])}: position {int(pos[bad[0]])} outside [0, 2**31 - 1)")
    flat: list[int] = []
    offsets = [0]
    for i, cell in enumerate(stream.cells):
        if not cell.seq_ids:
            raise StateError(f"KV section cell {i}: no sequence holds it")
        if len(set(cell.seq_ids)) != len(cell.seq_ids):
            raise StateError(f"KV section cell {i}: seq ids {list(cell.seq_ids)} repeat one")
        for seq in cell.seq_ids:
            if not 0 <= seq < n_seq_max:
                raise StateError(f"KV section cell {i}: seq_id {seq} outside [0, {n_seq_max})")
        flat += [seq_id] if seq_id >= 0 else list(cell.seq_ids)
        offsets.append(len(flat))
    k = _layer_rows(stream.k, "K", rows.type_k, rows.n_embd_k, n_cells)
    v = _layer_rows(stream.v, "V", rows.type_v, rows.n_embd_v, n_cells)
    return KvLoad(pos.astype(np.int32), np.array(flat, dtype=np.int32), np.array(offsets, dtype=np.int32), k, v)
