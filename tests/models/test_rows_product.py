"""The compiled product of a few rows (models/_scan.pyx ``rows_product``, ``_ssm.linear``'s path for up to
``FEW_ROWS`` numpy rows) against a numpy loop that sums in the kernel's order — bit for bit, for any number of
rows, thread count and shape — its refusals, the thread setting, and what it buys a model: a decode step of up
to ``FEW_ROWS`` sequences gives each sequence the bits it gets alone."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import recurrent_cache as rc
from forks import check_in_forked_child
from recurrent_cache.models import get_num_threads, random_mamba2_model, random_model, set_num_threads
from recurrent_cache.models._scan import product_threads, rows_product
from recurrent_cache.models._ssm import FEW_ROWS, linear, linear_rows, product_weight


def in_order(x: np.ndarray, weight_t: np.ndarray) -> np.ndarray:
    """``x @ weight_t`` with each output summed over the inputs in order, every product rounded to the dtype
    before it is added (no FMA, no reassociation)."""
    y = np.zeros((x.shape[0], weight_t.shape[1]), x.dtype)
    for k in range(x.shape[1]):
        y = y + x[:, k:k + 1] * weight_t[k]
    return y


def in_blocks(x: np.ndarray, weight_t: np.ndarray) -> np.ndarray:
    """What the kernel promises: a weight of fewer than 16,384 outputs sums each output over 4 consecutive blocks
    of its inputs (each ceil(in / 4) rounded up to a multiple of 16; the last ones shorter or empty), each block
    in order, and adds the non-empty blocks' sums in order; a wider weight sums all its inputs in order."""
    n_in, out = weight_t.shape
    if out >= 16_384:
        return in_order(x, weight_t)
    block = 16 * math.ceil(math.ceil(n_in / 4) / 16)
    sums = [in_order(x[:, k0:k0 + block], weight_t[k0:k0 + block]) for k0 in range(0, n_in, block)]
    y = sums[0]
    for later in sums[1:]:
        y = y + later
    return y


