"""State blobs written by llama.cpp itself read back and re-written byte for byte.

tests/data/llamacpp_blobs.jsonl.gz (README §3): 229 blobs, 91 of whole
caches and 138 of single sequences, from 3-layer f32 caches and from
tiny-mamba.gguf's shapes.
"""

import base64

import pytest
from golden import load

BLOBS = load("llamacpp_blobs.jsonl")


def test_all_blobs_are_here():
    assert len(BLOBS) == 229
    assert sum(record["seq_id"] == -1 for record in BLOBS) == 91


@pytest.mark.parametrize("record", BLOBS, ids=lambda r: f"script{r['source_script']}-op{r['source_op']}"
                                                      f"-seq{r['seq_id']}")
def test_llamacpp_blob_reads_and_writes_back_identically(rc, record):
    blob = base64.b64decode(record["blob_b64"])
    assert len(blob) == record["n_bytes"]
    cache = rc.RecurrentCache(record["n_layer"], record["n_embd_r"], record["n_embd_s"],
                              n_seq_max=record["size"], size=record["size"],
                              dtype_r=record["dtype_r"], dtype_s=record["dtype_s"])
    assert cache.state_read(blob, seq_id=record["seq_id"]) == len(blob)
    cache.check()
    assert cache.state_write(seq_id=record["seq_id"]) == blob
    assert cache.state_size(seq_id=record["seq_id"]) == len(blob)
    if record["seq_id"] >= 0 and record["cell_count"] == 1:
        assert cache.used == 1   # a sequence read into an empty cache fills one cell
