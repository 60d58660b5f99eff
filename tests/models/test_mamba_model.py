"""The numpy Mamba model served from the cache equals the plain single-sequence reference.

The model is written to a GGUF file by the test (``write_gguf``) and loaded
back (``load_gguf``).  Scenarios drive several sequences through one cache —
uneven prompts split into ubatches, removals, re-used slots, forks with
``seq_cp``, a prompt shared by two sequences — and every logit of every token
must equal ``ReferenceRun``, which runs each sequence alone, token by token,
with no cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.models import MambaModel, ModelError, ReferenceRun, load_gguf, random_model, write_gguf
from recurrent_cache.models._storage import StateStorage

SIZES = dict(n_vocab=48, n_embd=16, n_layer=2, d_state=4, d_inner=32, dt_rank=2)
# Batched and reference runs round states at the same points (every token), so
# they agree to float64 noise; 1e-9 relative would already flag a wrong row.
RTOL = 1e-9
GGML_F32, GGML_F16 = 0, 1


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the model in memory, the path of its f32 GGUF file)."""
    pytest.importorskip("gguf", reason="writing GGUF files needs the gguf package")
    model = random_model(seed=7, **SIZES)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, path)
    return model, path


@pytest.fixture(scope="module")
def model(written):
    return load_gguf(written[1])


def weights(model: MambaModel) -> dict[str, np.ndarray]:
    named = {"token_embd": model.token_embd, "output_norm": model.output_norm, "output": model.output}
    for il, layer in enumerate(model.layers):
        named.update({f"blk.{il}.{f.name}": getattr(layer, f.name) for f in dataclasses.fields(layer)})
    return named


def gguf_contents(path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: (int(t.tensor_type), [int(n) for n in t.shape]) for t in reader.tensors}
    return keys, tensors


# -- GGUF files --------------------------------------------------------------------------


def test_gguf_round_trip_keeps_every_weight(written, model):
    original, _ = written
    # GGUF stores the epsilon as a float32
    assert model.hparams == dataclasses.replace(original.hparams, rms_eps=float(np.float32(original.hparams.rms_eps)))
    loaded = weights(model)
    for name, values in weights(original).items():
        np.testing.assert_array_equal(loaded[name], values.astype(np.float32), err_msg=name)


def test_gguf_file_uses_llamacpp_names_and_keys(written):
    """Same keys, tensor names, types and ggml shapes as tiny-mamba.gguf, which llama.cpp loaded."""
    from golden import VECTORS

    keys, tensors = gguf_contents(written[1])
    llama_keys, llama_tensors = gguf_contents(VECTORS / "tiny-mamba.gguf")
    assert keys["general.architecture"] == "mamba"
    assert set(llama_keys) - {"general.name"} <= set(keys)
    assert keys["mamba.ssm.dt_b_c_rms"] is False
    assert set(tensors) == set(llama_tensors)
    p = written[0].hparams
    assert tensors["blk.0.ssm_conv1d.weight"] == (GGML_F32, [p.d_conv, p.d_inner])  # ggml order {ne0, ne1}
    assert tensors["blk.1.ssm_a"] == (GGML_F32, [p.d_state, p.d_inner])
    assert tensors["token_embd.weight"] == (GGML_F32, [p.n_embd, p.n_vocab])


def test_f16_file_follows_the_converter(tmp_path):
    """--outtype f16: 2-D .weight tensors in f16 except ssm_conv1d; loading gives the f16 values."""
    pytest.importorskip("gguf")
    original = random_model(seed=3, **SIZES)
    path = tmp_path / "f16.gguf"
    write_gguf(original, path, file_type="f16")
    _, tensors = gguf_contents(path)
    f16 = {name for name, (ggml_type, _) in tensors.items() if ggml_type == GGML_F16}
    assert f16 == {"token_embd.weight", "output.weight"} | {
        f"blk.{il}.{name}.weight" for il in range(2) for name in ("ssm_in", "ssm_x", "ssm_dt", "ssm_out")}
    loaded = load_gguf(path)
    assert loaded.token_embd.dtype == np.float64
    np.testing.assert_array_equal(loaded.layers[1].ssm_in, original.layers[1].ssm_in.astype(np.float16))
    np.testing.assert_array_equal(loaded.layers[1].ssm_a, original.layers[1].ssm_a.astype(np.float32))


