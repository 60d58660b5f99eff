"""A conv-only recurrent state: ``n_embd_s = 0``, what LFM2's short convolution keeps.

llama.cpp's ``n_embd_s()`` is 0 for LFM2 (no SSM state, ``n_embd_r = n_embd * (L_cache - 1)``), and
its recurrent memory still allocates an s tensor per layer of rows 0 values wide; its
``state_write_data`` writes, for each layer's s, the type and a row size of 0, then no bytes.  Such
a cache is built, run (batches, rollback), written and read (state bytes, sequence files, rows),
snapshotted (``PrefixCache`` and a store) and reached from the C API on every engine and storage,
and its bytes are llama.cpp's.  ``n_embd_r = 0`` stays refused: a recurrent layer holds a state.
"""

from __future__ import annotations

import ctypes
import io
import struct

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache.blob_report import describe_file
from recurrent_cache.errors import ConfigError
from recurrent_cache.formats.dtypes import STATE_TYPES
from recurrent_cache.hybrid import HybridCache

from capi_table import P, size_t, table
from rows import assign, host

N_LAYER, N_EMBD_R = 2, 3


def conv_state(tokens: list[int], il: int) -> list[float]:
    """The r row the stand-in model writes after ``tokens`` in layer ``il``: small integers, exact in
    every state type."""
    return [float(sum(tokens) % 97), float(len(tokens)), float(il + (tokens[-1] if tokens else 0))]


def decode(rc, cache, seen: dict[int, list[int]], entries: dict[int, list[int]], n_ubatch: int = 512) -> None:
    """Run ``entries`` (seq -> new tokens) through ``cache`` as a model with a conv state only would:
    each group's r row and r step states from its tokens; its s rows are 0 values wide."""
    token, pos, seq_id = [], [], []
    for seq, new in entries.items():
        start = cache.seq_pos_max(seq) + 1
        token += new
        pos += range(start, start + len(new))
        seq_id += [seq] * len(new)
    st = cache.init_batch(rc.Batch(token=token, pos=pos, seq_id=seq_id), n_ubatch=n_ubatch)
    for ub in st:
        n = ub.n_seq_tokens
        for g, owner in enumerate(ub.seq_owner.tolist()):
            mine = ub.token[g * n:(g + 1) * n].tolist()
            before = seen.get(owner, [])[:cache.seq_pos_max(owner) - n + 1]
            for il in cache.layers:
                assert tuple(st.s(il).shape) == (ub.n_seqs, cache.n_embd_s)
                assign(st.r(il)[g], conv_state(before + mine, il))
                steps = st.r_steps(il)
                m = steps.shape[1]
                for j in range(m):
                    assign(steps[g, j], conv_state(before + mine[:n - m + j], il))
            for member in ub.seq_id[g]:
                seen[member] = before + mine


def holds(cache, seq: int, tokens: list[int]) -> None:
    """``seq`` holds the state after ``tokens`` (one cell at the last position, its r rows)."""
    assert cache.seq_pos_max(seq) == len(tokens) - 1
    r_rows, s_rows = cache.seq_state(seq)
    for k, il in enumerate(cache.layers):
        assert host(r_rows[k]).tolist() == conv_state(tokens, il)
        assert tuple(s_rows[k].shape) == (0,)


def llamacpp_section(cells: list, n_layer: int, r_rows: list[np.ndarray], dtype: str, seq: int) -> bytes:
    """llama.cpp's recurrent section (llama-memory-recurrent.cpp ``state_write``) of ``seq`` (-1: all),
    composed here from the cells (``cell()``'s tuples) and each state layer's r rows: the cells,
    ``s_trans = 0`` and ``n_layer``, each layer's r (type, row size, rows), then each layer's s: its
    type and a row size of 0, and no row bytes."""
    chosen = [c for c, (_, _, _, ids) in enumerate(cells) if (ids if seq == -1 else seq in ids)]
    out = [struct.pack("<I", len(chosen))]
    for c in chosen:
        ids = sorted(int(s) for s in cells[c][3]) if seq == -1 else []
        out.append(struct.pack(f"<iI{len(ids)}i", int(cells[c][0]), len(ids), *ids))
    out.append(struct.pack("<II", 0, n_layer))
    state_type = STATE_TYPES[dtype]
    for rows in r_rows:
        out.append(struct.pack("<iQ", state_type.type_id, N_EMBD_R * state_type.itemsize))
        out.extend(rows[c].tobytes() for c in chosen)
    out.extend(struct.pack("<iQ", state_type.type_id, 0) for _ in r_rows)
    return b"".join(out)


