"""LFM2's short convolution (``models/_shortconv.py``) against transformers' ``Lfm2ShortConv``.

A small random ``Lfm2Config``'s conv layer, in float32 and float64, with and without ``conv_bias``:
prompts of several sequences through a conv-only ``RecurrentCache`` (numpy, or torch storage on the
index path) in small ubatches, then decode steps, the state carried in the cache's flat r rows — every
output equal to the module's full-sequence forward of that sequence; the step states equal the states
a shorter run ends with; any split of a sequence gives the same outputs and state.
"""

from __future__ import annotations

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache.errors import ModelError
from recurrent_cache.models._shortconv import (ShortConvParams, random_shortconv_weights, short_conv,
                                               shortconv_gguf_tensors, shortconv_weights_from_hf)
from recurrent_cache.models._storage import StateStorage

from variants import torch_storage

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from recurrent_cache.models.torch_forward import TORCH_XP, TorchStateStorage  # noqa: E402
from transformers import Lfm2Config  # noqa: E402
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv  # noqa: E402

N_EMBD = 16
LENGTHS = (7, 4, 1)     # the prompts of three sequences
N_DECODE = 3
# |ours - transformers| / max |transformers|, measured over test_equals_transformers' runs: float64 with f32
# rows 3.3e-8 (B * x rounded to f32 before the conv: the cache's rows), float32 4.8e-7; f16 rows 2.8e-4,
# bf16 rows 1.8e-3 (either compute dtype).
TOLERANCE = {(np.float64, "f32"): 1e-7, (np.float32, "f32"): 2e-6, (np.float64, "f16"): 1e-3,
             (np.float64, "bf16"): 5e-3}


def hf_module(l_cache: int, conv_bias: bool, dtype, seed: int = 0) -> tuple[Lfm2ShortConv, Lfm2Config]:
    config = Lfm2Config(vocab_size=32, hidden_size=N_EMBD, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, conv_L_cache=l_cache, conv_bias=conv_bias,
                        layer_types=["conv"])
    torch.manual_seed(seed)
    module = Lfm2ShortConv(config, 0).to(torch.float64 if dtype == np.float64 else torch.float32).eval()
    return module, config


def our_weights(module: Lfm2ShortConv, p: ShortConvParams, dtype) -> dict[str, np.ndarray]:
    tensors = module.state_dict()
    return {field: np.ascontiguousarray(array, dtype=dtype) for field, array in shortconv_weights_from_hf(
        lambda name, shape: tensors[name].detach().numpy().reshape(shape), p).items()}


def reference(module: Lfm2ShortConv, u: np.ndarray) -> np.ndarray:
    """The module's full-sequence forward of one sequence ``u`` [T, n_embd] (no cache)."""
    with torch.no_grad():
        return module(torch.from_numpy(u)[None])[0].numpy()


class Served:
    """One short-conv layer over a conv-only cache: each token id is a row of ``table`` [N, n_embd]."""

    def __init__(self, p: ShortConvParams, weights: dict[str, np.ndarray], table: np.ndarray, storage: str,
                 dtype_r: str = "f32", n_rollback: int = 0) -> None:
        self.p, self.table = p, table
        options = {"storage": torch_storage()} if storage == "torch" else {}
        self.cache = rc.RecurrentCache(1, p.n_embd_r, 0, n_seq_max=len(LENGTHS), dtype_r=dtype_r, dtype_s=dtype_r,
                                       n_rollback=n_rollback, **options)
        self.torch = storage == "torch"
        self.weights = {k: torch.from_numpy(v) for k, v in weights.items()} if self.torch else weights

    def run(self, tokens: list[int], seq_id: list[int], pos: list[int], n_ubatch: int) -> np.ndarray:
        """The outputs of every token of the batch, in batch order [n_tokens, n_embd]."""
        st = self.cache.init_batch(rc.Batch(token=tokens, seq_id=seq_id, pos=pos), n_ubatch)
        outputs = np.zeros((len(tokens), self.p.n_embd), self.table.dtype)
        for ub in st:
            rows, steps = st.r(0), st.r_steps(0)
            xp = TORCH_XP if self.torch else np
            storage = TorchStateStorage(rows.dtype) if self.torch else StateStorage(rows.dtype)
            u = self.table[np.asarray(ub.token)].reshape((ub.n_seqs, ub.n_seq_tokens, self.p.n_embd))
            u = torch.from_numpy(u) if self.torch else u
            m = steps.shape[1]
            out, conv, _, step_states = short_conv(xp, self.p, self.weights, u, storage.decode(rows, u.dtype),
                                                   st.s(0), storage, storage, m)
            rows[...] = storage.encode(conv)
            if m:
                steps[...] = storage.encode(step_states[0])
            outputs[np.asarray(ub.batch_index)] = (out.numpy() if self.torch else out).reshape((-1, self.p.n_embd))
        return outputs


