"""Mamba-2 without torch: batched runs through the cache equal solo runs, on both engines and every state
dtype; GGUF files round-trip with llama.cpp's names and shapes; state blobs move between caches."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.models import Mamba2Model, ModelError, ReferenceRun, load_gguf, random_mamba2_model, write_gguf
from recurrent_cache.models.gguf_file import GGUFFile

PROMPTS = [[5, 17, 200, 3, 9, 41, 8], [250, 1, 2], [77]]


def served_rows(rc, model, dtype: str, n_ubatch: int) -> list[tuple[int, np.ndarray]]:
    """(seq, last logits) after the prompts in one batch and three decode steps."""
    cache = rc.RecurrentCache(model.hparams.n_layer, model.hparams.n_embd_r, model.hparams.n_embd_s, n_seq_max=3,
                              dtype_r=dtype, dtype_s=dtype)
    tokens = [t for p in PROMPTS for t in p]
    pos = [i for p in PROMPTS for i in range(len(p))]
    seq_id = [s for s, p in enumerate(PROMPTS) for _ in p]
    st = cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id, logits=[1] * len(tokens)), n_ubatch)
    logits = model.forward(st)
    rows = [(seq_id[i], row) for i, row in zip(st.out_ids, logits)]
    for step in range(3):
        batch = rc.Batch(token=[10 + step] * 3, pos=[len(p) + step for p in PROMPTS], seq_id=[0, 1, 2], logits=[1] * 3)
        st = cache.init_batch(batch, n_ubatch)
        rows += [([0, 1, 2][i], row) for i, row in zip(st.out_ids, model.forward(st))]
    return rows


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_batched_equals_solo(rc, dtype):
    model = random_mamba2_model(seed=3, n_embd=32, n_layer=2, d_state=8, head_dim=8, n_group=2)
    rows = served_rows(rc, model, dtype, n_ubatch=3)
    for seq, prompt in enumerate(PROMPTS):
        solo = ReferenceRun(model, dtype, dtype).feed(prompt + [10, 11, 12])
        got = np.array([row for s, row in rows if s == seq])
        # per-token rounding of the state: the split into ubatches changes nothing, even with f16 states
        # (up to the order of float64 sums in batched matrix products)
        np.testing.assert_allclose(got, solo, rtol=1e-9, atol=1e-9 * np.abs(solo).max())


def test_cache_rows_have_llama_cpp_widths():
    model = random_mamba2_model(seed=0, n_embd=32, n_layer=1, d_state=8, head_dim=16, n_group=2, d_conv=3)
    p = model.hparams
    cache = model.new_cache()
    assert cache.n_embd_r == (3 - 1) * (64 + 2 * 2 * 8) and cache.n_embd_s == 8 * 64
    assert (p.n_head, p.head_dim) == (4, 16)


def test_gguf_round_trip_with_llama_cpp_names(tmp_path):
    model = random_mamba2_model(seed=1, n_embd=32, n_layer=2, d_state=8, head_dim=8, n_group=2)
    path = tmp_path / "m2.gguf"
    write_gguf(model, path)
    file = GGUFFile(path)
    assert file.fields["general.architecture"] == "mamba2"
    assert file.fields["mamba2.ssm.group_count"] == 2 and file.fields["mamba2.ssm.time_step_rank"] == 8
    assert file.tensors["blk.0.ssm_a"].shape == (8, 1) and file.tensors["blk.0.ssm_d"].shape == (8, 1)
    assert file.tensors["blk.0.ssm_norm.weight"].shape == (2, 32)
    assert "blk.1.ssm_dt.bias" in file.tensors and "output.weight" in file.tensors
    loaded = load_gguf(path)
    assert isinstance(loaded, Mamba2Model)
    tokens = [4, 8, 15, 16, 23, 42]
    np.testing.assert_allclose(ReferenceRun(loaded).feed(tokens), ReferenceRun(model).feed(tokens),
                               rtol=0, atol=1e-5)   # the file holds f32 weights


def test_state_moves_between_caches(rc):
    model = random_mamba2_model(seed=2, n_embd=32, n_layer=2, d_state=8, head_dim=8)
    first = rc.RecurrentCache(2, model.hparams.n_embd_r, model.hparams.n_embd_s, n_seq_max=2)
    model.forward(first.init_batch(rc.Batch(token=[1, 2, 3, 4], seq_id=[1] * 4), 4))
    second = rc.RecurrentCache(2, model.hparams.n_embd_r, model.hparams.n_embd_s, n_seq_max=1)
    second.state_read(first.state_write(1), 0)
    moved = model.forward(second.init_batch(rc.Batch(token=[5], pos=[4], seq_id=[0]), 4))
    solo = ReferenceRun(model).feed([1, 2, 3, 4, 5])[-1]
    np.testing.assert_allclose(moved[0], solo, rtol=1e-9, atol=1e-9 * np.abs(solo).max())


def test_bad_hyper_parameters_are_refused():
    with pytest.raises(ModelError, match="not a multiple of head_dim"):
        random_mamba2_model(n_embd=32, head_dim=24)
    with pytest.raises(ModelError, match="n_head 4 is not a multiple of n_group 3"):
        random_mamba2_model(n_embd=32, head_dim=16, n_group=3)


def test_a_wrong_shape_is_named():
    model = random_mamba2_model(seed=0, n_embd=32, n_layer=1, d_state=8, head_dim=8, n_group=2)
    layer = model.layers[0]
    bad = type(layer)(**{**vars(layer), "ssm_norm": layer.ssm_norm.reshape(2, 32)})
    with pytest.raises(ModelError, match=r"blk\.0\.ssm_norm\.weight has shape \(2, 32\), expected \(64,\)"):
        Mamba2Model(model.hparams, model.token_embd, [bad], model.output_norm, model.output)