def test_tied_output_has_no_output_tensor(tmp_path):
    pytest.importorskip("gguf")
    original = random_model(seed=4, tied=True, **SIZES)
    path = tmp_path / "tied.gguf"
    write_gguf(original, path)
    assert "output.weight" not in gguf_contents(path)[1]
    loaded = load_gguf(path)
    assert loaded.tied
    tokens = [1, 5, 9, 2]
    np.testing.assert_allclose(ReferenceRun(loaded).feed(tokens), ReferenceRun(original).feed(tokens), rtol=1e-5)


def test_dt_b_c_rms_variant_round_trips(tmp_path):
    pytest.importorskip("gguf")
    base = random_model(seed=5, **SIZES)
    variant = MambaModel(dataclasses.replace(base.hparams, dt_b_c_rms=True), base.token_embd, base.layers,
                         base.output_norm, base.output)
    path = tmp_path / "falcon.gguf"
    write_gguf(variant, path)
    loaded = load_gguf(path)
    assert loaded.hparams.dt_b_c_rms
    assert not np.allclose(ReferenceRun(loaded).feed([3, 4])[-1], ReferenceRun(base).feed([3, 4])[-1])


def test_bad_files_are_model_errors(tmp_path):
    gguf = pytest.importorskip("gguf")

    def write(arch: str):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    with pytest.raises(ModelError, match="architecture 'llama'"):
        load_gguf(write("llama"))
    with pytest.raises(ModelError, match="key mamba.embedding_length is missing"):
        load_gguf(write("mamba"))
    good = random_model(**SIZES)
    with pytest.raises(ModelError, match=r"token_embd.weight has shape \(3, 3\), expected \(48, 16\)"):
        MambaModel(good.hparams, np.zeros((3, 3)), good.layers, good.output_norm)
    with pytest.raises(ModelError, match="1 layers for a model of n_layer = 2"):
        MambaModel(good.hparams, good.token_embd, good.layers[:1], good.output_norm)


# -- batched through the cache == the reference, sequence by sequence ----------------------------


class Mirror:
    """A cache and, for every live sequence, a ReferenceRun fed the same tokens."""

    def __init__(self, model: MambaModel, size: int, dtype: str, n_ubatch: int) -> None:
        self.model, self.dtype, self.n_ubatch = model, dtype, n_ubatch
        self.cache = model.new_cache(n_seq_max=size, dtype=dtype)
        self.runs: dict[int, ReferenceRun] = {}
        self.lengths: dict[int, int] = {}
        self.ubatches = 0

    def decode(self, entries: list[tuple[list[int], list[int]]]) -> None:
        """One batch of ``(seq_ids, tokens)`` entries (several ids: tokens shared by those sequences).

        Every token is an output, and each is compared with the reference of every sequence it belongs to.
        """
        tokens, pos, seq_id, expected = [], [], [], []
        for seq_ids, new_tokens in entries:
            start = self.lengths.get(seq_ids[0], 0)
            for seq in seq_ids:
                assert self.lengths.get(seq, 0) == start, "a shared token needs equal positions"
                self.runs.setdefault(seq, ReferenceRun(self.model, self.dtype, self.dtype))
                expected_rows = self.runs[seq].feed(new_tokens)
                self.lengths[seq] = start + len(new_tokens)
            for k, token in enumerate(new_tokens):
                tokens.append(token)
                pos.append(start + k)
                seq_id.append(list(seq_ids))
                expected.append(expected_rows[k])
        st = self.cache.init_batch(rc.Batch(token=tokens, pos=pos, seq_id=seq_id), self.n_ubatch, logits_all=True)
        self.ubatches += st.n_ubatches
        logits = self.model.forward(st)
        for row, index in zip(logits, st.out_ids.tolist()):
            np.testing.assert_allclose(row, expected[index], rtol=RTOL, atol=RTOL * np.abs(expected[index]).max(),
                                       err_msg=f"batch index {index} (seq {seq_id[index]}, pos {pos[index]})")
        self.cache.check()

    def seq_rm(self, seq: int) -> None:
        assert self.cache.seq_rm(seq, -1, -1)
        del self.runs[seq], self.lengths[seq]

    def seq_cp(self, src: int, dst: int) -> None:
        self.cache.seq_cp(src, dst, -1, -1)
        self.runs[dst] = self.runs[src].copy()
        self.lengths[dst] = self.lengths[src]


def prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(0, SIZES["n_vocab"], size=length).tolist()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_ubatch", [1, 3, 64])
def test_continuous_batching_equals_reference(model, dtype, n_ubatch):
    rng = np.random.default_rng(n_ubatch)
    m = Mirror(model, size=4, dtype=dtype, n_ubatch=n_ubatch)
    token = lambda: prompt(rng, 1)  # noqa: E731 - one fresh decode token
    # uneven prompts in one batch: split_equal cuts them into several ubatches
    m.decode([([0], prompt(rng, 5)), ([1], prompt(rng, 2)), ([2], prompt(rng, 7))])
    # decode tokens mixed with a new prompt
    m.decode([([0], token()), ([1], token()), ([2], token()), ([3], prompt(rng, 4))])
    m.decode([([s], token()) for s in range(4)])
    # a finished sequence leaves; its slot is re-used by a new prompt
    m.seq_rm(1)
    m.decode([([0], token()), ([2], token()), ([1], prompt(rng, 3)), ([3], token())])
    # a fork: seq 1 drops its state and shares seq 2's, then they diverge
    m.seq_cp(2, 1)
    m.decode([([s], token()) for s in (2, 1, 0, 3)])
    # two fresh sequences share one prompt (one group with two seq ids), then diverge
    m.seq_rm(0)
    m.seq_rm(3)
    m.decode([([0, 3], prompt(rng, 6)), ([1], token()), ([2], token())])
    m.decode([([s], token()) for s in range(4)])
    m.decode([([s], prompt(rng, 2 + s)) for s in range(4)])
    assert m.ubatches > 8  # the scenario did split
    assert m.cache.used == 4


def test_forks_continue_independently(model):
    """llama.cpp's fork scenario: a prompt, seq_cp into two more sequences, divergent steps."""
    rng = np.random.default_rng(11)
    m = Mirror(model, size=3, dtype="f32", n_ubatch=2)
    m.decode([([0], prompt(rng, 9))])
    m.seq_cp(0, 1)
    m.seq_cp(0, 2)
    assert m.cache.used == 1
    for _ in range(3):
        m.decode([([s], prompt(rng, 1)) for s in (0, 1, 2)])
    assert m.cache.used == 3


def test_embedding_input_equals_token_input(model):
    tokens = [4, 8, 15, 16]
    by_token = model.forward(model.new_cache().init_batch(rc.Batch(token=tokens), logits_all=True))
    by_embd = model.forward(model.new_cache().init_batch(rc.Batch(embd=model.token_embd[tokens]), logits_all=True))
    np.testing.assert_array_equal(by_embd, by_token)


def test_state_interchange(model):
    """state_write a sequence, state_read it into another sequence of a fresh cache: both continue alike."""
    if not hasattr(rc.RecurrentCache, "state_read"):
        pytest.skip("RecurrentCache.state_write / state_read are not implemented yet")
    rng = np.random.default_rng(2)
    source = model.new_cache(n_seq_max=2)
    model.forward(source.init_batch(rc.Batch(token=prompt(rng, 6), seq_id=[1] * 6, pos=range(6))))
    target = model.new_cache(n_seq_max=3)
    target.state_read(source.state_write(seq_id=1), seq_id=2)
    for step in range(4):
        token = prompt(rng, 1)
        a = model.forward(source.init_batch(rc.Batch(token=token, seq_id=[1], pos=[6 + step])))
        b = model.forward(target.init_batch(rc.Batch(token=token, seq_id=[2], pos=[6 + step])))
        np.testing.assert_array_equal(a, b)


def test_cache_of_the_wrong_shape_is_refused(model):
    cache = rc.RecurrentCache(model.hparams.n_layer, 5, 7)
    with pytest.raises(ModelError, match="new_cache"):
        model.forward(cache.init_batch(rc.Batch(token=[1])))


def test_token_outside_vocabulary_is_refused(model):
    with pytest.raises(ModelError, match="vocabulary"):
        model.forward(model.new_cache().init_batch(rc.Batch(token=[SIZES["n_vocab"]])))


# -- state storage -----------------------------------------------------------------------------


def test_raw_bf16_storage_rounds_like_ml_dtypes():
    """Without ml_dtypes bf16 rows are raw uint16 bits: they must round exactly like the real dtype."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-5, 5, 1000),
                             [0.0, -0.0, 1.00390625, 1.01171875, np.inf, -np.inf]])  # two exact ties
    raw = StateStorage(np.uint16).encode(values)
    real = StateStorage(ml_dtypes.bfloat16).encode(values)
    np.testing.assert_array_equal(raw, real.view(np.uint16))
    np.testing.assert_array_equal(StateStorage(np.uint16).decode(raw, np.float64),
                                  real.astype(np.float64))
