"""llama.cpp's attention KV section parsed as data and composed back (``formats.kv``).

Every hybrid blob and file llama.cpp wrote in ``tests/data/llamacpp_current`` (whole context,
per sequence, PARTIAL_ONLY, 'ggsq', 'ggsn'; flash attention on and off) is split by the framing
reader; its KV section parses to the cells and tensor headers the recorder's own parser found
(``records.jsonl.gz``'s layouts), its rows are the bytes at the recorded offsets, and it composes
back to exactly the bytes it was parsed from.  Damaged bytes raise ``StateError`` and nothing else.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.errors import StateError
from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.geometry import Geometry
from recurrent_cache.formats.kv import (KvCell, KvSection, KvStream, KvTensor, compose_kv_section,
                                        parse_kv_section)

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_current"
RECORDS = {record["scenario"]: record for record in
           map(json.loads, gzip.open(DATA / "records.jsonl.gz", "rt", encoding="utf-8"))}
HYBRIDS = [name for name, record in RECORDS.items() if record["shape"]["attention_layers"]]


def _artifacts():
    for name in HYBRIDS:
        record = RECORDS[name]
        for item in [*record["seq_blobs"], record["context_blob"], *record["seq_files"], record["session_file"]]:
            yield pytest.param(name, item, id=f"{name}/{item['file']}")


def _kv_bytes(record, item):
    """The KV section of a recorded blob or file as the framing reader finds it (None: PARTIAL_ONLY)."""
    data = (DATA / item["file"]).read_bytes()
    seq_id = item.get("seq_id", -1)
    if item.get("flags", 0) & 1:   # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: no KV section at all
        assert unframe(data, seq_id, arch=record["arch"]).framing.kv_offset is None
        return None, data, seq_id
    framing = unframe(data, seq_id, arch=record["arch"], kv_section=True).framing
    return data[framing.kv_offset:framing.section_offset], data, seq_id


def _layout_of(section: KvSection, base: int):
    """``section`` as the recorder's layout entries (name, value; rows: their offset and bytes)."""
    entries = [("kv n_stream", len(section.streams))]
    at = base + 4
    rows = []
    for s, stream in enumerate(section.streams):
        where = f"kv stream {s}"
        entries.append((f"{where} cell_count", len(stream.cells)))
        at += 4
        for i, cell in enumerate(stream.cells):
            entries.append((f"{where} cell {i} pos, n_seq_id", [cell.pos, len(cell.seq_ids)]))
            ids = list(cell.seq_ids)
            entries.append((f"{where} cell {i} seq ids", ids[0] if len(ids) == 1 else ids))
            at += 8 + 4 * len(ids)
        if not stream.cells:
            continue
        entries.append((f"{where} v_trans, n_layer", [int(stream.v_trans), stream.n_layer]))
        at += 8
        for kind, tensors in (("k", stream.k), ("v", stream.v)):
            for j, tensor in enumerate(tensors):
                if tensor.transposed:
                    entries.append((f"{where} {kind}[{j}] type, element bytes, n_embd_v_gqa",
                                    [tensor.type_id, tensor.row_bytes, tensor.n_embd]))
                    rows.append((f"{where} {kind}[{j}] transposed rows", at + 12, tensor.rows))
                else:
                    entries.append((f"{where} {kind}[{j}] type, row bytes", [tensor.type_id, tensor.row_bytes]))
                    rows.append((f"{where} {kind}[{j}] rows", at + 12, tensor.rows))
                at += 12 + tensor.rows.nbytes
    return entries, rows, at


@pytest.mark.parametrize("name,item", list(_artifacts()))
def test_every_recorded_kv_section_parses_as_the_recorder_split_it_and_composes_back(name, item):
    record = RECORDS[name]
    kv, data, seq_id = _kv_bytes(record, item)
    if kv is None:
        return
    section = parse_kv_section(kv, seq_id)
    assert compose_kv_section(section) == kv
    assert section.nbytes == len(kv)
    layout = {entry[0]: entry for entry in item["layout"] if entry[0].startswith("kv ")}
    base = layout["kv n_stream"][1]
    entries, rows, end = _layout_of(section, base)
    assert end == base + len(kv)
    assert {key: value for key, value in entries} == {key: entry[3] for key, entry in layout.items()
                                                      if entry[3] is not None}
    for key, offset, array in rows:
        assert layout[key][1:3] == [offset, array.nbytes]
        assert data[offset:offset + array.nbytes] == array.tobytes()
    context = record["context"]
    assert len(section.streams) == (1 if context["kv_unified"] else context["n_seq_max"])
    for stream in section.streams:
        if stream.cells:
            assert stream.v_trans == (not context["flash_attn"])
            assert stream.n_layer == len(record["shape"]["attention_layers"])
        if seq_id >= 0:
            assert all(cell.seq_ids == (seq_id,) for cell in stream.cells)


