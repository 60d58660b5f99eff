"""June-2025 llama.cpp's whole-context framing (LLAMA_SESSION_VERSION 9), read without being told.

That llama.cpp's ``llama_state_get_data`` wrote the architecture string (``u32`` length + name),
then an output block: ``i32 n_outputs``, ``n_outputs x i32`` output positions, ``u64 logits_size``
+ that many f32, ``u64 embd_size`` + that many f32, then the memory section; its 'ggsn' session
files were version 9 with that blob after the tokens.  (Read in llama.cpp's source of the time:
``llama_state_get_data_internal`` / ``llama_context::state_write_data`` write the model info first;
current llama.cpp writes the same string and drops the output block, so after the string the i32
is either a cell count or n_outputs.)  Every blob and file here is built by the writer below, from that layout with
``struct.pack`` (not from the package's code), with non-empty outputs, logits and embeddings.
Reading one must leave a cache exactly as reading its bare memory section does, on both engines;
a truncated header is refused at every byte with the cache unchanged; a blob that both framings
read whole is refused, naming both and ``framing=``.  Here "the bare section" of a blob is
what current llama.cpp's ``llama_state_get_data`` puts after the architecture string.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest

from recurrent_cache import load_seq_file, load_session_file
from recurrent_cache.errors import ArgumentError, StateError
from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.layouts import CONTEXT_BLOB, CONTEXT_BLOB_V9, GGSN_V9
from rows import host

TYPE_IDS = {"f32": (0, "<f4"), "f16": (1, "<f2")}


# -- the independent writer ------------------------------------------------------------------

def bare_section(cells, n_layer, layers, r_rows, s_rows, dtype_r="f32", dtype_s="f32"):
    """A whole-cache memory section: cells [(pos, [seq ids])], rows[il] = (n_cells, n_embd) arrays of
    the filter's layers, r of every layer with state, then s."""
    out = struct.pack("<I", len(cells))
    for pos, seq_ids in cells:
        out += struct.pack("<iI", pos, len(seq_ids)) + struct.pack(f"<{len(seq_ids)}i", *seq_ids)
    out += struct.pack("<II", 0, n_layer)
    for rows, dtype in ([(r_rows[il], dtype_r) for il in layers] + [(s_rows[il], dtype_s) for il in layers]):
        type_id, code = TYPE_IDS[dtype]
        data = np.asarray(rows, dtype=code).tobytes()
        out += struct.pack("<iQ", type_id, rows.shape[1] * np.dtype(code).itemsize) + data
    return out


def output_block(positions, n_logits, n_embd):
    """June-2025's output block, with distinct float values."""
    return (struct.pack("<i", len(positions)) + struct.pack(f"<{len(positions)}i", *positions)
            + struct.pack("<Q", n_logits) + np.linspace(-3, 3, n_logits, dtype="<f4").tobytes()
            + struct.pack("<Q", n_embd) + np.linspace(5, 9, n_embd, dtype="<f4").tobytes())


ARCH = struct.pack("<I", 5) + b"mamba"


