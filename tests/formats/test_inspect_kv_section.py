"""``inspect`` of a hybrid's state describes its attention KV section and its recurrent section.

On the llama.cpp recordings of ``tests/data/llamacpp_hybrid`` (a Jamba and a Granite-4 hybrid,
flash attention off and on): the report's KV streams hold the recorded cells, the attention layers' K and V types and
widths and the recorded V layout, and the recurrent section after it its cells and layers; the
text report says the same; read from a pipe it is the same report; a damaged KV section is one
line on stderr naming the field.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from recurrent_cache.blob_report import describe_file
from recurrent_cache.cli import inspect as inspect_command
from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.kv import KvCell, KvSection, compose_kv_section, parse_kv_section

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_hybrid"
RECORDINGS = {path.parent.name: json.loads(path.read_text()) for path in sorted(DATA.glob("*/record.json"))}
FILES = [pytest.param(name, file, id=f"{name}/{file}") for name, record in RECORDINGS.items()
         for file, item in record["files"].items() if not item.get("flags")]


def _layers(name):
    return ",".join(map(str, RECORDINGS[name]["shape"]["recurrent_layers"]))


def _report(name, file):
    record = RECORDINGS[name]
    with open(DATA / name / file, "rb") as handle:
        return describe_file(handle, kv_section=True, layers=tuple(record["shape"]["recurrent_layers"]))


def _expected_cells(record, seq_id):
    if seq_id < 0:
        return [{"pos": pos, "seq_ids": ids} for pos, ids in record["kv_cells"]]
    return [{"pos": pos, "seq_ids": [seq_id]} for pos, ids in record["kv_cells"] if seq_id in ids]


def run(argv):
    """(exit status, stdout, stderr) of the command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = inspect_command.main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name,file", FILES)
def test_the_report_gives_the_kv_streams_cells_layers_and_v_layout(name, file):
    record = RECORDINGS[name]
    item = record["files"][file]
    seq_id = item.get("seq_id", -1)
    report = _report(name, file)
    (stream,) = report["kv_streams"]
    assert stream["cells"] == _expected_cells(record, seq_id)
    assert stream["cell_count"] == len(stream["cells"])
    assert stream["v_trans"] is (not record["flash_attn"])
    assert stream["n_layer"] == len(record["shape"]["attention_layers"]) == 1
    width = record["shape"]["n_embd_k_gqa"][record["shape"]["attention_layers"][0]]
    assert stream["k"] == [{"type": "f16", "type_id": 1, "row_bytes": 2 * width, "n_embd": width,
                            "transposed": False}]
    v_row = 2 if stream["v_trans"] else 2 * width   # one element when transposed, one cell's row else
    assert stream["v"] == [{"type": "f16", "type_id": 1, "row_bytes": v_row, "n_embd": width,
                            "transposed": stream["v_trans"]}]
    # the recurrent section after it
    start, end = report["kv_section"]
    assert end == report["blob_offset"] and report["blob_bytes"] == (DATA / name / file).stat().st_size - end
    last = {int(seq): len(tokens) - 1 for seq, tokens in record["tokens"].items()}
    if seq_id < 0:
        assert sorted((cell["seq_ids"], cell["pos"]) for cell in report["cells"]) == [
            ([seq], pos) for seq, pos in sorted(last.items())]
    else:
        assert report["cells"] == [{"pos": last[seq_id], "seq_ids": []}]
    assert [tensor["tensor"] for tensor in report["tensors"]] == [f"layer {il} {which}" for which in "rs"
                                                                  for il in record["shape"]["recurrent_layers"]]


def test_a_report_without_a_kv_section_has_no_kv_streams():
    with open(DATA / "jamba_fa_off" / "seq0.partial.blob", "rb") as handle:   # PARTIAL_ONLY: the recurrent half
        report = describe_file(handle, layers=(0, 1, 3))
    assert report["cells"] == [{"pos": 4, "seq_ids": []}]
    assert report["kv_section"] is None and report["kv_streams"] is None


@pytest.mark.parametrize("name", RECORDINGS)
def test_the_text_report_describes_both_sections(name):
    status, out, err = run([str(DATA / name / "context.blob"), "--kv-section", "--layers", _layers(name),
                            "--max-cells", "0"])
    framing = unframe((DATA / name / "context.blob").read_bytes(), -1, kv_section=True).framing
    size = (DATA / name / "context.blob").stat().st_size
    assert status == 0 and not err
    lines = out.splitlines()
    kv_at = lines.index(next(line for line in lines if line.startswith("attention KV section:")))
    assert lines[kv_at] == (f"attention KV section: {framing.section_offset - framing.kv_offset} bytes at byte "
                            f"{framing.kv_offset}, 1 stream")
    layout = "V transposed (v_trans 1" if not RECORDINGS[name]["flash_attn"] else "V by cell (v_trans 0"
    assert lines[kv_at + 1].startswith(f"  stream 0: 14 cells, 1 attention layer, {layout}")
    cells = [line.split() for line in lines[kv_at + 2:kv_at + 16]]
    assert [[int(words[3]), [int(seq) for seq in words[6:]]] for words in cells] == RECORDINGS[name]["kv_cells"]
    assert lines[kv_at + 16].startswith("    attention layer 0 K  f16    row bytes 16, n_embd 8")
    v_line = ("8 runs of 2-byte elements, one per cell" if not RECORDINGS[name]["flash_attn"]
              else "row bytes 16, n_embd 8")
    assert lines[kv_at + 17] == f"    attention layer 0 V  f16    {v_line}"
    assert lines[kv_at + 18] == (f"recurrent section: {size - framing.section_offset} bytes at byte "
                                 f"{framing.section_offset}, whole-cache")