def test_a_parsed_section_holds_views_of_the_bytes_and_its_cells():
    data = (DATA / "jamba_fa_unified" / "context.blob").read_bytes()
    framing = unframe(data, -1, kv_section=True).framing
    view = memoryview(data)[framing.kv_offset:framing.section_offset]
    section = parse_kv_section(view)
    stream = section.streams[0]
    assert all(np.shares_memory(tensor.rows, np.frombuffer(data, dtype=np.uint8)) for tensor in stream.k + stream.v)
    assert stream.k[0].rows.shape == (len(stream.cells), 16)
    # seq 3 was forked from seq 0 in a unified cache: seq 0's cells list both
    assert stream.cells[0] == KvCell(0, (0, 3))
    assert sum(cell.seq_ids == (0, 3) for cell in stream.cells) == 5


def test_transposed_v_read_by_cell_equals_the_flash_attention_rows():
    """The same model and tokens with flash attention off (V transposed) and on (V by cell): seq 0's
    V rows, gathered per cell from the transposed runs, are the same values (f16, up to the last bits
    the two attention kernels round differently before the next layer's K and V)."""
    sections = {}
    for name in ("jamba", "jamba_fa_unified"):
        kv, _, _ = _kv_bytes(RECORDS[name], next(item for item in RECORDS[name]["seq_blobs"]
                                                 if item["seq_id"] == 0 and not item.get("flags", 0)))
        sections[name] = parse_kv_section(kv, 0)
    transposed = next(stream for stream in sections["jamba"].streams if stream.cells)
    by_cell = sections["jamba_fa_unified"].streams[0]
    assert transposed.v_trans and not by_cell.v_trans
    assert [cell.pos for cell in transposed.cells] == [cell.pos for cell in by_cell.cells]
    for il in range(transposed.n_layer):
        assert transposed.v[il].transposed and not by_cell.v[il].transposed
        for gathered, rows in ((transposed.v[il].by_cell(), by_cell.v[il].by_cell()),
                               (transposed.k[il].rows, by_cell.k[il].rows)):
            assert gathered.shape == rows.shape == (len(by_cell.cells), 16)
            np.testing.assert_allclose(gathered.view("<f2"), rows.view("<f2"), rtol=2e-2, atol=2e-3)


def _small_section(v_trans: bool, ext: bool) -> bytes:
    """A two-stream section built field by field (an empty stream, then 2 cells, 1 layer)."""
    cells = [KvCell(3, (0,), (1, 2, 3) if ext else None), KvCell(4, (0, 1), (4, 5, 6) if ext else None)]
    k = KvTensor(1, 4, np.arange(8, dtype=np.uint8).reshape(2, 4))
    v = (KvTensor(1, 2, np.arange(12, dtype=np.uint8).reshape(3, 4), n_embd=3) if v_trans
         else KvTensor(1, 6, np.arange(12, dtype=np.uint8).reshape(2, 6)))
    return compose_kv_section(KvSection((KvStream(()), KvStream(tuple(cells), v_trans, (k,), (v,))), ext, 0))


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("ext", [False, True])
def test_a_composed_section_is_llamacpps_layout_and_parses_back(v_trans, ext):
    data = _small_section(v_trans, ext)
    expected = struct.pack("<III", 2, 0, 2) + struct.pack("<iI", 3, 1)
    expected += struct.pack("<iii", 1, 2, 3) if ext else b""
    expected += struct.pack("<i", 0) + struct.pack("<iI", 4, 2) + (struct.pack("<iii", 4, 5, 6) if ext else b"")
    expected += struct.pack("<ii", 0, 1) + struct.pack("<II", int(v_trans), 1)
    expected += struct.pack("<iQ", 1, 4) + bytes(range(8))
    expected += (struct.pack("<iII", 1, 2, 3) if v_trans else struct.pack("<iQ", 1, 6)) + bytes(range(12))
    assert data == expected
    section = parse_kv_section(data, cell_ext=ext)
    assert compose_kv_section(section) == data
    assert section.streams[1].cells[1].ext == ((4, 5, 6) if ext else None)