def section_of(cache, seq: int) -> bytes:
    """``llamacpp_section`` of a ``RecurrentCache``."""
    return llamacpp_section([cache.cell(c) for c in range(cache.size)], cache.n_layer,
                            [host(cache.r[il]) for il in cache.layers], cache.dtype_r, seq)


def three_sequences(rc, **options):
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, 0, n_seq_max=4, **options)
    seen: dict[int, list[int]] = {}
    decode(rc, cache, seen, {0: [5, 6, 7], 1: [8]}, n_ubatch=2)
    cache.seq_cp(0, 2)
    seen[2] = seen[0]
    decode(rc, cache, seen, {2: [9], 1: [10, 11]})
    return cache, seen


def test_a_cache_with_no_s_state_is_built_and_runs(rc):
    """Refused before: ``n_embd_s must be >= 1, got 0`` (a ConfigError)."""
    cache, seen = three_sequences(rc)
    assert cache.n_embd_s == 0
    assert [tuple(t.shape) for t in cache.s] == [(cache.size, 0)] * N_LAYER
    for seq in range(3):
        holds(cache, seq, seen[seq])
    cache.check()


def test_a_cache_with_no_r_state_is_still_refused(rc):
    with pytest.raises(ConfigError, match=r"^n_embd_r must be in \[1, 2\*\*31\), got 0$"):
        rc.RecurrentCache(N_LAYER, 0, 0)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("layers", [None, (1,)], ids=["all-layers", "filtered"])
def test_state_bytes_are_llamacpps_and_round_trip(rc, dtype, layers):
    cache, seen = three_sequences(rc, dtype_r=dtype, dtype_s=dtype, layers=layers)
    for seq in (-1, 0, 1, 2):
        blob = cache.state_write(seq)
        assert blob == section_of(cache, seq)
        assert cache.state_size(seq) == len(blob)
    other = rc.RecurrentCache(N_LAYER, N_EMBD_R, 0, n_seq_max=4, dtype_r=dtype, dtype_s=dtype, layers=layers)
    assert other.state_read(cache.state_write(1), 3) == len(cache.state_write(1))
    holds(other, 3, seen[1])
    assert other.state_read(cache.state_write()) == len(cache.state_write())
    assert other.state_write() == cache.state_write()
    other.check()


def test_a_blob_with_an_s_row_is_refused_and_changes_nothing(rc):
    """A blob of a cache whose s rows are 1 value wide does not fit a conv-only one (nor the other way)."""
    cache, _ = three_sequences(rc)
    wider = rc.RecurrentCache(N_LAYER, N_EMBD_R, 1, n_seq_max=4)
    before = cache.state_write()
    with pytest.raises(recurrent_cache.StateError):
        cache.state_read(wider.state_write())
    assert cache.state_write() == before
    with pytest.raises(recurrent_cache.StateError):
        wider.state_read(before)


def test_inspect_says_which_cache_reads_it(rc):
    """``inspect`` refused it before: an s row size of 0 was "not n_embd x 4 bytes with n_embd in [1, ...]"."""
    cache, _ = three_sequences(rc)
    report = describe_file(io.BytesIO(cache.state_write()))
    assert report["reads_into"] == {"size": 3, "seq_id": -1, "n_layer": N_LAYER, "n_embd_r": N_EMBD_R,
                                    "n_embd_s": 0, "dtype_r": "f32", "dtype_s": "f32", "layers": None}
    assert [(t["tensor"], t["row_bytes"]) for t in report["tensors"]] == \
        [("layer 0 r", 12), ("layer 1 r", 12), ("layer 0 s", 0), ("layer 1 s", 0)]