def inputs_of(dtype, seed: int = 1) -> tuple[np.ndarray, list[list[int]]]:
    """A table of input rows and each sequence's token ids (its rows, prompt then decode steps)."""
    total = sum(LENGTHS) + N_DECODE * len(LENGTHS)
    table = np.random.default_rng(seed).standard_normal((total, N_EMBD)).astype(dtype)
    ids, at = [], 0
    for length in LENGTHS:
        ids.append(list(range(at, at + length)))
        at += length
    for seq in range(len(LENGTHS)):
        ids[seq] += list(range(at, at + N_DECODE))
        at += N_DECODE
    return table, ids


def serve(served: Served, ids: list[list[int]], n_ubatch: int) -> list[np.ndarray]:
    """Every prompt in one batch (split into ubatches of ``n_ubatch``), then one token per sequence per step."""
    prompts = [seq_ids[:length] for seq_ids, length in zip(ids, LENGTHS)]
    tokens = [t for prompt in prompts for t in prompt]
    seq_id = [s for s, prompt in enumerate(prompts) for _ in prompt]
    pos = [i for prompt in prompts for i in range(len(prompt))]
    out = served.run(tokens, seq_id, pos, n_ubatch)
    got = [out[[i for i, s in enumerate(seq_id) if s == seq]] for seq in range(len(LENGTHS))]
    for step in range(N_DECODE):
        seqs = list(range(len(LENGTHS)))
        out = served.run([ids[s][LENGTHS[s] + step] for s in seqs], seqs, [LENGTHS[s] + step for s in seqs], 1)
        got = [np.concatenate([g, out[s:s + 1]]) for s, g in enumerate(got)]
    return got


def assert_equals_transformers(dtype, l_cache: int, conv_bias: bool, storage: str, dtype_r: str = "f32") -> None:
    module, config = hf_module(l_cache, conv_bias, dtype)
    p = ShortConvParams.from_hf_config(config.to_dict())
    assert (p.n_embd_r, p.n_embd_s) == (N_EMBD * (l_cache - 1), 0)
    table, ids = inputs_of(dtype)
    got = serve(Served(p, our_weights(module, p, dtype), table, storage, dtype_r), ids, n_ubatch=3)
    for seq, seq_ids in enumerate(ids):
        expected = reference(module, table[seq_ids])
        assert np.abs(got[seq] - expected).max() <= TOLERANCE[dtype, dtype_r] * np.abs(expected).max(), seq


@pytest.mark.parametrize("storage", ["numpy", "torch"])
@pytest.mark.parametrize("conv_bias", [False, True], ids=["no-bias", "conv_bias"])
@pytest.mark.parametrize("l_cache", [3, 4])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_equals_transformers(dtype, l_cache, conv_bias, storage):
    assert_equals_transformers(dtype, l_cache, conv_bias, storage)


@pytest.mark.parametrize("storage", ["numpy", "torch"])
@pytest.mark.parametrize("dtype_r", ["f16", "bf16"])
def test_half_precision_rows_stay_near_transformers(dtype_r, storage):
    assert_equals_transformers(np.float64, 3, False, storage, dtype_r)


def state_after(p, weights, u: np.ndarray, storage: StateStorage) -> tuple[np.ndarray, np.ndarray]:
    """Outputs and conv row after ``u`` [1, T, n_embd] from a zero state, in one call."""
    out, conv, _, _ = short_conv(np, p, weights, u, np.zeros((1, p.n_embd_r)), np.zeros((1, 0)), storage, storage, 0)
    return out, storage.encode(conv)


