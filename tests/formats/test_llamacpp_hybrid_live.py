"""Current llama.cpp, live: recording the hybrids again reproduces ``tests/data/llamacpp_hybrid``.

Marked ``llamacpp_live`` and skipped unless ``llama_cpp`` (llama-cpp-python) and ``gguf`` import.
``tools/record_llamacpp_hybrid.py`` run into a fresh directory writes the same GGUFs, blobs and files
of the same lengths with the same cells, framings and KV and recurrent headers, every one accepted
back by llama.cpp and continuing to the committed logits.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from recurrent_cache.formats.framings import unframe
from recurrent_cache.formats.kv import parse_kv_section

pytestmark = pytest.mark.llamacpp_live

llama_cpp = pytest.importorskip("llama_cpp", reason="needs llama-cpp-python")
pytest.importorskip("gguf", reason="the recorder writes the hybrid GGUFs with gguf")

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "llamacpp_hybrid"
COMMITTED = {path.parent.name: json.loads(path.read_text()) for path in sorted(DATA.glob("*/record.json"))}


def _tool():
    path = ROOT / "tools" / "record_llamacpp_hybrid.py"
    spec = importlib.util.spec_from_file_location("record_llamacpp_hybrid", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _headers(data: bytes, seq_id: int, partial: bool):
    """A blob's framing offsets and its KV section without the row bytes (cells, v_trans, K/V headers)."""
    framing = unframe(data, seq_id, kv_section=not partial).framing
    if partial:
        return framing.section_offset, None
    kv = parse_kv_section(data[framing.kv_offset:framing.section_offset], seq_id)
    return (framing.kv_offset, framing.section_offset), [
        (stream.cells, stream.v_trans, [(t.type_id, t.row_bytes, t.n_embd) for t in stream.k + stream.v])
        for stream in kv.streams]


def test_a_new_recording_reproduces_the_committed_one(tmp_path):
    version = next(iter(COMMITTED.values()))["llama_cpp"]["llama_cpp_python"]
    if llama_cpp.__version__ != version:
        pytest.skip(f"llama-cpp-python {llama_cpp.__version__}, the recording is from {version}")
    fresh = _tool().record(tmp_path)
    assert set(fresh) == set(COMMITTED)
    for name, old in COMMITTED.items():
        new = fresh[name]
        assert (tmp_path / new["model"]).read_bytes() == (DATA / old["model"]).read_bytes()   # a fixed seed
        for key in ("tokens", "kv_cells", "seq_positions", "shape", "flash_attn", "n_seq_max"):
            assert new[key] == old[key], (name, key)
        assert set(new["files"]) == set(old["files"])
        for file, old_item in old["files"].items():
            new_item = new["files"][file]
            assert new_item["size"] == old_item["size"] and new_item["accepted"], (name, file)
            seq_id = old_item.get("seq_id", -1)
            partial = old_item.get("flags") == 1
            assert _headers((tmp_path / name / file).read_bytes(), seq_id, partial) == _headers(
                (DATA / name / file).read_bytes(), seq_id, partial), (name, file)
            for seq, logits in old_item["logits"].items():
                assert np.abs(np.subtract(new_item["logits"][seq], logits)).max() <= 1e-5, (name, file)
