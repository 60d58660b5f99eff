"""A hybrid's attention KV section whose cells carry llama_kv_cell_ext (M-RoPE, n-gram embeddings).

Current llama.cpp (llama_kv_cache::state_write_meta) writes, when the model uses M-RoPE or
per-layer n-gram embeddings, 12 more bytes per KV cell between its n_seq_id and its seq ids:
i32 x, i32 y (the 2D position), i32 token.  Whether they are there is a property of the model,
not recorded in the bytes: the reader is told (``kv_cell_ext=``) or parses both readings whole
and reads the one that fits.  The KV sections here come from an independent ``struct.pack``
writer of llama.cpp's layout (n_stream, per stream its cells, v_trans, n_layer, K then V),
followed by a filtered recurrent section from the same writer; reading one must leave the cache
exactly as reading that recurrent section alone does, on both engines.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from recurrent_cache import load_seq_file
from recurrent_cache.errors import ArgumentError, StateError
from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.geometry import Geometry

N_LAYER, LAYERS, N_EMBD_R, N_EMBD_S = 4, (1, 3), 3, 2


def kv_section(streams, v_trans, n_attention_layers=2, k_width=5, v_width=3):
    """llama.cpp's KV section: streams = [[(pos, [seq ids], ext or None), ...], ...]; K rows of
    k_width f16 values, V rows of v_width f32 (transposed per element with v_trans)."""
    out = struct.pack("<I", len(streams))
    for stream, cells in enumerate(streams):
        out += struct.pack("<I", len(cells))
        if not cells:
            continue
        for pos, seq_ids, ext in cells:
            out += struct.pack("<iI", pos, len(seq_ids))
            if ext is not None:
                out += struct.pack("<iii", *ext)
            out += struct.pack(f"<{len(seq_ids)}i", *seq_ids)
        out += struct.pack("<II", v_trans, n_attention_layers)
        n = len(cells)
        for il in range(n_attention_layers):
            out += struct.pack("<iQ", 1, 2 * k_width)
            out += np.full((n, k_width), il + stream + 0.5, dtype="<f2").tobytes()
        for il in range(n_attention_layers):
            if v_trans:
                out += struct.pack("<iII", 0, 4, v_width)
                out += np.full((v_width, n), -il - 1.25, dtype="<f4").tobytes()
            else:
                out += struct.pack("<iQ", 0, 4 * v_width)
                out += np.full((n, v_width), -il - 1.25, dtype="<f4").tobytes()
    return out


def recurrent_section(cells, seed):
    """The recurrent section of a cache filtered to LAYERS: cells [(pos, [seq ids])], f32 rows."""
    rng = np.random.default_rng(seed)
    out = struct.pack("<I", len(cells))
    for pos, seq_ids in cells:
        out += struct.pack("<iI", pos, len(seq_ids)) + struct.pack(f"<{len(seq_ids)}i", *seq_ids)
    out += struct.pack("<II", 0, N_LAYER)
    for width in [N_EMBD_R] * len(LAYERS) + [N_EMBD_S] * len(LAYERS):
        out += struct.pack("<iQ", 0, 4 * width) + rng.standard_normal((len(cells), width)).astype("<f4").tobytes()
    return out


def new_cache(rc):
    return rc.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=3, size=3, layers=LAYERS)


def contents(cache):
    return [cache.cell(i) for i in range(cache.size)], cache.state_write()


WHOLE_KV = [[(0, [0], (0, 0, 17)), (1, [0, 2], (1, 0, 18)), (0, [1], (0, 0, 19))],
            [(5, [2], (2, 3, -1))]]
WHOLE_RECURRENT = [(1, [0]), (0, [1]), (5, [2])]


@pytest.mark.parametrize("v_trans", [0, 1])
@pytest.mark.parametrize("ext", [False, True])
def test_a_whole_cache_state_with_or_without_the_cell_ext_reads_like_its_recurrent_section(rc, ext, v_trans):
    cells = [[(pos, ids, e if ext else None) for pos, ids, e in stream] for stream in WHOLE_KV]
    kv = kv_section(cells, v_trans)
    section = recurrent_section(WHOLE_RECURRENT, seed=v_trans)
    expected = new_cache(rc)
    expected.state_read(section)
    for told in (None, ext):
        cache = new_cache(rc)
        assert cache.state_read(kv + section, kv_section=True, kv_cell_ext=told) == len(kv) + len(section)
        assert contents(cache) == contents(expected)
    framing = unframe(kv + section, -1, kv_section=True, cache=Geometry.of(expected)).framing
    assert (framing.kv_offset, framing.section_offset, framing.kv_cell_ext) == (0, len(kv), ext)
    # without a cache (inspect's view) the recurrent section's filter is not known: still found
    assert unframe(kv + section, -1, kv_section=True).framing.section_offset == len(kv)


@pytest.mark.parametrize("ext", [False, True])
def test_told_the_wrong_cell_record_the_read_is_refused_and_the_cache_unchanged(rc, ext):
    cells = [[(pos, ids, e if ext else None) for pos, ids, e in stream] for stream in WHOLE_KV]
    blob = kv_section(cells, 0) + recurrent_section(WHOLE_RECURRENT, seed=1)
    cache = new_cache(rc)
    cache.state_read(recurrent_section(WHOLE_RECURRENT, seed=2))
    before = contents(cache)
    with pytest.raises(StateError):
        cache.state_read(blob, kv_section=True, kv_cell_ext=not ext)
    assert contents(cache) == before
    with pytest.raises(ArgumentError, match="kv_cell_ext must be True, False or None"):
        cache.state_read(blob, kv_section=True, kv_cell_ext=1)


def test_a_sequence_blob_and_file_with_the_cell_ext(rc, tmp_path):
    kv = kv_section([[(p, [2], (p, 1, 100 + p)) for p in range(4)]], 0)
    section = recurrent_section([(3, [])], seed=3)
    blob = struct.pack("<Ii", 0xAF143CD8, 2) + kv + section
    expected = new_cache(rc)
    expected.state_read(section, 1)
    cache = new_cache(rc)
    cache.state_read(blob, 1, kv_section=True)
    assert contents(cache) == contents(expected)
    path = tmp_path / "seq.ggsq"
    path.write_bytes(struct.pack("<III", 0x67677371, 3, 2) + struct.pack("<2i", 8, 9) + kv + section)
    cache = new_cache(rc)
    assert list(load_seq_file(path, cache, 1, kv_section=True)) == [8, 9]
    assert contents(cache) == contents(expected)
    assert list(load_seq_file(path, new_cache(rc), 1, kv_section=True, kv_cell_ext=True)) == [8, 9]
    with pytest.raises(StateError):
        load_seq_file(path, new_cache(rc), 1, kv_section=True, kv_cell_ext=False)


def test_a_truncated_ext_names_the_field(rc):
    kv = kv_section([[(0, [0], (4, 5, 6))]], 0)
    cut = 4 + 4 + 8 + 6   # n_stream, cell_count, pos and n_seq_id, half of the ext
    with pytest.raises(StateError, match="KV section stream 0 cell 0 extended position \\(x, y, token\\)"):
        unframe(kv[:cut], -1, kv_section=True, kv_cell_ext=True)


def test_a_kv_section_without_cells_is_not_ambiguous(rc):
    kv = kv_section([[], []], 0)
    section = recurrent_section(WHOLE_RECURRENT, seed=4)
    cache = new_cache(rc)
    cache.state_read(kv + section, kv_section=True)
    expected = new_cache(rc)
    expected.state_read(section)
    assert contents(cache) == contents(expected)
