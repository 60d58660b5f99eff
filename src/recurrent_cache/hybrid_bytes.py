"""A hybrid memory's state bytes (docs/hybrid.md, "State bytes"): llama.cpp's hybrid state — the
attention KV section, then the recurrent section — written from both halves of a ``HybridCache``, and
read back in two steps: ``checked`` parses and checks every byte with neither half changed, then
``place_kv`` and ``fill`` put it in (``HybridCache.state_read`` holds the guard around them and marks
the memory broken if a storage fails once a half changed).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _engines
from ._core import host_extent
from .cache import RecurrentCache
from .errors import NoFreeCellError, StateError
from .formats.blob import blob_view, parse_blob
from .formats.dtypes import STATE_TYPES
from .formats.framings import in_section, unframe
from .formats.geometry import Geometry
from .formats.kv import compose_kv_section, parse_kv_section
from .formats.messages import target_aliases_cache, target_too_small
from .formats.streams import target_view, write_all
from .kv_state import KvLoad, KvRows, checked_load, kv_section
from .storage import Tensor

__all__ = ["CheckedState", "HybridBytes"]


class CheckedState(NamedTuple):
    """A hybrid state read and checked, nothing changed yet: its KV section's cells and rows (None for
    a recurrent section alone), its recurrent section, and the bytes the state took."""

    load: KvLoad | None
    recurrent: bytes | memoryview
    length: int


def _prefix_of(n_tokens: int, kv_pos: np.ndarray | None, recurrent_pos: list[int]) -> None:
    """``StateError`` unless a sequence's state (its KV cells' positions, None when not read, and its
    recurrent cells' positions) is that of exactly ``n_tokens`` tokens at positions ``0 .. n_tokens - 1``."""
    if recurrent_pos != [n_tokens - 1]:
        held = recurrent_pos or "none"
        raise StateError(f"the state is not that of a prefix of {n_tokens} tokens: its recurrent state is at "
                         f"position{'s' if len(recurrent_pos) != 1 else ''} {held}, not {n_tokens - 1}")
    if kv_pos is not None and not np.array_equal(np.sort(kv_pos), np.arange(n_tokens)):
        shown = kv_pos.tolist()[:8] + (["..."] if kv_pos.size > 8 else [])
        raise StateError(f"the state is not that of a prefix of {n_tokens} tokens: its KV cells hold positions "
                         f"{shown}, not 0 .. {n_tokens - 1}")