def test_every_truncation_of_a_section_is_a_state_error():
    for ext in (False, True):
        data = _small_section(not ext, ext)
        for cut in range(len(data)):
            with pytest.raises(StateError):
                parse_kv_section(data[:cut], cell_ext=ext)
        with pytest.raises(StateError, match=f"1 trailing bytes after byte {len(data)} "):
            parse_kv_section(data + b"\0", cell_ext=ext)


def test_every_truncation_of_a_recorded_blob_in_its_kv_section_is_a_state_error():
    """(The recurrent section after it is the cache's reader's to check, with its geometry.)"""
    data = (DATA / "jamba" / "seq1.blob").read_bytes()
    kv_end = unframe(data, 1, kv_section=True).framing.section_offset
    for cut in range(kv_end):
        with pytest.raises(StateError):
            unframe(data[:cut], 1, kv_section=True, kv_cell_ext=False)


def test_damaged_bytes_raise_state_error_or_compose_back_exactly():
    """Bytes changed at random places in a recorded section: a StateError, or a section that
    composes to exactly the damaged bytes (a changed pos or row is still a section)."""
    kv, _, _ = _kv_bytes(RECORDS["nemotron_h_unified"], RECORDS["nemotron_h_unified"]["context_blob"])
    rng = np.random.default_rng(26)
    cache = Geometry(n_layer=4, n_embd_r=192, n_embd_s=256, size=5, layers=(0, 3))
    for _ in range(400):
        damaged = bytearray(kv)
        for at in rng.integers(0, 400, size=rng.integers(1, 4)):
            damaged[at] = int(rng.integers(0, 256))
        try:
            section = parse_kv_section(bytes(damaged), cell_ext=bool(rng.integers(0, 2)), cache=cache)
        except StateError:
            continue
        assert compose_kv_section(section) == bytes(damaged)


@pytest.mark.parametrize("field,value,message", [
    (0, 6, "KV section n_stream 6 at byte 0 is more than the cache's sequences 5"),
    (4, 2**31, "KV section stream 0 cell_count 2147483648 at byte 4 is more than max_tokens"),
    (12, 9, "KV section stream 0 cell 0 n_seq_id 9 at byte 12 is more than the cache's sequences 5"),
])
def test_counts_are_bounded_before_they_are_read(field, value, message):
    kv, _, _ = _kv_bytes(RECORDS["nemotron_h_unified"], RECORDS["nemotron_h_unified"]["context_blob"])
    damaged = bytearray(kv)
    struct.pack_into("<I", damaged, field, value)
    cache = Geometry(n_layer=4, n_embd_r=192, n_embd_s=256, size=5, layers=(0, 3))
    with pytest.raises(StateError, match=message):
        parse_kv_section(bytes(damaged), cache=cache)


def test_a_sequence_section_lists_one_seq_id_per_cell():
    kv, _, _ = _kv_bytes(RECORDS["jamba_fa_unified"], RECORDS["jamba_fa_unified"]["context_blob"])
    parse_kv_section(kv, -1)
    with pytest.raises(StateError, match="cell 0 has n_seq_id 2 at byte 12 .a sequence's KV cell lists one"):
        parse_kv_section(kv, 0)


def test_a_composed_section_must_be_consistent():
    k = KvTensor(1, 4, np.zeros((2, 4), dtype=np.uint8))
    one_cell = (KvCell(0, (0,)),)
    with pytest.raises(StateError, match=r"KV rows of shape \(2, 4\) for 1 cells"):
        compose_kv_section(KvSection((KvStream(one_cell, False, (k,), (k,)),), False, 0))
    with pytest.raises(StateError, match="1 K layers and 0 V layers"):
        compose_kv_section(KvSection((KvStream(one_cell, False, (k,), ()),), False, 0))
    with pytest.raises(StateError, match="no extended position"):
        compose_kv_section(KvSection((KvStream(one_cell, False, (), ()),), True, 0))
