"""``python -m recurrent_cache inspect FILE`` on blobs, sequence files and garbage."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_state_io import forked_cache

import recurrent_cache
from recurrent_cache import blob_report
from recurrent_cache.cli import inspect as inspect_command


@pytest.fixture
def cache():
    return forked_cache(recurrent_cache, "bf16", "f16")


def run(capsys, *argv):
    code = inspect_command.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_whole_cache_blob(cache, tmp_path, capsys):
    path = tmp_path / "state.bin"
    path.write_bytes(cache.state_write())
    code, out, err = run(capsys, path)
    assert code == 0 and err == ""
    assert "whole-cache" in out and "cells: 3" in out
    assert "pos          7  seq ids 3" in out and "seq ids 0 4 5" in out
    assert "layers: 2" in out
    assert out.count(" r    bf16 ") == 2 and out.count(" s    f16 ") == 2


def test_report_values_match_the_cache(cache, tmp_path, capsys):
    path = tmp_path / "state.bin"
    path.write_bytes(cache.state_write())
    code, out, _ = run(capsys, path, "--json")
    report = json.loads(out)
    assert code == 0 and report["kind"] == "whole-cache" and report["cell_count"] == 3
    assert report["cells"] == [{"pos": 0, "seq_ids": [1]}, {"pos": 7, "seq_ids": [3]},
                               {"pos": 0, "seq_ids": [0, 4, 5]}]
    tensors = list(cache.r) + list(cache.s)
    for summary, tensor in zip(report["tensors"], tensors):
        values = tensor[[1, 3, 4]].astype(np.float32)
        assert summary["min"] == values.min() and summary["max"] == values.max()
        assert summary["mean"] == pytest.approx(values.astype(np.float64).mean())
        assert summary["n_embd"] == tensor.shape[1]
    assert [t["type"] for t in report["tensors"]] == ["bf16", "bf16", "f16", "f16"]


def test_sequence_file(cache, tmp_path, capsys):
    path = tmp_path / "seq.ggsq"
    recurrent_cache.save_seq_file(path, cache, 3, list(range(20)))
    code, out, _ = run(capsys, path)
    assert code == 0
    assert "sequence file ('ggsq' version 3)" in out
    assert "tokens: 20 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ...]" in out
    assert "at byte 92, single-sequence" in out and "cells: 1" in out


def test_cell_list_is_cut_short_unless_asked(tmp_path, capsys):
    cache = recurrent_cache.RecurrentCache(1, 1, 1, n_seq_max=40)
    for _ in cache.init_batch(recurrent_cache.Batch(token=[0] * 40, pos=[0] * 40, seq_id=list(range(40)))):
        pass
    path = tmp_path / "state.bin"
    path.write_bytes(cache.state_write())
    assert "... 8 more" in run(capsys, path)[1]
    assert "more" not in run(capsys, path, "--max-cells", "0")[1]


@pytest.mark.parametrize("content,message", [
    (b"", "truncated at byte 0 of 0"),
    (b"hello world, not a blob", "not a valid state blob"),
    (struct.pack("<III", 0x67677371, 4, 0), "version 4 at byte 4, expected 3 or 2"),
    (struct.pack("<III", 0x67677371, 2, 5), "sequence file truncated"),
    (struct.pack("<IIII", 0, 1, 0, 0), "v_trans is 1"),
])
def test_anything_else_fails_cleanly(tmp_path, capsys, content, message):
    path = tmp_path / "junk"
    path.write_bytes(content)
    code, out, err = run(capsys, path)
    assert code == 1 and out == ""
    assert message in err and "Traceback" not in err


def test_missing_file_fails_cleanly(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "missing")
    assert code == 1 and "cannot read" in err


def test_command_line_entry_point(cache, tmp_path):
    path = tmp_path / "state.bin"
    path.write_bytes(cache.state_write(5))
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "single-sequence" in done.stdout
    path.write_bytes(b"\xff" * 7)
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "inspect:" in done.stderr


def test_the_report_names_the_smallest_cache_that_reads_the_blob(cache, tmp_path, capsys):
    path = tmp_path / "state.bin"
    path.write_bytes(cache.state_write())
    code, out, _ = run(capsys, path)
    assert code == 0
    assert ("reads into: RecurrentCache(n_layer=2, n_embd_r=2, n_embd_s=3, dtype_r='bf16', dtype_s='f16', "
            "size >= 6), state_read with seq_id -1") in out
    path.write_bytes(cache.state_write(3))
    assert "size >= 1), state_read with any seq_id" in run(capsys, path)[1]


# -- "valid" exactly when some cache's state_read accepts the blob -------------
#
# The oracle is brute force: every cache that could read a small blob (every
# size up to 9 and every seq id; the types and widths are those of the blob's
# layer 0, the only ones state_read's type and row-size checks let through,
# or any for a blob without layers) is tried with state_read.

def small_blob(cells, n_layer, tensors):
    out = struct.pack("<I", len(cells))
    for pos, ids in cells:
        out += struct.pack(f"<iI{len(ids)}i", pos, len(ids), *ids)
    out += struct.pack("<II", 0, n_layer)
    for type_id, row_bytes in tensors:
        out += struct.pack("<iQ", type_id, row_bytes) + bytes(range(row_bytes * len(cells)))
    return out


def some_cache_reads(data, n_layer, tensors):
    names = {0: "f32", 1: "f16", 30: "bf16"}
    sizes = {0: 4, 1: 2, 30: 2}
    if n_layer:
        (type_r, bytes_r), (type_s, bytes_s) = tensors[0], tensors[n_layer]
        if type_r not in names or type_s not in names or bytes_r % sizes[type_r] or bytes_s % sizes[type_s] \
                or not bytes_r:
            return False   # no cache has this layer 0, so none passes the checks of layer 0 (s may be 0 wide)
        shape = dict(n_embd_r=bytes_r // sizes[type_r], n_embd_s=bytes_s // sizes[type_s],
                     dtype_r=names[type_r], dtype_s=names[type_s])
    else:
        shape = dict(n_embd_r=1, n_embd_s=1)
    for size in range(1, 10):
        cache = recurrent_cache.RecurrentCache(n_layer, n_seq_max=size, **shape)
        for seq_id in range(-1, size):
            try:
                cache.state_read(data, seq_id)
                return True
            except recurrent_cache.StateError:
                pass
    return False


cell_strategy = st.tuples(st.sampled_from([-1, 0, 3, 2**31 - 1]),
                          st.lists(st.sampled_from([-1, 0, 1, 2, 7, 8]), max_size=3))
tensor_strategy = st.tuples(st.sampled_from([0, 1, 30, 2]), st.sampled_from([0, 2, 4, 6]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cells=st.lists(cell_strategy, max_size=4), n_layer=st.integers(0, 2), data=st.data())
def test_inspect_calls_valid_exactly_what_some_cache_reads(cells, n_layer, data):
    tensors = data.draw(st.lists(tensor_strategy, min_size=2 * n_layer, max_size=2 * n_layer))
    if n_layer and data.draw(st.booleans()):   # mostly uniform layers, as caches write them
        tensors = [tensors[0]] * n_layer + [tensors[n_layer]] * n_layer
    blob = small_blob(cells, n_layer, tensors)
    try:
        blob_report.describe(blob)
        valid = True
    except recurrent_cache.RecurrentCacheError:
        valid = False
    assert valid == some_cache_reads(blob, n_layer, tensors)


def test_a_defect_is_not_reported_as_an_unreadable_file(tmp_path, capsys):
    path = tmp_path / "blob"
    path.write_bytes(struct.pack("<IiIi", 1, -4, 1, 0) + struct.pack("<II", 0, 0))
    code, out, err = run(capsys, path)
    assert code == 1 and err == f"inspect: {path}: not a valid state blob or sequence file: " \
                                "state blob cell 0 has pos -4 at byte 4: positions must be in [0, 2**31 - 1)\n"
    code, _, err = run(capsys, "nul\0name")
    assert code == 1 and err == "inspect: cannot read 'nul\\x00name': embedded null byte\n"