def session_v9(tokens, blob):
    return struct.pack("<III", 0x6767736E, 9, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + blob


N_VOCAB, N_EMBD = 11, 5
POSITIONS = [0, 3, 6]   # three output rows: logits and embeddings of three batch positions
OUTPUTS = ARCH + output_block(POSITIONS, len(POSITIONS) * N_VOCAB, len(POSITIONS) * N_EMBD)


def shaped(rc, layers=None, n_layer=3):
    return rc.RecurrentCache(n_layer, 4, 3, n_seq_max=4, size=4, layers=layers)


def example_section(n_layer=3, layers=(0, 1, 2), dtype_r="f32", dtype_s="f32"):
    cells = [(7, [0, 2]), (2, [1]), (12, [3])]
    rng = np.random.default_rng(len(layers) + n_layer)
    r_rows = {il: rng.standard_normal((3, 4)).astype(np.float32) for il in layers}
    s_rows = {il: rng.standard_normal((3, 3)).astype(np.float32) for il in layers}
    return bare_section(cells, n_layer, layers, r_rows, s_rows, dtype_r, dtype_s)


def contents(cache):
    """Everything a cache holds: its cells and the rows of every layer with state."""
    cells = [cache.cell(i) for i in range(cache.size)]
    rows = [None if a is None else host(a) for a in cache.r + cache.s]
    return cells, rows, cache.state_write()


def same(a, b):
    (cells_a, rows_a, blob_a), (cells_b, rows_b, blob_b) = a, b
    assert cells_a == cells_b and blob_a == blob_b
    for x, y in zip(rows_a, rows_b, strict=True):
        assert (x is None and y is None) or np.array_equal(x, y)


# -- reading -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [None, (0, 2)])
def test_a_june_context_blob_reads_like_its_bare_section(rc, layers):
    section = example_section(layers=(0, 1, 2) if layers is None else layers)
    blob = OUTPUTS + section
    expected, got = shaped(rc, layers), shaped(rc, layers)
    assert expected.state_read(section) == len(section)
    current = shaped(rc, layers)
    assert current.state_read(ARCH + section, arch="mamba") == len(ARCH) + len(section)   # llama.cpp today
    same(contents(current), contents(expected))
    assert got.state_read(blob) == len(blob)
    same(contents(got), contents(expected))
    assert got.state_write() == section      # and the package writes the independent writer's bytes
    framing = unframe(blob, -1).framing
    assert framing.name == CONTEXT_BLOB_V9 and framing.section_offset == len(OUTPUTS) and framing.arch == "mamba"
    assert framing.outputs.positions == tuple(POSITIONS)
    assert (framing.outputs.n_logits, framing.outputs.n_embd) == (3 * N_VOCAB, 3 * N_EMBD)
    told = shaped(rc, layers)
    told.state_read(blob, framing="llama-june-2025")
    same(contents(told), contents(expected))


def test_outputs_without_logits_or_embeddings_and_no_outputs_at_all(rc):
    section = example_section()
    expected = shaped(rc)
    expected.state_read(section)
    for block in (output_block([4], N_VOCAB, 0), output_block([2, 9], 0, 2 * N_EMBD), output_block([], 0, 0)):
        cache = shaped(rc)
        cache.state_read(ARCH + block + section, arch="mamba")
        same(contents(cache), contents(expected))


def test_state_read_from_a_file_and_a_stream(rc, tmp_path):
    section = example_section()
    blob = OUTPUTS + section
    expected = shaped(rc)
    expected.state_read(section)
    path = tmp_path / "context.bin"
    path.write_bytes(blob)
    cache = shaped(rc)
    with open(path, "rb") as file:
        assert cache.state_read_from(file) == len(blob)
    same(contents(cache), contents(expected))

    class Stream:   # no fileno, no seek: read as a pipe is
        def __init__(self, data):
            self.data = io.BytesIO(data)

        def read(self, n=-1):
            return self.data.read(min(n, 7) if n > 0 else n)

        def readable(self):
            return True

    cache = shaped(rc)
    assert cache.state_read_from(Stream(blob)) == len(blob)
    same(contents(cache), contents(expected))


def test_a_version_9_session_file_loads_with_its_tokens(rc, tmp_path):
    section = example_section()
    tokens = [5, 1, 4, 4, 2]
    path = tmp_path / "session.ggsn"
    path.write_bytes(session_v9(tokens, OUTPUTS + section))
    expected, cache = shaped(rc), shaped(rc)
    expected.state_read(section)
    assert list(load_session_file(path, cache, arch="mamba")) == tokens
    same(contents(cache), contents(expected))
    assert unframe(path.read_bytes(), -1).framing.name == GGSN_V9.name
    before = contents(cache)
    with pytest.raises(StateError, match="holds the whole cache: read it with seq_id -1 .*load_session_file"):
        load_seq_file(path, cache, 0)
    same(contents(cache), before)
    with pytest.raises(StateError, match="state is for architecture 'mamba'.*the caller's model is 'jamba'"):
        load_session_file(path, cache, arch="jamba")
    same(contents(cache), before)


# -- damaged headers -----------------------------------------------------------------------------

def header_length(tokens=0):
    return len(OUTPUTS) + (12 + 4 * tokens if tokens else 0)


@pytest.mark.parametrize("told", [None, "llama-june-2025"])
def test_a_truncated_header_is_refused_at_every_byte_and_the_cache_is_unchanged(rc, told):
    blob = OUTPUTS + example_section()
    cache = shaped(rc)
    cache.state_read(example_section())
    before = contents(cache)
    for cut in range(header_length() + 1):
        with pytest.raises(StateError) as refused:
            cache.state_read(blob[:cut], framing=told)
        if told is not None:
            assert "at byte" in str(refused.value) or "truncated" in str(refused.value), str(refused.value)
        same(contents(cache), before)


def test_a_truncated_version_9_file_is_refused_at_every_byte(rc, tmp_path):
    tokens = [3, 1, 2]
    data = session_v9(tokens, OUTPUTS + example_section())
    cache = shaped(rc)
    before = contents(cache)
    path = tmp_path / "cut.ggsn"
    for cut in range(header_length(len(tokens)) + 1):
        path.write_bytes(data[:cut])
        with pytest.raises(StateError, match="truncated"):
            load_session_file(path, cache)
        same(contents(cache), before)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:9] + struct.pack("<i", -2) + b[13:], "n_outputs is -2 at byte 9, expected >= 0"),
    (lambda b: b[:17] + struct.pack("<i", -1) + b[21:], "output 1 has batch position -1 at byte 17"),
    (lambda b: b[:25] + struct.pack("<Q", 3 * N_VOCAB + 1) + b[33:],
     f"logits size {3 * N_VOCAB + 1} at byte 25 is not a multiple of n_outputs 3 \\(at byte 9\\)"),
    (lambda b: b[:25] + struct.pack("<Q", 999999) + b[33:],
     "truncated at byte 33 .*999999 logits \\(f32\\) needs 3999996 bytes"),
    (lambda b: b[:4] + b"MAMBA" + b[9:], "the architecture string at byte 0 is not a name"),
])
def test_a_damaged_output_block_names_the_field_and_its_byte(rc, damage, message):
    blob = bytes(damage(OUTPUTS + example_section()))
    cache = shaped(rc)
    before = contents(cache)
    with pytest.raises(StateError, match=message):
        cache.state_read(blob, framing="llama-june-2025")
    with pytest.raises(StateError):
        cache.state_read(blob)
    same(contents(cache), before)


