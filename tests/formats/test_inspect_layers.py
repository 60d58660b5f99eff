"""``python -m recurrent_cache inspect`` of a hybrid's blob: the layer filter (``--layers``).

A hybrid's recurrent section records the model's n_layer but holds r and s sections of its
recurrent layers only.  ``--layers 0,2,4-7`` names them; without it a blob whose sections fit no
layer is read with the empty filter, and one that ends after the sections of some of its layers
is refused in one line saying how many and asking for ``--layers`` (the bytes do not say which).  Contradictory
input (a layer past n_layer, a filter whose count does not fit the bytes, a malformed list) is
one line and a non-zero exit.  The reported statistics are checked against numpy over the
cache's own rows, and the recorded llama.cpp hybrids are inspected with their recurrent layers.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.cli import inspect as inspect_command

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp_current"
N_LAYER, LAYERS = 4, (0, 2)


def run(argv):
    """(exit status, stdout, stderr) of the command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = inspect_command.main([str(a) for a in argv])
        except SystemExit as exit:
            status = exit.code
    return status, out.getvalue(), err.getvalue()


def run_through_pipe(data):
    """The command on a FIFO fed ``data`` (a stream: read once, no seeking)."""
    directory = tempfile.mkdtemp()
    fifo = os.path.join(directory, "state.fifo")
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: Path(fifo).write_bytes(data))
    writer.start()
    try:
        return run([fifo])
    finally:
        writer.join(timeout=30)


@pytest.fixture
def filtered_blob(tmp_path):
    cache = rc.RecurrentCache(N_LAYER, 3, 2, n_seq_max=3, layers=LAYERS)
    for _ in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 1, 2], pos=[0, 4, 9])):
        pass
    rng = np.random.default_rng(7)
    for array in cache.r + cache.s:
        if array is not None:
            array[...] = rng.standard_normal(array.shape)
    path = tmp_path / "hybrid.bin"
    path.write_bytes(cache.state_write())
    return cache, path


def test_layers_names_the_sections_and_the_statistics_are_the_rows(filtered_blob):
    cache, path = filtered_blob
    status, out, err = run([path, "--layers", "0,2", "--json"])
    assert status == 0, err
    report = json.loads(out)
    assert report["n_layer"] == N_LAYER and report["layers"] == list(LAYERS)
    assert report["reads_into"]["layers"] == list(LAYERS)
    labels = [t["tensor"] for t in report["tensors"]]
    assert labels == ["layer 0 r", "layer 2 r", "layer 0 s", "layer 2 s"]
    used = [cache.cell(i)[0] for i in range(cache.size)]
    assert [c["pos"] for c in report["cells"]] == [pos for pos in used if pos >= 0]
    for summary, array in zip(report["tensors"], [cache.r[0], cache.r[2], cache.s[0], cache.s[2]], strict=True):
        rows = array[: len(report["cells"])]
        assert summary["min"] == pytest.approx(float(rows.min()))
        assert summary["max"] == pytest.approx(float(rows.max()))
        assert summary["mean"] == pytest.approx(float(rows.astype(np.float64).mean()))
    status, text, _ = run([path, "--layers", "2,0"])   # any order
    assert status == 0 and "with recurrent state: 0,2" in text and "layers=(0, 2)" in text


def test_without_layers_the_count_is_told_and_the_names_asked_for(filtered_blob, tmp_path):
    # r rows of 3 values, s rows of 2: the first s section, read as layer 2's r, differs from r
    _, path = filtered_blob
    status, out, err = run([path])
    assert status == 1 and not out
    assert len(err.strip().splitlines()) == 1
    assert "layer 2 r is f32 with row size 8" in err
    assert "r and s sections of 2 of its 4 layers" in err and "--layers" in err
    # r and s rows alike: the sections run out where the s sections of every layer would start
    cache = rc.RecurrentCache(N_LAYER, 3, 3, n_seq_max=1, layers=LAYERS)
    alike = tmp_path / "alike.bin"
    alike.write_bytes(cache.state_write())
    for source in (alike, "pipe"):
        if source == "pipe":
            status, out, err = run_through_pipe(alike.read_bytes())
        else:
            status, out, err = run([alike])
        assert status == 1 and len(err.strip().splitlines()) == 1
        assert "truncated" in err and "r and s sections of 2 of its 4 layers" in err and "--layers" in err
    status, out, _ = run([alike, "--layers", "1,3"])
    assert status == 0 and "with recurrent state: 1,3" in out


@pytest.mark.parametrize("layers, message", [
    ("0,5", "n_layer 4 at byte .*, but the layer filter names layer 5"),
    ("0", "trailing bytes"),
    ("0-2", "layer 2 r is f32 with row size 8 .* a cache has one r type and row size"),   # s read as r
])
def test_a_filter_that_contradicts_the_bytes_is_one_line(filtered_blob, layers, message):
    _, path = filtered_blob
    status, out, err = run([path, "--layers", layers])
    assert status == 1 and not out and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.parametrize("layers", ["0,0", "3-1", "x", "1-", "-1", "0,70000"])
def test_a_malformed_layer_list_is_a_usage_error(filtered_blob, layers):
    _, path = filtered_blob
    status, out, err = run([path, f"--layers={layers}"])
    assert status == 2 and not out and len(err.strip().splitlines()) == 1, err


def test_a_blob_of_no_layer_is_read_with_the_empty_filter(tmp_path):
    cache = rc.RecurrentCache(3, 2, 2, n_seq_max=2, layers=())
    for _ in cache.init_batch(rc.Batch(token=[1, 2], seq_id=[0, 1], pos=[0, 5])):
        pass
    path = tmp_path / "draft.bin"
    path.write_bytes(cache.state_write())
    for argv in ([path, "--json"], [path, "--layers", "none", "--json"]):
        status, out, err = run(argv)
        assert status == 0, err
        report = json.loads(out)
        assert report["layers"] == [] and report["tensors"] == [] and len(report["cells"]) == 2


def test_a_recorded_hybrid_through_the_command(tmp_path):
    records = {r["scenario"]: r for r in map(json.loads, gzip.open(DATA / "records.jsonl.gz", "rt"))}
    record = records["jamba"]
    layers = ",".join(map(str, record["shape"]["recurrent_layers"]))
    item = record["seq_files"][0]
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(DATA / item["file"]),
                           "--kv-section", "--layers", layers, "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == item["tokens"] and report["layers"] == record["shape"]["recurrent_layers"]
    rs_start = next(offset for name, offset, _, _ in item["layout"] if name == "rs cell_count")
    assert report["blob_offset"] == rs_start
    assert [t["row_bytes"] for t in report["tensors"]] == [384] * 3 + [512] * 3
    done = subprocess.run([sys.executable, "-m", "recurrent_cache", "inspect", str(DATA / item["file"]),
                           "--kv-section"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "3 of its 5 layers" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