class HybridBytes:
    """The state bytes of a hybrid memory's two halves: its KV table with the rows of its ``n_attn``
    attention layers (``kv_tensors``: K and V as allocated, ``kv_rows``: one row per cell), and its
    recurrent half."""

    def __init__(self, kv: _engines.KVTable, kv_rows: KvRows, kv_tensors: tuple[Tensor, Tensor],
                 recurrent: RecurrentCache, n_attn: int) -> None:
        self._kv, self._kv_rows, self._kv_tensors, self._recurrent = kv, kv_rows, kv_tensors, recurrent
        self._n_attn = n_attn
        self.kv_bytes_per_token = n_attn * (kv_rows.n_embd_k * kv_rows.type_k.itemsize
                                            + kv_rows.n_embd_v * kv_rows.type_v.itemsize)
        self.recurrent_bytes_per_seq = len(recurrent.layers) * (
            STATE_TYPES[recurrent.dtype_r].itemsize * recurrent.n_embd_r
            + STATE_TYPES[recurrent.dtype_s].itemsize * recurrent.n_embd_s)

    def write(self, seq_id: int, partial: bool) -> bytes:
        """The KV section of the whole memory (``seq_id = -1``) or of one sequence (none when
        ``partial``), then the recurrent section."""
        kv = b"" if partial else compose_kv_section(kv_section(self._kv, self._kv_rows, seq_id))
        return kv + self._recurrent.state_write(seq_id)

    def write_into(self, target: object, data: bytes) -> int:
        """``data`` into ``target`` (``HybridCache.state_write_into``): its length."""
        view = target_view(target)
        if view is None:
            write_all(target, data)
            return len(data)
        if len(view) < len(data):
            raise target_too_small(len(view), len(data))
        if self._aliases(view):
            raise target_aliases_cache()
        view[:len(data)] = data
        return len(data)

    def _aliases(self, view: memoryview) -> bool:
        """Whether ``view`` shares a byte with the K or V tensor (where they lie in host memory) or with
        any tensor of the recurrent half (its core's own test)."""
        if not len(view):
            return False
        begin = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
        end = begin + len(view)
        for tensor in self._kv_tensors:
            extent = host_extent(tensor)
            if extent is not None and begin < extent[1] and extent[0] < end:
                return True
        return bool(self._recurrent.memory_core.aliases(view))

    def seq_bound(self) -> int:
        """``HybridCache.seq_state_bound``."""
        recurrent = self._recurrent.n_layer * 2 * 12 + 64 + self.recurrent_bytes_per_seq
        return 64 + self._n_attn * 2 * 16 + self._kv.size * (12 + self.kv_bytes_per_token) + recurrent

    def bound(self) -> int:
        """``HybridCache.state_bound``."""
        n_seq = self._recurrent.size
        cell_header = 8 + 4 * n_seq   # position, sequence count, sequence ids
        recurrent = self._recurrent.n_layer * 2 * 12 + 64 + n_seq * (cell_header + self.recurrent_bytes_per_seq)
        return 64 + self._n_attn * 2 * 16 + self._kv.size * (cell_header + self.kv_bytes_per_token) + recurrent

    def checked(self, data: object, seq_id: int, arch: str | None, framing: str | None, partial: bool,
                kv_cell_ext: bool | None, n_tokens: int | None) -> CheckedState:
        """``data`` read and checked as ``HybridCache.state_read`` takes it, neither half changed:
        ``StateError`` naming the defect and its byte offset."""
        geometry = Geometry.of(self._recurrent)
        unframed = unframe(data, seq_id, arch, not partial, framing=framing, cache=geometry, kv_cell_ext=kv_cell_ext)
        found = unframed.framing
        load = None
        try:
            if not partial:
                assert found.kv_offset is not None
                if found.kv_cell_ext:
                    raise StateError("the KV section's cells carry extended positions (M-RoPE or n-gram models): "
                                     "a HybridCache does not keep them")
                section = parse_kv_section(blob_view(data)[found.kv_offset:found.section_offset], seq_id, False,
                                           geometry)
                load = checked_load(section, self._kv_rows, self._kv.size, self._recurrent.size, seq_id)
            blob = parse_blob(unframed.section, geometry, seq_id)   # the recurrent section, checked before any change
            if n_tokens is not None:
                _prefix_of(n_tokens, None if load is None else load.pos, [cell.pos for cell in blob.cells])
        except StateError as exc:
            raise in_section(exc, found) from None
        return CheckedState(load, unframed.section, found.section_offset + len(unframed.section))

    def place_kv(self, load: KvLoad, seq_id: int) -> np.ndarray:
        """A checked section's cells into the KV half (where llama.cpp puts them): the cells whose rows
        ``fill`` then writes.  ``NoFreeCellError`` before anything changed when a sequence's fit nowhere."""
        if seq_id < 0:
            self._kv.load(load.pos, load.flat, load.offsets)
            return np.arange(load.n_cells, dtype=np.int64)
        if load.n_cells == 0:
            self._kv.seq_rm(seq_id, -1, -1)
            return np.empty(0, dtype=np.int64)
        slot = self._kv.load_seq(seq_id, load.pos)
        if slot is None:
            raise NoFreeCellError(f"state_read: the {load.n_cells} KV cells of sequence {seq_id} fit nowhere "
                                  f"in the KV cache ({self._kv.used} of {self._kv.size} cells used)")
        return slot.astype(np.int64)

    def fill(self, state: CheckedState, cells: np.ndarray | None, seq_id: int) -> None:
        """The K and V rows of the placed ``cells``, then the recurrent section into its half."""
        if state.load is not None and cells is not None and cells.size:
            rows, storage = self._kv_rows, self._kv_rows.storage
            storage.put(rows.k_by_cell, cells, storage.from_host(state.load.k, rows.type_k))
            storage.put(rows.v_by_cell, cells, storage.from_host(state.load.v, rows.type_v))
        self._recurrent.state_read(state.recurrent, seq_id, framing="bare")