@pytest.mark.parametrize("dtype_r", ["f32", "f16", "bf16"])
def test_step_states_are_the_states_of_shorter_runs(dtype_r):
    p = ShortConvParams(N_EMBD, 4)
    weights = random_shortconv_weights(np.random.default_rng(0), p)
    storage = StateStorage.named(dtype_r)
    u = np.random.default_rng(1).standard_normal((1, 6, N_EMBD))
    m = 4
    _, _, ssm, steps = short_conv(np, p, weights, u, np.zeros((1, p.n_embd_r)), np.zeros((1, 0)), storage,
                                  storage, m)
    conv_steps, ssm_steps = steps
    assert conv_steps.shape == (1, m, p.n_embd_r) and ssm_steps.shape == (1, m, 0) and ssm.shape == (1, 0)
    for j in range(m):
        _, expected = state_after(p, weights, u[:, :6 - 1 - m + j + 1], storage)
        np.testing.assert_array_equal(storage.encode(conv_steps[:, j]), expected)


@pytest.mark.parametrize("dtype_r", ["f32", "f16", "bf16"])
def test_any_split_gives_the_same_outputs_and_state(dtype_r):
    """The conv inputs are rounded to the row's type before use: the split never shows."""
    p = ShortConvParams(N_EMBD, 3, conv_bias=True)
    weights = random_shortconv_weights(np.random.default_rng(2), p)
    storage = StateStorage.named(dtype_r)
    u = np.random.default_rng(3).standard_normal((1, 9, N_EMBD))
    whole, whole_conv = state_after(p, weights, u, storage)
    for cuts in ([1], [4], [2, 5, 6], list(range(1, 9))):
        conv, pieces = np.zeros((1, p.n_embd_r)), []
        for start, end in zip([0, *cuts], [*cuts, 9]):
            out, after, _, _ = short_conv(np, p, weights, u[:, start:end], storage.decode(conv, np.float64),
                                          np.zeros((1, 0)), storage, storage, 0)
            conv = storage.encode(after)
            pieces.append(out)
        np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, rtol=1e-13, atol=1e-13)
        np.testing.assert_array_equal(conv, whole_conv)


def test_the_conv_state_is_llamacpps_layout():
    """r[ch * (L_cache - 1) + t]: channel-major, oldest first — the last L_cache - 1 values of B * x."""
    p = ShortConvParams(N_EMBD, 4)
    weights = random_shortconv_weights(np.random.default_rng(4), p)
    u = np.random.default_rng(5).standard_normal((1, 5, N_EMBD))
    _, conv = state_after(p, weights, u, StateStorage.named("f32"))
    bcx = u[0] @ weights["shortconv_in_proj"].T
    bx = bcx[:, :N_EMBD] * bcx[:, 2 * N_EMBD:]
    np.testing.assert_allclose(conv.reshape((N_EMBD, 3)), bx[-3:].T, rtol=1e-7)


def test_bad_sizes_and_a_bias_in_gguf_are_refused():
    with pytest.raises(ModelError, match="^conv_L_cache must be >= 2, got 1$"):
        ShortConvParams.from_hf_config({"hidden_size": 8, "conv_L_cache": 1})
    with pytest.raises(ModelError, match="hidden_size is missing"):
        ShortConvParams.from_hf_config({"conv_L_cache": 3})
    with pytest.raises(ModelError, match="conv_bias must be true or false"):
        ShortConvParams.from_hf_config({"hidden_size": 8, "conv_bias": "yes"})
    with pytest.raises(ModelError, match="no in_proj, conv or out_proj bias"):
        shortconv_gguf_tensors(ShortConvParams(8, 3, conv_bias=True))
    assert shortconv_gguf_tensors(ShortConvParams(8, 3)) == {
        "shortconv_in_proj": ("shortconv.in_proj.weight", (24, 8)),
        "shortconv_conv": ("shortconv.conv.weight", (8, 3)),
        "shortconv_out_proj": ("shortconv.out_proj.weight", (8, 8))}