def test_rollback_restores_the_conv_state(rc):
    cache = rc.RecurrentCache(N_LAYER, N_EMBD_R, 0, n_seq_max=2, n_rollback=3)
    seen: dict[int, list[int]] = {}
    decode(rc, cache, seen, {0: [1, 2]})
    decode(rc, cache, seen, {0: [3, 4, 5, 6]})        # drafted tokens: 4, 5, 6
    assert cache.seq_rm(0, 3, -1)                      # keep the state after position 2
    holds(cache, 0, [1, 2, 3])
    seen[0] = [1, 2, 3]
    decode(rc, cache, seen, {0: [7]})
    holds(cache, 0, [1, 2, 3, 7])


def test_rows_and_sequence_files_round_trip(rc, tmp_path):
    cache, seen = three_sequences(rc)
    r_rows, s_rows = cache.seq_state(1)
    other = rc.RecurrentCache(N_LAYER, N_EMBD_R, 0, n_seq_max=4)
    other.seq_restore(0, len(seen[1]) - 1, r_rows, s_rows)
    holds(other, 0, seen[1])
    recurrent_cache.save_seq_file(tmp_path / "seq", cache, 2, seen[2])
    assert recurrent_cache.load_seq_file(tmp_path / "seq", other, 3).tolist() == seen[2]
    holds(other, 3, seen[2])


def test_prefix_snapshots_go_through_a_store(rc, tmp_path):
    cache, seen = three_sequences(rc)
    store = recurrent_cache.stores.DirectoryStore(tmp_path)
    block = len(seen[1])   # the store is looked up on the block grid
    first = recurrent_cache.PrefixCache(cache, 1 << 16, block_size=block, store=store)
    assert first.snapshot_bytes == N_LAYER * N_EMBD_R * 4
    assert first.save(1, seen[1])
    other = rc.RecurrentCache(N_LAYER, N_EMBD_R, 0, n_seq_max=4)
    second = recurrent_cache.PrefixCache(other, 1 << 16, block_size=block, store=store)   # another process's
    assert second.restore(0, seen[1] + [1]) == len(seen[1])
    assert second.stats()["store_hits"] == 1
    holds(other, 0, seen[1])


@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_a_hybrid_memory_writes_llamacpps_recurrent_section(engine):
    cache = HybridCache(3, attn_layers=[1], recr_layers=[0, 2], n_embd_k=4, n_embd_v=4, n_embd_r=N_EMBD_R,
                        n_embd_s=0, kv_size=16, n_seq_max=3, engine=engine)
    st = cache.init_batch(recurrent_cache.Batch(token=[1, 2, 3, 4], seq_id=[0, 0, 1, 1], pos=[0, 1, 0, 1]))
    for _ in st:
        for il in (0, 2):
            st.r(il)[...] = np.arange(st.r(il).size).reshape(st.r(il).shape) + 10 * il
    cells = [cache.recurrent_cell(c) for c in range(cache.n_seq_max)]
    for seq in (-1, 0, 1):
        recurrent = cache.state_write(seq, partial_only=True)
        assert recurrent == llamacpp_section(cells, 3, [cache.r[0], cache.r[2]], "f32", seq)
        assert cache.state_write(seq).endswith(recurrent)
    other = HybridCache(3, attn_layers=[1], recr_layers=[0, 2], n_embd_k=4, n_embd_v=4, n_embd_r=N_EMBD_R,
                        n_embd_s=0, kv_size=16, n_seq_max=3, engine=engine)
    other.state_read(cache.state_write())
    assert other.state_write() == cache.state_write()


def test_the_c_api_reports_rows_of_no_bytes_and_writes_the_same_blob():
    cache, _ = three_sequences(recurrent_cache)
    api = table()
    ctx = api.ctx_new(cache)
    try:
        data, row_bytes = P(), size_t()
        for k in range(2 * N_LAYER):
            assert api.tensor(ctx, k, ctypes.byref(data), ctypes.byref(row_bytes)) == 0
            assert row_bytes.value == (N_EMBD_R * 4 if k < N_LAYER else 0)
        blob = cache.state_write()
        target, written = ctypes.create_string_buffer(len(blob)), size_t()
        assert api.state_write(ctx, -1, target, len(target), ctypes.byref(written)) == 0
        assert target.raw[:written.value] == blob
        assert api.state_read(ctx, -1, blob, len(blob)) == 0
        assert cache.state_write() == blob
    finally:
        assert api.ctx_free(ctx) == 0
