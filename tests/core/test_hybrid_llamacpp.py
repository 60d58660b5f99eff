"""llama.cpp's own hybrid states loaded into a ``HybridCache`` and written back byte for byte.

``tests/data/llamacpp_hybrid`` holds what llama.cpp 0.3.36 wrote for a tiny Jamba (Mamba-1 +
attention without RoPE) and a Granite-4 hybrid (Mamba-2 + attention with RoPE), flash attention off
(V transposed) and on: the whole context, each sequence with and without PARTIAL_ONLY, 'ggsq' and
session files.  Each is read into a memory of the recording's shape, which then writes the same
bytes: every cell, K, V, r and s row as llama.cpp held it.  llama.cpp continuing from the package's
bytes is checked where llama-cpp-python is installed (``tests/formats/test_llamacpp_hybrid_live.py``
for the recordings; the package's own bytes are those same bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recurrent_cache.formats.blob import blob_view
from recurrent_cache.formats.framings import unframe
from recurrent_cache.hybrid import HybridCache

DATA = Path(__file__).resolve().parent.parent / "data" / "llamacpp_hybrid"
RECORDINGS = sorted(path.name for path in DATA.iterdir() if (path / "record.json").exists())
ENGINES = ["compiled", "reference"]


def record(name: str) -> dict:
    return json.loads((DATA / name / "record.json").read_text())


def memory(name: str, engine: str) -> HybridCache:
    """An empty hybrid memory of the recording's shape."""
    rec = record(name)
    shape = rec["shape"]
    (il,) = shape["attention_layers"]
    return HybridCache(shape["n_layer"], attn_layers=shape["attention_layers"], recr_layers=shape["recurrent_layers"],
                       n_embd_k=shape["n_embd_k_gqa"][il], n_embd_v=shape["n_embd_v_gqa"][il],
                       n_embd_r=shape["n_embd_r"], n_embd_s=shape["n_embd_s"], kv_size=rec["n_ctx"],
                       n_seq_max=rec["n_seq_max"], dtype_k=shape["kv_type"], dtype_v=shape["kv_type"],
                       v_trans=not rec["flash_attn"], engine=engine)


def test_every_recording_is_here():
    assert RECORDINGS == ["granitehybrid_fa_off", "granitehybrid_fa_on", "jamba_fa_off", "jamba_fa_on"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", RECORDINGS)
def test_the_whole_context_loads_and_writes_back_the_same_bytes(name, engine):
    rec = record(name)
    blob = (DATA / name / "context.blob").read_bytes()
    cache = memory(name, engine)
    assert cache.state_read(blob, arch=rec["arch"]) == len(blob)
    assert cache.state_write(framing="llama", arch=rec["arch"]) == blob
    assert [[c[0], list(c[1])] if c else None for c in cache.kv_cells()[:len(rec["kv_cells"])]] == \
        [[pos, seqs] for pos, seqs in rec["kv_cells"]]
    for seq, (low, high) in rec["seq_positions"].items():
        assert (cache.seq_pos_min(int(seq)), cache.seq_pos_max(int(seq))) == (low, high)
    cache.check()
    session = (DATA / name / "session.ggsn").read_bytes()
    other = memory(name, engine)
    other.state_read(session, arch=rec["arch"])
    assert other.state_write(framing="llama", arch=rec["arch"]) == blob


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", RECORDINGS)
def test_each_sequence_loads_and_writes_back_the_same_bytes(name, engine):
    rec = record(name)
    whole = memory(name, engine)
    whole.state_read((DATA / name / "context.blob").read_bytes(), arch=rec["arch"])
    for seq in range(rec["n_seq_max"]):
        blob = (DATA / name / f"seq{seq}.blob").read_bytes()
        assert whole.state_write(seq, framing="llama") == blob        # the same sequence, written from the whole
        alone = memory(name, engine)
        alone.state_read(blob, seq)
        assert alone.state_write(seq, framing="llama") == blob
        assert alone.seq_pos_max(seq) == rec["seq_positions"][str(seq)][1]
        ggsq = (DATA / name / f"seq{seq}.ggsq").read_bytes()
        from_file = memory(name, engine)
        from_file.state_read(ggsq, seq)
        assert from_file.state_write(seq, framing="llama") == blob
        partial = (DATA / name / f"seq{seq}.partial.blob").read_bytes()
        assert whole.state_write(seq, framing="llama", partial_only=True) == partial
        whole.state_read(partial, seq, partial_only=True)
        assert whole.state_write(seq, framing="llama") == blob


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_sequence_moved_between_memories_is_the_recorded_one(name):
    """Sequence 2 (a fork of 0) read into a memory that holds 0 and 1 from the whole context."""
    rec = record(name)
    cache = memory(name, "compiled")
    cache.state_read((DATA / name / "context.blob").read_bytes(), arch=rec["arch"])
    cache.seq_rm(2, -1, -1)
    blob = (DATA / name / "seq2.blob").read_bytes()
    cache.state_read(blob, 2)
    assert cache.state_write(2, framing="llama") == blob
    for seq in (0, 1):
        assert cache.state_write(seq, framing="llama") == (DATA / name / f"seq{seq}.blob").read_bytes()
    section = unframe(blob_view(blob), 2, kv_section=True).framing
    assert section.kv_offset == 8
