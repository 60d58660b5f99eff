"""The attention layer's cache side (models/_attention.py), numpy and torch: the two V layouts give the same
bits, the key shift equals the keys computed at the new positions, a hidden row gives no NaN, a refused call
changes no cache row, and a few tokens' products are the compiled kernel's."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache.errors import ArgumentError, ConfigError
from recurrent_cache.kv_reference import KVCells
from recurrent_cache.models import _attention
from recurrent_cache.models._attention import AttentionParams, Rope, attention, shift_keys
from recurrent_cache.models._ssm import FEW_ROWS
from recurrent_cache.models._storage import StateStorage

PARAMS = AttentionParams(n_embd=24, n_head=6, n_head_kv=2, head_dim=8, rope=Rope("neox", 6, 1000.0, 0.5),
                         gated=True)
KV_SIZE = 12
# two sequences taking turns, then a decode step each
UBATCHES = ([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)], [(1, 2), (0, 3), (1, 3)], [(0, 4), (1, 4)])


def random_weights(params, seed=0):
    rng = np.random.default_rng(seed)
    n_q = params.n_head * params.head_dim
    n_q_out = n_q * (2 if params.gated else 1)   # a gated layer's wq gives each head's gate too

    def draw(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    return {"wq": draw(n_q_out, params.n_embd), "wk": draw(params.n_embd_k, params.n_embd),
            "wv": draw(params.n_embd_k, params.n_embd), "wo": draw(params.n_embd, n_q), "bq": draw(n_q_out),
            "bk": draw(params.n_embd_k), "bo": draw(params.n_embd), "q_norm": 1 + draw(params.head_dim),
            "k_norm": 1 + draw(params.head_dim)}


class Layer:
    """The layer on one backend: its weights, K / V caches of one storage dtype, and a KV table."""

    def __init__(self, backend, storage="f16", v_trans=False, params=PARAMS):
        self.backend, self.params, self.v_trans = backend, params, v_trans
        self.table = KVCells(KV_SIZE, n_seq_max=2)
        dtype = StateStorage.named(storage).dtype
        v_shape = (params.n_embd_k, KV_SIZE) if v_trans else (KV_SIZE, params.n_embd_k)
        self.k_cache, self.v_cache = np.zeros((KV_SIZE, params.n_embd_k), dtype), np.zeros(v_shape, dtype)
        self.w = random_weights(params)
        if backend == "torch":
            torch = pytest.importorskip("torch")
            torch_forward = pytest.importorskip("recurrent_cache.models.torch_forward",
                                                reason="the torch backend needs array-api-compat (the torch extra)")
            torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[storage]
            self.xp = torch_forward.TORCH_XP
            self.k_cache, self.v_cache = (torch.zeros(c.shape, dtype=torch_dtype) for c in (self.k_cache, self.v_cache))
            self.storage = torch_forward.TorchStateStorage(torch_dtype)
            self.w = {name: torch.from_numpy(value) for name, value in self.w.items()}
            self.host, self.to_numpy = torch.from_numpy, lambda tensor: tensor.numpy().copy()
        else:
            self.xp, self.storage, self.host, self.to_numpy = np, StateStorage(dtype), np.asarray, np.array

    def run(self, ubatch, x, cells=None, mask=None):
        """The layer over one ubatch of (seq, pos) tokens: placed in the table unless ``cells`` are given."""
        pos = np.array([p for _, p in ubatch], dtype=np.int32)
        seq_ids = [s for s, _ in ubatch]
        if cells is None:
            cells = self.table.place(pos, seq_ids)
        if mask is None:
            mask = np.empty((len(ubatch), self.table.n_kv()), dtype=np.float32)
            self.table.mask(pos, seq_ids, mask)
        out = attention(self.xp, self.w, self.host(x), self.params, pos, cells, mask, self.k_cache, self.v_cache,
                        self.storage, self.storage, self.v_trans)
        return self.to_numpy(out)

    def keys(self):
        """The key rows as float32 numpy."""
        return self.to_numpy(self.storage.decode(self.k_cache, self.xp.float32))   # a copy, not a view of the cache

    def rows(self):
        """Copies of both caches' bits, as numpy integers."""
        if self.backend == "torch":
            return [c.view({2: torch_int16(), 4: torch_int32()}[c.element_size()]).numpy().copy()
                    for c in (self.k_cache, self.v_cache)]
        return [c.view({2: np.int16, 4: np.int32}[c.dtype.itemsize]).copy() for c in (self.k_cache, self.v_cache)]


def torch_int16():
    return pytest.importorskip("torch").int16


