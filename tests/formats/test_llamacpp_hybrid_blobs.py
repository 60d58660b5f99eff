"""A hybrid model's state bytes from llama.cpp (``tests/data/llamacpp_hybrid``) read at the formats level.

Every blob and file a tiny Jamba (Mamba-1 layers 0, 1, 3, attention layer 2) and a tiny Granite-4
hybrid (Mamba-2 layers 0, 2, 3, attention layer 1) wrote with flash attention off and on: its
framing is found from the bytes alone, its attention KV section parses to the cells the recording
holds (which agree with the positions llama.cpp's memory reported and the script's tokens) with K
and V rows of the recorded shapes and V layout, the recurrent section after it parses with the
geometry of the recurrent layers, and the framing's bytes, the composed KV section and the
recurrent bytes give the blob back byte for byte.  A PARTIAL_ONLY blob is the recurrent section
alone.  A blob cut at any field boundary, or with a count too large, is refused with a
``StateError`` naming the field.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.errors import StateError
from recurrent_cache.formats.blob import parse_blob
from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.formats.kv import KvSection, compose_kv_section, parse_kv_section
from recurrent_cache.formats.layouts import (GGSN, GGSQ, KV_V_TRANS_HEADER, SEQ_BLOB_HEADER, SEQ_BLOB_MAGIC,
                                            TENSOR_HEADER)

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_hybrid"
RECORDINGS = {path.parent.name: json.loads(path.read_text()) for path in sorted(DATA.glob("*/record.json"))}
PARTIAL_ONLY = 1   # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
F16 = 1            # the KV cache's type (ggml type id)
FRAMING_NAMES = {"context_blob": "llama context blob", "seq_blob": "llama sequence blob", "seq_file": GGSQ.name,
                 "session_file": GGSN.name}


def _geometry(record, seq_id):
    shape = record["shape"]
    return Geometry(shape["n_layer"], shape["n_embd_r"], shape["n_embd_s"], shape["dtype_r"], shape["dtype_s"],
                    size=record["n_seq_max"], layers=tuple(shape["recurrent_layers"]))


def _files(kinds=None, flags=(0, PARTIAL_ONLY)):
    for name, record in RECORDINGS.items():
        for file, item in record["files"].items():
            if (kinds is None or item["kind"] in kinds) and item.get("flags", 0) in flags:
                yield pytest.param(name, file, id=f"{name}/{file}")


class Split:
    """A recorded blob or file split by the package's framing reader: the bytes before the KV
    section, the KV section (None: PARTIAL_ONLY), the recurrent section."""

    def __init__(self, name, file):
        self.record = RECORDINGS[name]
        self.item = self.record["files"][file]
        self.data = (DATA / name / file).read_bytes()
        self.seq_id = self.item.get("seq_id", -1)
        self.partial = bool(self.item.get("flags", 0) & PARTIAL_ONLY)
        unframed = unframe(self.data, self.seq_id, kv_section=not self.partial)
        self.framing = unframed.framing
        self.recurrent = bytes(unframed.section)
        kv_at = self.framing.section_offset if self.partial else self.framing.kv_offset
        self.prefix = self.data[:kv_at]
        self.kv_bytes = self.data[kv_at:self.framing.section_offset]
        self.kv = None if self.partial else parse_kv_section(self.kv_bytes, self.seq_id,
                                                             cache=_geometry(self.record, self.seq_id))


def _expected_kv_cells(record, seq_id):
    """The recorded cells of the whole context, or those listing ``seq_id`` (listing it alone), in cell order."""
    cells = [(pos, tuple(ids)) for pos, ids in record["kv_cells"]]
    return cells if seq_id < 0 else [(pos, (seq_id,)) for pos, ids in cells if seq_id in ids]


# -- the recording agrees with itself -------------------------------------------------------

def test_the_directory_is_small_and_holds_both_v_layouts_of_each_model():
    assert sum(path.stat().st_size for path in DATA.rglob("*") if path.is_file()) < 1_500_000
    assert {record["arch"] for record in RECORDINGS.values()} == {"jamba", "granitehybrid"}
    assert {name: record["flash_attn"] for name, record in RECORDINGS.items()} == {
        f"{record['model_key']}_fa_{state}": flash for record in RECORDINGS.values()
        for state, flash in (("off", False), ("on", True))}
    for record in RECORDINGS.values():
        assert (DATA / record["model"]).stat().st_size < 200_000
        assert record["llama_cpp"]["llama_cpp_python"] == "0.3.36"
        assert all(item["accepted"] for item in record["files"].values())


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_recorded_cells_hold_each_sequences_tokens_at_their_positions(name):
    """Independent of the blob the cells were read from: each sequence's positions are 0..n-1 for
    its n decoded tokens (the fork's shared prefix in cells listing both), and their extremes are
    what llama.cpp's memory reported."""
    record = RECORDINGS[name]
    for seq, tokens in record["tokens"].items():
        positions = sorted(pos for pos, ids in record["kv_cells"] if int(seq) in ids)
        assert positions == list(range(len(tokens)))
        assert record["seq_positions"][seq] == [len(tokens) - 1, len(tokens) - 1]   # the recurrent half's one cell
    shared = [pos for pos, ids in record["kv_cells"] if len(ids) > 1]
    assert shared == [0, 1, 2, 3]   # the fork of 0 into 2 after 4 tokens


@pytest.mark.parametrize("name", RECORDINGS)
def test_every_restore_continues_to_the_reference_and_a_partial_blob_alone_does_not(name):
    record = RECORDINGS[name]
    reference = record["reference_logits"]
    largest = max(float(np.max(np.abs(logits))) for logits in reference.values())
    for item in record["files"].values():
        for seq, logits in item["logits"].items():
            assert np.max(np.abs(np.subtract(logits, reference[seq]))) < 1e-5 * largest
        if item.get("flags") == PARTIAL_ONLY:
            seq = str(item["seq_id"])
            assert item["alone_accepted"] and item["alone_positions"] == [len(record["tokens"][seq]) - 1, -1]
            assert np.max(np.abs(np.subtract(item["alone_logits"][seq], reference[seq]))) > 0.1 * largest


# -- the framing, found from the bytes --------------------------------------------------------

@pytest.mark.parametrize("name,file", list(_files()))
def test_the_framing_is_found_from_the_bytes(name, file):
    split = Split(name, file)
    item = split.item
    assert split.framing.name == FRAMING_NAMES[item["kind"]]
    assert split.framing.kv_cell_ext is (None if split.partial else False)
    if item["kind"] == "seq_blob":
        assert split.prefix == SEQ_BLOB_HEADER.pack(SEQ_BLOB_MAGIC, item["seq_id"])
        assert split.framing.source_seq_id == item["seq_id"]
    if item["kind"] in ("context_blob", "session_file"):
        assert split.framing.arch == split.record["arch"]
        arch = split.record["arch"].encode()
        assert split.prefix.endswith(struct.pack("<I", len(arch)) + arch)
    if "tokens" in item:
        assert split.framing.tokens.tolist() == item["tokens"]
    # read as if it had no KV section, a full blob's KV section is no recurrent section
    if not split.partial:
        with pytest.raises(StateError):
            geometry = _geometry(split.record, split.seq_id)
            parse_blob(unframe(split.data, split.seq_id, cache=geometry).section, geometry, split.seq_id)


# -- the KV section ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,file", list(_files(flags=(0,))))
def test_the_kv_section_holds_the_recorded_cells(name, file):
    split = Split(name, file)
    (stream,) = split.kv.streams   # one stream: kv_unified
    assert [(cell.pos, cell.seq_ids) for cell in stream.cells] == _expected_kv_cells(split.record, split.seq_id)
    assert all(cell.ext is None for cell in stream.cells) and not split.kv.cell_ext
    assert split.kv.nbytes == len(split.kv_bytes)


@pytest.mark.parametrize("name,file", list(_files(flags=(0,))))
def test_the_kv_rows_have_the_attention_layers_shapes_and_the_recorded_v_layout(name, file):
    split = Split(name, file)
    shape = split.record["shape"]
    (stream,) = split.kv.streams
    n_cells = len(stream.cells)
    widths_k = [shape["n_embd_k_gqa"][il] for il in shape["attention_layers"]]
    widths_v = [shape["n_embd_v_gqa"][il] for il in shape["attention_layers"]]
    assert stream.n_layer == len(shape["attention_layers"]) == 1   # the KV section counts attention layers only
    assert stream.v_trans is (not split.record["flash_attn"])
    for tensor, width in zip(stream.k, widths_k, strict=True):
        assert (tensor.type_id, tensor.row_bytes, tensor.rows.shape, tensor.transposed) == (
            F16, 2 * width, (n_cells, 2 * width), False)
    for tensor, width in zip(stream.v, widths_v, strict=True):
        if stream.v_trans:   # one run of every cell's value per dimension
            assert (tensor.type_id, tensor.row_bytes, tensor.n_embd, tensor.rows.shape) == (F16, 2, width,
                                                                                          (width, 2 * n_cells))
        else:
            assert (tensor.type_id, tensor.row_bytes, tensor.rows.shape) == (F16, 2 * width, (n_cells, 2 * width))
        assert tensor.by_cell().shape == (n_cells, 2 * width)
        assert np.isfinite(tensor.by_cell().view(np.float16)).all()


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_sequences_kv_rows_are_the_whole_contexts_rows_of_its_cells(name):
    """Per cell, K and V (gathered across the dimension runs when transposed) of a sequence blob
    are the bytes the whole-context blob holds for the same cell: the layouts are read right."""
    whole = Split(name, "context.blob").kv.streams[0]
    index = {}
    for i, cell in enumerate(whole.cells):
        for seq in cell.seq_ids:
            index[seq, cell.pos] = i
    for seq in map(int, RECORDINGS[name]["tokens"]):
        stream = Split(name, f"seq{seq}.blob").kv.streams[0]
        cells = [index[seq, cell.pos] for cell in stream.cells]
        for ours, theirs in zip(stream.k + stream.v, whole.k + whole.v, strict=True):
            np.testing.assert_array_equal(ours.by_cell(), theirs.by_cell()[cells])


@pytest.mark.parametrize("model", sorted({record["model_key"] for record in RECORDINGS.values()}))
def test_the_two_v_layouts_hold_the_same_cells(model):
    """Flash attention changes where V's bytes go (and, by a rounding or two, their values), not the cells."""
    off, on = (Split(f"{model}_fa_{state}", "context.blob").kv.streams[0] for state in ("off", "on"))
    assert off.cells == on.cells
    assert off.v[0].by_cell().shape == on.v[0].by_cell().shape
    np.testing.assert_allclose(off.v[0].by_cell().view(np.float16), on.v[0].by_cell().view(np.float16), atol=2e-2)


# -- the recurrent section ------------------------------------------------------------------------

@pytest.mark.parametrize("name,file", list(_files()))
def test_the_recurrent_section_parses_with_the_recurrent_layers_geometry(name, file):
    split = Split(name, file)
    record = split.record
    geometry = _geometry(record, split.seq_id)
    blob = parse_blob(split.recurrent, geometry, split.seq_id)
    assert blob.n_layer == record["shape"]["n_layer"] == 4
    assert [(t.name, t.layer) for t in blob.tensors] == [(which, il) for which in "rs"
                                                         for il in record["shape"]["recurrent_layers"]]
    assert {(t.type_id, t.row_bytes) for t in blob.tensors if t.name == "r"} == {(0, geometry.row_bytes_r)}
    last = {int(seq): len(tokens) - 1 for seq, tokens in record["tokens"].items()}
    if split.seq_id >= 0:
        assert [(cell.pos, cell.seq_ids) for cell in blob.cells] == [(last[split.seq_id], ())]
    else:   # one cell per sequence, at its last position (the fork decoded since: a cell of its own)
        assert sorted((cell.seq_ids, cell.pos) for cell in blob.cells) == [((seq,), pos) for seq, pos in
                                                                           sorted(last.items())]


@pytest.mark.parametrize("name,file", list(_files(kinds=("seq_blob",), flags=(PARTIAL_ONLY,))))
def test_a_partial_only_blob_is_the_full_blobs_recurrent_section_alone(name, file):
    """PARTIAL_ONLY: llama_memory_hybrid writes no KV section, the sequence header and the
    recurrent section are as in the full blob."""
    partial = Split(name, file)
    full = Split(name, file.replace(".partial", ""))
    assert partial.framing.kv_offset is None and partial.kv_bytes == b""
    assert partial.prefix == full.prefix
    assert partial.recurrent == full.recurrent
    assert partial.data == full.prefix + full.recurrent


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_files_hold_the_blobs_after_their_header_and_tokens(name):
    for seq, tokens in RECORDINGS[name]["tokens"].items():
        ggsq = (DATA / name / f"seq{seq}.ggsq").read_bytes()
        blob = (DATA / name / f"seq{seq}.blob").read_bytes()
        assert ggsq == GGSQ.header.pack(GGSQ.magic, GGSQ.version, len(tokens)) + struct.pack(
            f"<{len(tokens)}i", *tokens) + blob[SEQ_BLOB_HEADER.size:]
    session = (DATA / name / "session.ggsn").read_bytes()
    tokens = RECORDINGS[name]["tokens"]["0"]
    assert session == GGSN.header.pack(GGSN.magic, GGSN.version, len(tokens)) + struct.pack(
        f"<{len(tokens)}i", *tokens) + (DATA / name / "context.blob").read_bytes()


# -- composed back byte for byte ------------------------------------------------------------------

@pytest.mark.parametrize("name,file", list(_files()))
def test_framing_kv_section_and_recurrent_bytes_compose_to_the_recording(name, file):
    split = Split(name, file)
    kv = b"" if split.kv is None else compose_kv_section(split.kv)
    assert split.prefix + kv + split.recurrent == split.data


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_kv_section_built_from_parts_composes_to_llamacpps_bytes(name):
    """The section rebuilt from its values (copies of the rows, not views of the bytes), V
    transposed back from the per-cell rows, composes to llama.cpp's bytes."""
    split = Split(name, "context.blob")
    (stream,) = split.kv.streams
    rebuilt = []
    for tensor in stream.v:
        by_cell = tensor.by_cell().copy()
        if tensor.transposed:
            n_cells = by_cell.shape[0]
            runs = by_cell.reshape(n_cells, tensor.n_embd, tensor.row_bytes).transpose(1, 0, 2)
            rebuilt.append(type(tensor)(tensor.type_id, tensor.row_bytes,
                                        np.ascontiguousarray(runs).reshape(tensor.n_embd, -1), tensor.n_embd))
        else:
            rebuilt.append(type(tensor)(tensor.type_id, tensor.row_bytes, by_cell))
    section = KvSection((type(stream)(stream.cells, stream.v_trans, stream.k, tuple(rebuilt)),), False, 0)
    assert compose_kv_section(section) == split.kv_bytes


# -- defects --------------------------------------------------------------------------------------

def _boundaries(split):
    """(offset in the data, the field a cut there leaves out) at every field boundary from the KV
    section's start to the recurrent section's first rows."""
    at = split.framing.kv_offset
    (stream,) = split.kv.streams
    where = "KV section stream 0"
    cuts = [(at, "KV section n_stream"), (at + 4, f"{where} cell_count")]
    at += 8
    for i, cell in enumerate(stream.cells):
        cuts += [(at, f"{where} cell {i} pos and n_seq_id"), (at + 8, f"{where} cell {i} seq ids")]
        at += 8 + 4 * len(cell.seq_ids)
    cuts.append((at, f"{where} v_trans and n_layer"))
    at += 8
    for which, tensors in (("K", stream.k), ("V", stream.v)):
        for il, tensor in enumerate(tensors):
            transposed = which == "V" and tensor.transposed
            header = "type, element size and width" if transposed else "type and row size"
            cuts.append((at, f"{where} layer {il} {which} {header}"))
            at += (KV_V_TRANS_HEADER if transposed else TENSOR_HEADER).size
            cuts.append((at, f"{where} layer {il} {which} rows"))
            at += tensor.rows.nbytes
    assert at == split.framing.section_offset
    cuts += [(at, "cell_count"), (at + 4, "cell 0 pos and n_seq_id")]
    at += 4 + sum(8 + 4 * n for n in _recurrent_id_counts(split))
    cuts += [(at, "v_trans and n_layer"), (at + 8, "layer 0 r type and row size"), (at + 20, "layer 0 r rows")]
    return cuts


def _recurrent_id_counts(split):
    geometry = _geometry(split.record, split.seq_id)
    return [len(cell.seq_ids) for cell in parse_blob(split.recurrent, geometry, split.seq_id).cells]


@pytest.mark.parametrize("name,file", list(_files(kinds=("context_blob", "seq_blob"), flags=(0,))))
def test_a_cut_at_every_field_boundary_is_refused_naming_the_field(name, file):
    split = Split(name, file)
    geometry = _geometry(split.record, split.seq_id)
    for cut, field in _boundaries(split):
        for length in (cut, cut + 1):   # at the boundary, and one byte into the field
            with pytest.raises(StateError, match=f"truncated at .*: {field} needs"):
                # the framing reader steps over the KV section; the recurrent one is parse_blob's
                section = unframe(split.data[:length], split.seq_id, kv_section=True, kv_cell_ext=False,
                                  cache=geometry).section
                parse_blob(section, geometry, split.seq_id)


def _with(data, offset, layout, value):
    out = bytearray(data)
    struct.pack_into(layout, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize("name", RECORDINGS)
@pytest.mark.parametrize("field,offset_of,value,message", [
    ("n_stream", lambda s: s.framing.kv_offset, 4, "KV section n_stream 4 at byte 0 is more than the cache's "
                                                   "sequences 3"),
    ("cell_count", lambda s: s.framing.kv_offset + 4, 2**31,
     "KV section stream 0 cell_count 2147483648 at byte 4 is more than max_tokens"),
    ("n_seq_id", lambda s: s.framing.kv_offset + 12, 4,
     "KV section stream 0 cell 0 n_seq_id 4 at byte 12 is more than the cache's sequences 3"),
    ("n_layer", lambda s: s.framing.section_offset - s.kv.nbytes + _layer_count_at(s), 5,
     "KV section stream 0 n_layer 5 at byte .* is more than the model's layers 4"),
])
def test_a_count_too_large_is_refused_naming_the_field(name, field, offset_of, value, message):
    split = Split(name, "context.blob")
    damaged = _with(split.data, offset_of(split), "<I", value)
    with pytest.raises(StateError, match=message):
        parse_kv_section(damaged[split.framing.kv_offset:split.framing.section_offset], -1,
                         cache=_geometry(split.record, -1))
    with pytest.raises(StateError, match=field):
        unframe(damaged, -1, kv_section=True, kv_cell_ext=False, cache=_geometry(split.record, -1))


def _layer_count_at(split):
    """The offset of the stream's n_layer in the KV section (after its cells and v_trans)."""
    (stream,) = split.kv.streams
    return 8 + sum(8 + 4 * len(cell.seq_ids) for cell in stream.cells) + 4


def test_a_sequence_kv_cell_listing_two_sequences_is_refused():
    split = Split("jamba_fa_off", "seq0.blob")
    damaged = _with(split.data, split.framing.kv_offset + 12, "<I", 2)
    with pytest.raises(StateError, match="KV section stream 0 cell 0 has n_seq_id 2 at byte 12"):
        parse_kv_section(damaged[split.framing.kv_offset:], 0)