def test_a_june_blob_is_the_whole_cache(rc):
    cache = shaped(rc)
    with pytest.raises(StateError, match="holds the whole cache: read it with seq_id -1"):
        cache.state_read(OUTPUTS + example_section(), 0, framing="llama-june-2025")
    with pytest.raises(ArgumentError, match="unknown framing 'june'"):
        cache.state_read(OUTPUTS + example_section(), framing="june")


# -- ambiguity ------------------------------------------------------------------------------------

def ambiguous_blob():
    """A blob both framings read whole into a cache of n_layer 2 with layer 0's state only
    (n_embd 3 and 3, f32).  As current llama.cpp's: the architecture string, then one cell at
    pos 40 of seq 0, r row bits
    (0, 0, 2), s row bits (0, 12, 0).  As a June blob: one output at batch position 40, one
    logit, two embedding values, then an empty memory section: its cell count, v_trans and
    n_layer are the r row, its tensor headers the s header and row."""
    words = np.array([0, 0, 2], dtype="<u4").view("<f4"), np.array([0, 12, 0], dtype="<u4").view("<f4")
    return ARCH + bare_section([(40, [0])], 2, (0,), {0: words[0][None]}, {0: words[1][None]})


def test_a_blob_both_framings_read_whole_is_refused_naming_both(rc):
    blob = ambiguous_blob()
    # the June reading, parsed here by hand: every length adds up to the blob's
    n_outputs, position, n_logits = struct.unpack_from("<iiQ", blob, len(ARCH))
    (n_embd,) = struct.unpack_from("<Q", blob, len(ARCH) + 16 + 4 * n_logits)
    inner = len(ARCH) + 24 + 4 * n_logits + 4 * n_embd
    cell_count, v_trans, n_layer = struct.unpack_from("<III", blob, inner)
    assert (n_outputs, position, n_logits, n_embd, cell_count, v_trans, n_layer) == (1, 40, 1, 2, 0, 0, 2)
    assert inner + 12 + 2 * 12 == len(blob)

    cache = rc.RecurrentCache(2, 3, 3, n_seq_max=2, layers=(0,))
    before = contents(cache)
    with pytest.raises(StateError) as refused:
        cache.state_read(blob)
    text = str(refused.value)
    assert f"a {CONTEXT_BLOB_V9} and a {CONTEXT_BLOB}" in text and "framing=" in text
    assert "'llama'" in text and "'llama-june-2025'" in text
    same(contents(cache), before)

    cache.state_read(blob, framing="llama")
    assert cache.cell(0)[0] == 40 and cache.used == 1
    assert host(cache.r[0][0]).view("<u4").tolist() == [0, 0, 2]
    cache.state_read(blob, framing="llama-june-2025")
    assert cache.used == 0


def test_when_neither_reading_fits_both_defects_are_named(rc):
    # n_embd_s 4: the bare reading's s rows (12 bytes) and the June reading's s header both differ
    blob = ambiguous_blob()
    cache = rc.RecurrentCache(2, 3, 4, n_seq_max=2, layers=(0,))
    before = contents(cache)
    with pytest.raises(StateError) as refused:
        cache.state_read(blob)
    text = str(refused.value)
    assert "ambiguous" not in text and "row size 12" in text
    assert f"(read otherwise it fails too: as a {CONTEXT_BLOB_V9}: state blob layer 0 s row size 12" in text
    same(contents(cache), before)
