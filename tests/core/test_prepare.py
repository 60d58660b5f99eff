"""prepare() is defence in depth: validation lets no unplaceable ubatch through, so a
failing prepare is reached only with ubatches built by hand, straight into an engine
(the compiled one through a test-time Cython probe, the reference through its Placement).
Whatever happens there, the cells and rows must not change."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache import reference
from golden import snapshot

HERE = Path(__file__).resolve().parent
BUILD = HERE.parents[1] / "examples" / "capi" / "build.py"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("capi_build", BUILD)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.build(tmp_path_factory.mktemp("probe"), HERE / "prepare_probe.pyx")


def three_sequences(engine):
    cache = rc.RecurrentCache(1, 2, 3, n_seq_max=4, engine=engine)
    for _ub in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 1, 2], pos=[0, 0, 0])):
        pass
    for k, array in enumerate(cache.r + cache.s):
        array[...] = np.arange(array.size).reshape(array.shape) + 100 * k
    return cache


def reference_prepare(cache, ubatches):
    """The reference engine's prepare of the same hand-built ubatches (group s ends at pos s)."""
    n_tokens = sum(n * len(groups) for n, groups in ubatches)
    built, token = [], 0
    for n, groups in ubatches:
        taken = []
        for group in groups:
            taken.append((tuple(group), list(range(token, token + n))))
            token += n
        built.append((n, taken))
    pos = [0] * n_tokens
    for _, taken in built:
        for s, (_, tokens) in enumerate(taken):
            pos[tokens[-1]] = s
    return reference.Placement(cache.memory_core, built, pos, [False] * n_tokens).prepare()


UNPLACEABLE = [
    ([(1, [[0], [0]])], "one owner in two groups"),
    ([(1, [[3], [1]]), (1, [[0], [2], [9]])], "a seq id outside the cache, in the second ubatch"),
    ([(2, [[3, 3]])], "a seq id listed twice in one group"),
    ([(1, [[0, 1], [1]])], "a shared group's member is another group's owner"),
]


@pytest.mark.parametrize("ubatches, why", UNPLACEABLE)
def test_failed_prepare_leaves_the_compiled_cache_unchanged(probe, ubatches, why):
    cache = three_sequences("compiled")
    before = snapshot(cache)
    assert probe.prepare(cache.memory_core, ubatches) < 0, why
    assert snapshot(cache) == before
    cache.check()


@pytest.mark.parametrize("ubatches, why", UNPLACEABLE)
def test_failed_prepare_leaves_the_reference_cache_unchanged(ubatches, why):
    cache = three_sequences("reference")
    before = snapshot(cache)
    assert reference_prepare(cache, ubatches) < 0, why
    assert snapshot(cache) == before
    cache.check()


def test_prepare_of_placeable_hand_built_ubatches_agrees(probe):
    ubatches = [(1, [[3], [1]])]
    assert probe.prepare(three_sequences("compiled").memory_core, ubatches) == 0
    assert reference_prepare(three_sequences("reference"), ubatches) == 0


def test_hand_built_ubatch_places_and_moves_rows(probe):
    # cells 0, 1, 2 hold seqs 2, 1, 0 (groups are consumed from the end);
    # a new seq 3 and seq 1 must end up in consecutive cells 1 and 2
    cache = three_sequences("compiled")
    assert snapshot(cache)["cells"] == [[0, 0, 2, [2]], [0, 1, 1, [1]], [0, 2, 0, [0]], [-1, -1, -1, []]]
    row_of_seq_0 = cache.s[0][2].copy()
    row_of_seq_1 = cache.s[0][1].copy()
    code, head, copy_src, zero = probe.apply_first(cache.memory_core, [[3], [1]])
    assert (code, head) == (0, 1)
    assert copy_src == [1, 1, 2] and zero == [True, False, False]
    assert cache.cell(1)[3] == (3,) and cache.cell(2)[3] == (1,) and cache.cell(3)[3] == (0,)
    np.testing.assert_array_equal(cache.s[0][1], 0)            # the new sequence starts from zeros
    np.testing.assert_array_equal(cache.s[0][2], row_of_seq_1)  # seq 1's state followed it
    np.testing.assert_array_equal(cache.s[0][3], row_of_seq_0)  # and so did seq 0's
    cache.check()
