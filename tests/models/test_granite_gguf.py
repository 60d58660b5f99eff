"""Granite-4.0-H / Bamba GGUF files (llama.cpp's ``granitehybrid``) without llama.cpp at hand: a model
written reads back as the same model (its q / k rows permuted in the file for llama.cpp's "normal" rope and
back), a file's embedding / residual / logit scales are folded on reading as a checkpoint's multipliers are,
and what llama.cpp would run differently is refused before anything is written (or on reading)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recurrent_cache.errors import ModelError
from recurrent_cache.models import GraniteHybridModel, load_gguf, write_gguf
from recurrent_cache.models.bamba import GraniteHybridHParams, fold_multipliers, layer_shapes

from test_hybrid_gguf import _rewritten, decode

pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")

ENTRIES = [(token, pos, 0) for pos, token in enumerate([5, 17, 42, 3, 60, 33, 7])]


def granite(seed: int = 0, **changes: Any) -> GraniteHybridModel:
    """A random Granite-4.0-H: attention on layers 1 and 3 (rope over whole heads), Mamba-2 in 2 groups on
    0 and 2, 2 of 4 experts and a shared MLP, an attention scale of its own."""
    sizes = dict(n_vocab=64, n_embd=32, n_layer=4, n_head=4, n_head_kv=2, head_dim=8, n_ff=16, d_conv=4,
                 d_inner=64, d_state=8, n_ssm_head=4, attn_layers=(1, 3), n_group=2, n_expert=4,
                 n_expert_used=2, n_ff_shexp=24, n_rot=8, rope_base=100.0, attention_scale=0.2)
    p = GraniteHybridHParams(**(sizes | changes))
    rng = np.random.default_rng(seed)
    layers = [{name: (-np.exp(rng.standard_normal(shape)) if name == "ssm_a"
                      else 1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                      else 0.3 * rng.standard_normal(shape))
               for name, shape in layer_shapes(p, il).items()} for il in range(p.n_layer)]
    return GraniteHybridModel(p, rng.standard_normal((p.n_vocab, p.n_embd)), layers,
                              1.0 + 0.1 * rng.standard_normal(p.n_embd), rng.standard_normal((p.n_vocab, p.n_embd)))


def logits(model: Any) -> np.ndarray:
    return decode(model, model.new_cache(kv_size=32), ENTRIES)


@pytest.mark.parametrize("changes", [{}, {"n_rot": 0, "n_expert": 0, "n_expert_used": 0, "n_ff_shexp": 0,
                                          "attention_scale": None, "attention_bias": True}])
def test_a_granite_written_as_gguf_reads_back_as_the_same_model(tmp_path: Path, changes: dict[str, Any]) -> None:
    model = granite(**changes)
    write_gguf(model, tmp_path / "granite.gguf")
    back = load_gguf(tmp_path / "granite.gguf")
    assert isinstance(back, GraniteHybridModel)
    assert (back.hparams.attn_layers, back.hparams.n_rot, back.hparams.n_expert) == (
        model.hparams.attn_layers, model.hparams.n_rot, model.hparams.n_expert)
    for written, read in zip(model.layers, back.layers):
        assert written.keys() == read.keys()
        for name in written:
            np.testing.assert_allclose(read[name], written[name], rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(logits(back), logits(model), rtol=1e-5, atol=1e-5)


def test_q_and_k_rows_are_stored_in_llamacpps_normal_rope_order(tmp_path: Path) -> None:
    """Within each head the file holds the checkpoint's rows 0, d/2, 1, d/2 + 1, ... (the converter's permute)."""
    import gguf

    model = granite()
    write_gguf(model, tmp_path / "granite.gguf")
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "granite.gguf").tensors}
    head_dim = model.hparams.head_dim
    order = np.ravel(np.stack([np.arange(head_dim // 2), np.arange(head_dim // 2, head_dim)], axis=1))
    for field, name in (("wq", "attn_q"), ("wk", "attn_k")):
        rows = np.asarray(model.layers[1][field])
        expected = np.concatenate([rows[h * head_dim:(h + 1) * head_dim][order]
                                   for h in range(rows.shape[0] // head_dim)])
        np.testing.assert_allclose(tensors[f"blk.1.{name}.weight"], expected, rtol=1e-6)


def test_a_files_scales_are_folded_into_the_weights_on_reading(tmp_path: Path) -> None:
    """A file with embedding / residual / logit scales (as llama.cpp's converter keeps Granite's multipliers)
    reads as the model whose weights fold them."""
    model = granite()
    write_gguf(model, tmp_path / "granite.gguf")
    scales = {"granitehybrid.embedding_scale": 3.0, "granitehybrid.residual_scale": 0.6,
              "granitehybrid.logit_scale": 2.5}
    path = tmp_path / "scaled.gguf"
    import gguf

    reader = gguf.GGUFReader(tmp_path / "granite.gguf")
    writer = gguf.GGUFWriter(path, "granitehybrid")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in scales:
            writer.add_float32(key, scales[key])
        else:
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    back = load_gguf(path)
    token_embd, layers, output_norm = fold_multipliers(model.token_embd, model.layers, model.output_norm, False,
                                                       embedding=3.0, residual=0.6, logits=2.5)
    folded = GraniteHybridModel(model.hparams, token_embd, layers, output_norm, model.output)
    np.testing.assert_allclose(logits(back), logits(folded), rtol=1e-5, atol=1e-5)
    assert np.abs(logits(back) - logits(model)).max() > 1e-2


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_rot": 4}, r"n_rot 4: rope over part of each head \(8\), as Bamba's"),
    ({"time_step_limit": (0.0, 0.1)}, r"time_step_limit \(0.0, 0.1\) clamps dt"),
    ({"d_inner": 32, "n_ssm_head": 2}, r"d_inner 32 is not 2 \* n_embd \(64\)"),
])
def test_a_model_llamacpp_would_run_differently_is_refused_before_anything_is_written(
        tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    changed = granite(**changes)
    path = tmp_path / "refused.gguf"
    with pytest.raises(ModelError, match=message):
        write_gguf(changed, path)
    assert not path.exists()


def test_a_file_with_rope_over_part_of_each_head_is_refused_on_reading(tmp_path: Path) -> None:
    write_gguf(granite(), tmp_path / "granite.gguf")
    path = _rewritten(tmp_path / "granite.gguf", tmp_path / "partial.gguf", {"granitehybrid.rope.dimension_count": 4})
    with pytest.raises(ModelError, match=r"rope.dimension_count is 4: rope over part of each head of 8"):
        load_gguf(path)