def test_the_text_report_cuts_a_streams_cells_short_unless_asked():
    _, out, _ = run([str(DATA / "jamba_fa_on" / "seq1.blob"), "--kv-section", "--layers", "0,1,3",
                     "--max-cells", "3"])
    assert "    ... 4 more (--max-cells 0 lists all)" in out.splitlines()


def test_a_pipe_gives_the_same_report():
    """Read from a pipe (no seeking back), the KV streams are seen as the bytes go by."""
    data = (DATA / "granitehybrid_fa_off" / "context.blob").read_bytes()
    read_end, write_end = os.pipe()

    def feed():
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        report = describe_file(pipe, kv_section=True, layers=(0, 2, 3))
    writer.join()
    assert report == _report("granitehybrid_fa_off", "context.blob")


def _v_trans_offset():
    """Where the stream's v_trans is in jamba_fa_off/context.blob: after the arch string, n_stream,
    cell_count and the cells."""
    return 9 + 4 + 4 + sum(8 + 4 * len(ids) for _, ids in RECORDINGS["jamba_fa_off"]["kv_cells"])


@pytest.mark.parametrize("offset,value,message", [
    (_v_trans_offset(), 3, r"KV section stream 0 v_trans is 3 at byte \d+, expected 0 or 1"),
    (9 + 4, 2**31, "KV section stream 0 cell_count 2147483648 at byte 13 is more than max_tokens"),
])
def test_a_damaged_kv_section_is_one_line_naming_the_field(tmp_path, offset, value, message):
    data = bytearray((DATA / "jamba_fa_off" / "context.blob").read_bytes())
    struct.pack_into("<I", data, offset, value)
    path = tmp_path / "damaged.blob"
    path.write_bytes(bytes(data))
    status, out, err = run([str(path), "--kv-section", "--layers", "0,1,3"])
    assert status == 1 and not out
    assert err.count("\n") == 1 and err.startswith(f"inspect: {path}: not a valid state blob")
    assert re.search(message, err)


def test_a_stream_per_sequence_is_reported_stream_by_stream():
    """llama.cpp's KV cache without kv_unified (tests/data/llamacpp_current's jamba): a sequence's
    section visits every stream, the others writing 0 cells."""
    path = DATA.parent / "llamacpp_current" / "jamba" / "seq1.blob"
    with open(path, "rb") as handle:
        report = describe_file(handle, kv_section=True, layers=(0, 2, 3))
    assert [stream["cell_count"] for stream in report["kv_streams"]] == [0, 7, 0, 0]
    assert report["kv_streams"][0] == {"cell_count": 0, "v_trans": False, "n_layer": 0, "cells": [], "k": [], "v": []}
    assert {seq for cell in report["kv_streams"][1]["cells"] for seq in cell["seq_ids"]} == {1}
    status, out, _ = run([str(path), "--kv-section", "--layers", "0,2,3"])
    assert status == 0
    assert "attention KV section: " in out and ", 4 streams\n" in out
    assert "  stream 0: 0 cells\n  stream 1: 7 cells, 2 attention layers, V transposed" in out


def test_cells_with_the_extended_position_are_reported_with_it(tmp_path):
    """A model with M-RoPE writes (x, y, token) after each KV cell's n_seq_id: the section here
    is the recorded one with such positions added (composed by ``formats.kv``)."""
    split_at = unframe((DATA / "jamba_fa_off" / "seq0.blob").read_bytes(), 0, kv_section=True).framing
    data = (DATA / "jamba_fa_off" / "seq0.blob").read_bytes()
    section = parse_kv_section(data[split_at.kv_offset:split_at.section_offset], 0)
    (stream,) = section.streams
    cells = tuple(KvCell(cell.pos, cell.seq_ids, (cell.pos, 2 * cell.pos, 7 + i))
                  for i, cell in enumerate(stream.cells))
    with_ext = compose_kv_section(KvSection((replace(stream, cells=cells),), True, 0))
    path = tmp_path / "ext.blob"
    path.write_bytes(data[:split_at.kv_offset] + with_ext + data[split_at.section_offset:])
    with open(path, "rb") as handle:
        report = describe_file(handle, kv_section=True, layers=(0, 1, 3))
    assert report["kv_cell_ext"] is True
    assert [cell["ext"] for cell in report["kv_streams"][0]["cells"]] == [list(cell.ext) for cell in cells]
    _, out, _ = run([str(path), "--kv-section", "--layers", "0,1,3"])
    assert ", cells with the extended position\n" in out
    assert "    cell     1  pos          1  seq ids 0  ext (x, y, token) 1, 2, 8\n" in out
