"""A HybridCache driven through the C API's table (``capi_table``) as a C decode loop drives it, and the
same loop through the Python API: the two halves of tests/capi/test_capi_hybrid*.py's comparisons.

The made-up model writes rows that name what they hold: token t of sequence ``seq`` at ``pos`` has the
value ``row_value(seq, pos, t)`` in its K row, minus it in its V row, and a group's r / s rows (and
the step rows of the rollback history) the value of the token they are the state after, and minus it.
The C loop writes through the pointers ``rc_kv_tensor`` / ``rc_tensor`` / ``rc_batch_step_row`` give,
at the cells ``rc_batch_kv_cells`` gives; the Python loop through ``HybridState``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from recurrent_cache import Batch, errors
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.memory_state import MemoryStatus

from capi_table import P, Ubatch, i32, i32p, ints, message, size_t, table

T = table()
MASK_FULL, MASK_SLIDING = 0, 1
F32 = ctypes.c_float


def row_value(seq: int, pos: int, token: int) -> float:
    """What the model writes for ``token`` of ``seq`` at ``pos`` (exact in float32)."""
    return float(token * 4096 + pos * 8 + seq)


def small_hybrid(**config: Any) -> HybridCache:
    """Three layers (attention in 0 and 2, recurrent state in 1 and 2), float32 rows, 16 KV cells."""
    settings: dict[str, Any] = dict(attn_layers=[0, 2], recr_layers=[1, 2], n_embd_k=2, n_embd_v=3, n_embd_r=2,
                                    n_embd_s=3, kv_size=16, n_seq_max=4, dtype_k="f32", dtype_v="f32", kv_pad=4)
    settings.update(config)
    return HybridCache(3, **settings)


def host_floats(address: int, n: int) -> np.ndarray:
    """``n`` float32 at ``address``, as a numpy array over that memory."""
    return np.ctypeslib.as_array((F32 * n).from_address(address))


class CHybrid:
    """A HybridCache's C context, and the C decode loop over it."""

    def __init__(self, cache: HybridCache) -> None:
        self.cache = cache
        self.ctx = T.ctx_new(cache)

    def close(self) -> None:
        assert T.ctx_free(self.ctx) == 0

    def message(self, code: int) -> str:
        return message(T, self.ctx, code)

    def kv_rows(self, attn_index: int, which: int) -> tuple[np.ndarray, bool]:
        """Attention layer ``attn_index``'s K (0) or V (1) storage as rc_kv_tensor describes it."""
        data, rows, row_bytes, v_trans = P(), i32(), size_t(), ctypes.c_int()
        code = T.kv_tensor(self.ctx, attn_index, which, ctypes.byref(data), ctypes.byref(rows),
                           ctypes.byref(row_bytes), ctypes.byref(v_trans))
        assert code == 0, self.message(code)
        width = row_bytes.value // 4
        return host_floats(data.value, rows.value * width).reshape(rows.value, width), bool(v_trans.value)

    def state_rows(self, tensor: int) -> np.ndarray:
        """State tensor ``tensor``'s rows (rc_tensor: r of layer il is il, s is n_layer + il)."""
        data, row_bytes = P(), size_t()
        code = T.tensor(self.ctx, tensor, ctypes.byref(data), ctypes.byref(row_bytes))
        assert code == 0, self.message(code)
        return host_floats(data.value, T.size(self.ctx) * (row_bytes.value // 4)).reshape(T.size(self.ctx), -1)

    def decode(self, tokens: list[int], seq_ids: list[int], pos: list[int], n_ubatch: int) -> Any:
        """The C decode loop: rc_batch_init, then per ubatch rc_batch_apply, the KV cells and masks, and
        the model's writes.  The ubatches' reports, or the failing code's message."""
        batch = P()
        code = T.batch_init(self.ctx, len(tokens), ints(seq_ids), None, ints(pos), None, n_ubatch, 0,
                            ctypes.byref(batch))
        if code:
            return code, self.message(code)
        reports, ub = [], Ubatch()
        n_layer, attn = self.cache.n_layer, self.cache.attn_layers
        try:
            while (code := T.batch_apply(batch, ctypes.byref(ub))) == 1:
                order = [ub.token_order[k] for k in range(ub.n_tokens)]
                cells_p, n_kv = i32p(), i32()
                assert T.batch_kv_cells(batch, ctypes.byref(cells_p), ctypes.byref(n_kv)) == 0
                cells = [cells_p[k] for k in range(ub.n_tokens)] if attn else []
                masks = []
                for kind in (MASK_FULL, MASK_SLIDING):
                    out = (F32 * max(1, ub.n_tokens * n_kv.value))()
                    assert T.batch_kv_mask(batch, kind, out, ub.n_tokens * n_kv.value) == 0
                    masks.append(np.array(out[:ub.n_tokens * n_kv.value], dtype=np.float32)
                                 .reshape(ub.n_tokens, n_kv.value))
                values = [row_value(seq_ids[b], pos[b], tokens[b]) for b in order]
                for j in range(len(attn)):
                    (k_rows, _), (v_rows, v_trans) = self.kv_rows(j, 0), self.kv_rows(j, 1)
                    for cell, value in zip(cells, values):
                        k_rows[cell] = value
                        if v_trans:
                            v_rows[:, cell] = -value
                        else:
                            v_rows[cell] = -value
                m = T.batch_n_steps(batch)
                for g in range(ub.n_seqs):
                    group = values[g * ub.n_seq_tokens:(g + 1) * ub.n_seq_tokens]
                    for il in self.cache.recr_layers:
                        for tensor, sign in ((il, 1.0), (n_layer + il, -1.0)):
                            self.state_rows(tensor)[ub.head + g] = sign * group[-1]
                            for j in range(m):
                                row = P()
                                assert T.batch_step_row(batch, tensor, g, j, ctypes.byref(row)) == 0
                                width = self.state_rows(tensor).shape[1]
                                host_floats(row.value, width)[:] = sign * group[ub.n_seq_tokens - 1 - m + j]
                reports.append((order, cells, n_kv.value, masks))
            if code:
                return code, self.message(code)
            return reports
        finally:
            T.batch_release(batch)


def python_decode(cache: HybridCache, tokens: list[int], seq_ids: list[int], pos: list[int], n_ubatch: int) -> Any:
    """The same loop through the Python API: the same reports, or the exception's message (with the
    C API's code for a batch that fits nowhere)."""
    try:
        st = cache.init_batch(Batch(token=tokens, seq_id=seq_ids, pos=pos), n_ubatch=n_ubatch)
    except errors.RecurrentCacheError as exc:
        return str(exc)
    if st.status is MemoryStatus.FAILED_PREPARE:
        return "FAILED_PREPARE"
    reports = []
    for ub in st:
        order = ub.batch_index.tolist()
        cells = st.kv_cells.tolist()
        masks = [st.kv_mask(sliding=False), st.kv_mask(sliding=True)]
        values = [row_value(seq_ids[b], pos[b], tokens[b]) for b in order]
        for il in cache.attn_layers:
            for cell, value in zip(cells, values):
                st.k(il)[cell] = value
                if cache.v_trans:
                    st.v(il)[:, cell] = -value
                else:
                    st.v(il)[cell] = -value
        for g in range(ub.n_seqs):
            group = values[g * ub.n_seq_tokens:(g + 1) * ub.n_seq_tokens]
            for il in cache.recr_layers:
                st.r(il)[g], st.s(il)[g] = group[-1], -group[-1]
                if cache.n_rollback:
                    steps_r, steps_s = st.r_steps(il), st.s_steps(il)
                    m = steps_r.shape[1]
                    for j in range(m):
                        steps_r[g, j] = group[ub.n_seq_tokens - 1 - m + j]
                        steps_s[g, j] = -group[ub.n_seq_tokens - 1 - m + j]
        reports.append((order, cells, st.n_kv, masks))
    return reports


def same_decode(in_c: Any, in_python: Any) -> bool:
    """The C loop's result equals the Python loop's: the same ubatches, cells and masks, or the same
    refusal (a batch that fits nowhere: RC_ERR_KV_NO_SLOT or the recurrent half's code)."""
    if isinstance(in_python, str):
        if in_python == "FAILED_PREPARE":
            return isinstance(in_c, tuple) and in_c[0] in (errors.CAPI_KV_NO_SLOT, errors.NO_FREE_CELL)
        return isinstance(in_c, tuple) and in_c[1] == in_python
    if isinstance(in_c, tuple) or len(in_c) != len(in_python):
        return False
    for (order, cells, n_kv, masks), (p_order, p_cells, p_n_kv, p_masks) in zip(in_c, in_python):
        if (order, cells, n_kv) != (p_order, p_cells, p_n_kv):
            return False
        if not all(np.array_equal(a, b) for a, b in zip(masks, p_masks)):
            return False
    return True


def state_bytes(handle: CHybrid, seq_id: int) -> bytes | str:
    """rc_state_size then rc_state_write: the blob, or the failing code's message."""
    n, written = size_t(), size_t()
    code = T.state_size(handle.ctx, seq_id, ctypes.byref(n))
    if code:
        return handle.message(code)
    buffer = ctypes.create_string_buffer(max(1, n.value))
    code = T.state_write(handle.ctx, seq_id, buffer, n.value, ctypes.byref(written))
    return handle.message(code) if code else buffer.raw[:written.value]