def torch_int32():
    return pytest.importorskip("torch").int32


def inputs(n_tokens, seed=1):
    return np.random.default_rng(seed).standard_normal((n_tokens, PARAMS.n_embd)).astype(np.float32)


BACKENDS = ["numpy", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", ["f32", "f16", "bf16"])
def test_transposed_and_row_per_cell_v_give_the_same_bits(backend, storage):
    by_cell, transposed = Layer(backend, storage), Layer(backend, storage, v_trans=True)
    for i, ubatch in enumerate(UBATCHES):
        x = inputs(len(ubatch), seed=i)
        assert np.array_equal(by_cell.run(ubatch, x), transposed.run(ubatch, x))
    k_rows, v_rows = by_cell.rows()
    k_trans, v_trans = transposed.rows()
    assert np.array_equal(k_rows, k_trans) and np.array_equal(v_rows, v_trans.T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("storage", ["f32", "f16"])
def test_shifted_keys_equal_the_keys_computed_at_the_new_positions(backend, storage):
    layer = Layer(backend, storage)
    xs = [inputs(len(ubatch), seed=i) for i, ubatch in enumerate(UBATCHES)]
    for ubatch, x in zip(UBATCHES, xs):
        layer.run(ubatch, x)
    before = layer.keys()
    layer.table.seq_add(1, 2, -1, 5)          # sequence 1's positions 2.. move 5 on
    shifts = layer.table.shifts()
    assert np.count_nonzero(shifts) == 3
    shift_keys(layer.xp, layer.k_cache, shifts, PARAMS, layer.storage, layer.xp.float32)
    after = layer.keys()
    assert np.array_equal(after[shifts == 0], before[shifts == 0])   # untouched, bit for bit

    fresh = Layer(backend, storage)            # the same tokens written at their new positions, into the same cells
    for ubatch, x in zip(UBATCHES, xs):
        moved = [(s, p + 5 if s == 1 and p >= 2 else p) for s, p in ubatch]
        cells = [next(i for i, c in enumerate(layer.table.cells()) if c == (p, (s,))) for s, p in moved]
        fresh.run(moved, x, cells=cells, mask=np.zeros((len(ubatch), KV_SIZE), dtype=np.float32))
    expected = fresh.keys()
    tolerance = {"f32": 2e-6, "f16": 2e-3}[storage] * float(np.max(np.abs(expected)))
    np.testing.assert_allclose(after, expected, rtol=0, atol=tolerance)
    assert not np.allclose(before[shifts != 0], expected[shifts != 0], rtol=0, atol=tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_shifted_after_a_division_equal_the_keys_at_the_divided_positions(backend):
    """The table's shift after seq_div is new - old (llama.cpp's old - new rotates the wrong way)."""
    layer = Layer(backend, "f32")
    xs = [inputs(len(ubatch), seed=i) for i, ubatch in enumerate(UBATCHES)]
    for ubatch, x in zip(UBATCHES, xs):
        layer.run(ubatch, x)
    cell_of = {(p, s): i for i, c in enumerate(layer.table.cells()) if c is not None for s in c[1] for p in [c[0]]}
    layer.table.seq_div(1, 0, -1, 2)           # sequence 1's positions halved
    shifts = layer.table.shifts()
    assert shifts.min() < 0 and shifts.max() == 0
    shift_keys(layer.xp, layer.k_cache, shifts, PARAMS, layer.storage, layer.xp.float32)
    fresh = Layer(backend, "f32")
    for ubatch, x in zip(UBATCHES, xs):
        moved = [(s, p // 2 if s == 1 else p) for s, p in ubatch]
        cells = [cell_of[(p, s)] for s, p in ubatch]   # each token in the cell it was written to
        fresh.run(moved, x, cells=cells, mask=np.zeros((len(ubatch), KV_SIZE), dtype=np.float32))
    expected = fresh.keys()
    np.testing.assert_allclose(layer.keys(), expected, rtol=0, atol=2e-6 * float(np.max(np.abs(expected))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_without_rope_shifts_nothing(backend):
    layer = Layer(backend, "f32", params=AttentionParams(24, 6, 2, 8))
    layer.run(UBATCHES[0], inputs(len(UBATCHES[0])))
    layer.table.seq_add(0, 0, -1, 3)
    before = layer.rows()
    shift_keys(layer.xp, layer.k_cache, layer.table.shifts(), layer.params, layer.storage, layer.xp.float32)
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.rows()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_the_mask_hides_entirely_attends_to_nothing(backend):
    """llama.cpp's flash attention: a row with no visible cell gives 0 (the output is wo's bias), not NaN."""
    layer = Layer(backend, "f32")
    ubatch = UBATCHES[0]
    mask = np.zeros((len(ubatch), KV_SIZE), dtype=np.float32)
    mask[2] = -np.inf
    out = layer.run(ubatch, inputs(len(ubatch)), mask=mask)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[2], random_weights(PARAMS)["bo"])
    assert not np.allclose(out[1], out[2])


def refusals():
    n = len(UBATCHES[0])
    good_mask = np.zeros((n, KV_SIZE), dtype=np.float32)
    return {
        "a cell outside the cache": dict(cells=[0, 1, 2, 3, KV_SIZE], match="cell 12 is outside"),
        "two tokens in one cell": dict(cells=[0, 1, 2, 3, 3], match="two tokens of the ubatch write one cell"),
        "a mask of the wrong height": dict(mask=good_mask[:-1], match="the mask has shape"),
        "a mask wider than the cache": dict(mask=np.zeros((n, KV_SIZE + 1), np.float32), match="the mask has shape"),
        "a float64 mask": dict(mask=good_mask.astype(np.float64), match="float32"),
        "x of the wrong width": dict(x=np.zeros((n, PARAMS.n_embd + 1), np.float32), match="x has shape"),
        "positions of the wrong length": dict(positions=[0, 1], match="positions must be 5 integers"),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(refusals()))
def test_a_refused_call_changes_no_row(backend, case):
    layer = Layer(backend, "f16")
    layer.run(UBATCHES[0], inputs(len(UBATCHES[0])))
    before = layer.rows()
    bad = refusals()[case]
    n = len(UBATCHES[0])
    args = dict(x=inputs(n, seed=9), positions=np.arange(n), cells=[5, 6, 7, 8, 9],
                mask=np.zeros((n, KV_SIZE), np.float32))
    args.update({k: v for k, v in bad.items() if k != "match"})
    with pytest.raises(ArgumentError, match=bad["match"]):
        attention(layer.xp, layer.w, layer.host(args["x"]), PARAMS, args["positions"], args["cells"], args["mask"],
                  layer.k_cache, layer.v_cache, layer.storage, layer.storage)
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.rows()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_shift_rotates_nothing(backend):
    layer = Layer(backend, "f32")
    layer.run(UBATCHES[0], inputs(len(UBATCHES[0])))
    before = layer.rows()
    with pytest.raises(ArgumentError, match="shifts must be 12 integers"):
        shift_keys(layer.xp, layer.k_cache, np.ones(KV_SIZE - 1, np.int32), PARAMS, layer.storage, layer.xp.float32)
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.rows()))


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Rope("sideways", 4), "rope style 'sideways'"),
    (lambda: Rope("neox", 5), "n_rot must be even"),
    (lambda: Rope("none", 4), "rotates nothing"),
    (lambda: Rope("normal", 4, freq_base=0.0), "freq_base"),
    (lambda: AttentionParams(24, 6, 4, 8), "not a multiple of n_head_kv"),
    (lambda: AttentionParams(24, 6, 2, 8, Rope("neox", 10)), "larger than head_dim"),
])
def test_a_bad_shape_is_a_config_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


@pytest.mark.parametrize("v_trans", [False, True])
def test_a_few_tokens_multiply_by_the_kernel_and_agree_with_matmul(monkeypatch, v_trans):
    """Up to FEW_ROWS tokens the scores and the weighted values are the compiled kernel's (no BLAS threads in a
    forward whose kernels run theirs), within float32 rounding of matmul's; more tokens take matmul."""
    calls = []
    original = _attention.linear_rows
    monkeypatch.setattr(_attention, "linear_rows", lambda *a: calls.append(1) or original(*a))
    ten_tokens = [(0, t) for t in range(5)] + [(1, t) for t in range(5)]
    for ubatches in (UBATCHES, [ten_tokens]):
        kernel, plain = Layer("numpy", "f32", v_trans), Layer("numpy", "f32", v_trans)
        for i, ubatch in enumerate(ubatches):
            x = inputs(len(ubatch), seed=i)
            calls.clear()
            got = kernel.run(ubatch, x)
            assert bool(calls) == (len(ubatch) <= FEW_ROWS)
            with monkeypatch.context() as matmul_only:
                matmul_only.setattr(_attention, "linear_rows", lambda a, b: a @ b.T)
                want = plain.run(ubatch, x)
            assert float(np.abs(got - want).max()) <= 1e-6 * float(np.abs(want).max())