def test_the_blocks_are_what_the_oracle_says():
    """The oracle's blocks are not its plain sum in order (else the tests below could not tell them apart)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 100)).astype(np.float32)
    weight_t = rng.standard_normal((100, 300)).astype(np.float32)
    assert not np.array_equal(in_blocks(x, weight_t), in_order(x, weight_t))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, FEW_ROWS), n_in=st.integers(1, 70), out=st.integers(1, 700), n_threads=st.integers(1, 5),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**32 - 1))
def test_each_output_is_its_blocks_sums_for_any_rows_and_threads(m, n_in, out, n_threads, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n_in)).astype(dtype)
    weight_t = rng.standard_normal((n_in, out)).astype(dtype)
    y = np.full((m, out), np.nan, dtype)
    before = get_num_threads()
    set_num_threads(n_threads)
    try:
        rows_product(x, weight_t, y)
    finally:
        set_num_threads(before)
    np.testing.assert_array_equal(y, in_blocks(x, weight_t))


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_wide_weight_spans_several_chunks_and_threads(threads, n_threads):
    """Past a chunk of outputs (16,384 for one row, 2,048 for several) and over thread shares."""
    rng = np.random.default_rng(5)
    weight_t = rng.standard_normal((19, 40_000)).astype(np.float32)
    threads(n_threads)
    for m in (1, 3):
        x = rng.standard_normal((m, 19)).astype(np.float32)
        y = np.empty((m, 40_000), np.float32)
        rows_product(x, weight_t, y)
        np.testing.assert_array_equal(y, in_blocks(x, weight_t))


@pytest.mark.parametrize("dtype, out", [(np.float32, 1024), (np.float32, 3072), (np.float64, 512)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_rows_4_kib_apart_take_fewer_inputs_a_pass_with_the_same_bits(threads, dtype, out, n_threads):
    """A weight whose rows are a multiple of 4 KiB apart (Mamba-1's in-projection: 3,072 floats) takes 6 inputs a
    pass rather than 12: every output still its sum in order, inputs past the last whole pass included."""
    rng = np.random.default_rng(out)
    n_in = 6 * 5 + 4
    weight_t = rng.standard_normal((n_in, out)).astype(dtype)
    threads(n_threads)
    for m in (1, 3, FEW_ROWS):
        x = rng.standard_normal((m, n_in)).astype(dtype)
        y = np.empty((m, out), dtype)
        rows_product(x, weight_t, y)
        np.testing.assert_array_equal(y, in_blocks(x, weight_t))


def test_a_row_gets_the_same_bits_alone_or_among_others():
    rng = np.random.default_rng(6)
    weight = product_weight(rng.standard_normal((300, 96)).astype(np.float32))
    x = rng.standard_normal((FEW_ROWS, 96)).astype(np.float32)
    together = linear(x, weight)
    for i in range(FEW_ROWS):
        np.testing.assert_array_equal(linear(x[i:i + 1], weight)[0], together[i])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_rows_keeps_each_rows_bits_for_any_number_of_rows(dtype):
    """Gated DeltaNet's projections: the kernel over groups of FEW_ROWS rows, so 3 * (FEW_ROWS + 1) rows give each
    row its bits alone."""
    rng = np.random.default_rng(9)
    weight = product_weight(rng.standard_normal((50, 24)).astype(dtype))
    x = rng.standard_normal((3, FEW_ROWS + 1, 24)).astype(dtype)
    together = linear_rows(x, weight)
    np.testing.assert_array_equal(together.reshape(-1, 50), in_blocks(x.reshape(-1, 24), weight.T))


def test_linear_takes_the_kernel_for_few_rows_only():
    rng = np.random.default_rng(7)
    weight = product_weight(rng.standard_normal((40, 33)).astype(np.float32))
    few = rng.standard_normal((2, 3, 33)).astype(np.float32)          # [n_seqs, n_tokens, k]: 6 rows
    np.testing.assert_array_equal(linear(few, weight), in_blocks(few.reshape(6, 33), weight.T).reshape(2, 3, 40))
    many = rng.standard_normal((FEW_ROWS + 1, 33)).astype(np.float32)
    np.testing.assert_allclose(linear(many, weight), many @ weight.T, rtol=1e-5, atol=1e-5)
    # a weight in numpy's own layout, or rows of another dtype, go to numpy's matmul
    plain = rng.standard_normal((40, 33)).astype(np.float32)
    np.testing.assert_array_equal(linear(few[0], plain), few[0] @ plain.T)
    half = few[0].astype(np.float16)
    assert linear(half, weight.astype(np.float16)).dtype == np.float16


@pytest.mark.parametrize("bad", ["x", "weight", "y"])
def test_wrong_shapes_are_refused_before_anything_is_written(bad):
    shapes = {"x": (2, 8), "weight": (8, 5), "y": (2, 5)}
    shapes[bad] = {"x": (2, 9), "weight": (7, 5), "y": (3, 5)}[bad]
    x, weight_t = np.ones(shapes["x"], np.float32), np.ones(shapes["weight"], np.float32)
    y = np.full(shapes["y"], 7.0, np.float32)
    with pytest.raises(ValueError, match="rows of shape"):
        rows_product(x, weight_t, y)
    assert (y == 7.0).all()


def test_empty_products():
    y = np.full((2, 3), 7.0)
    rows_product(np.zeros((2, 0)), np.zeros((0, 3)), y)
    np.testing.assert_array_equal(y, np.zeros((2, 3)))
    rows_product(np.zeros((0, 4)), np.zeros((4, 3)), np.zeros((0, 3)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_child_forked_after_threaded_products_computes_in_one_thread(threads):
    """GNU OpenMP's threads do not survive a fork: a child's first parallel region would wait for them for
    ever.  A child forked after the parent's products ran in threads computes them in one thread, correctly."""
    threads(2)
    rng = np.random.default_rng(11)
    x, weight_t = rng.standard_normal((2, 40)).astype(np.float32), rng.standard_normal((40, 3000)).astype(np.float32)
    y = np.empty((2, 3000), np.float32)
    rows_product(x, weight_t, y)            # the parent's threads have started

    def product_in_one_thread() -> bool:
        y[...] = 0
        rows_product(x, weight_t, y)
        return product_threads() == 1 and np.array_equal(y, in_blocks(x, weight_t))
    check_in_forked_child(product_in_one_thread, "its product waited for the parent's threads")
    assert product_threads() == 2             # the parent keeps its threads


@pytest.mark.parametrize("bad", [0, -2, 2**31, 1.5, "2", None])
def test_a_bad_thread_count_is_refused_and_nothing_changes(bad):
    before = get_num_threads()
    with pytest.raises(rc.ArgumentError, match="threads"):
        set_num_threads(bad)
    assert get_num_threads() == before >= 1


@pytest.mark.parametrize("storage", ["numpy", pytest.param("torch", marks=pytest.mark.needs_torch)])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("make", [random_model, random_mamba2_model], ids=["mamba", "mamba2"])
def test_a_decode_batch_of_up_to_few_rows_equals_each_sequence_alone(threads, make, dtype, n_threads, storage):
    """Mamba-1 and Mamba-2 decode steps of 1 .. FEW_ROWS sequences (a token each, in whatever order the cache
    splits them), on a numpy cache and a torch CPU one (the numpy math over its memory): every sequence's
    logits are bit for bit its solo run's (``ReferenceRun``), since every product sums a row's outputs alike
    and every other step is per row or per channel."""
    if storage == "torch":
        pytest.importorskip("torch")
    threads(n_threads)
    model = make(3, dtype=dtype)
    rng = np.random.default_rng(8)
    n_seqs, n_tokens = FEW_ROWS, 5
    prompts = [[int(t) for t in rng.integers(0, 256, n_tokens)] for _ in range(n_seqs)]
    cache = model.new_cache(n_seq_max=n_seqs, storage=storage)
    got: list[list[np.ndarray]] = [[] for _ in range(n_seqs)]
    for t in range(n_tokens):
        active = list(range(t + 1 if t < 3 else n_seqs))   # 1, 2, 3 sequences, then all of them
        batch = rc.Batch(token=[prompts[s][len(got[s])] for s in active], pos=[len(got[s]) for s in active],
                         seq_id=active, logits=[1] * len(active))
        st_ = cache.init_batch(batch, n_ubatch=len(active))
        logits = model.forward(st_)
        for row, index in enumerate(st_.out_ids):
            got[active[index]].append(np.asarray(logits[row]))
    for s in range(n_seqs):
        np.testing.assert_array_equal(np.stack(got[s]), model.reference_run().feed(prompts[s][:len(got[s])]))
