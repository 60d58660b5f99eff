"""prepare() is defence in depth: validation lets no unplaceable ubatch through, so
FAILED_PREPARE is reached only through the core's internal entry point, with
ubatches built by hand.  Whatever happens there, the cache must not change."""

import numpy as np
import pytest

import recurrent_cache as rc
from recurrent_cache._memory import MemoryState
from golden import snapshot


@pytest.fixture
def cache():
    cache = rc.RecurrentCache(1, 2, 3, n_seq_max=4)
    for ub in cache.init_batch(rc.Batch(token=[1, 2, 3], seq_id=[0, 1, 2], pos=[0, 0, 0])):
        pass
    for k, array in enumerate(cache.r + cache.s):
        array[...] = np.arange(array.size).reshape(array.shape) + 100 * k
    return cache


@pytest.mark.parametrize("ubatches, why", [
    ([(1, [[0], [0]])], "one owner in two groups"),
    ([(1, [[3], [1]]), (1, [[0], [2], [9]])], "a seq id outside the cache, in the second ubatch"),
    ([(2, [[3, 3]])], "a seq id listed twice in one group"),
    ([(1, [[0, 1], [1]])], "a shared group's member is another group's owner"),
])
def test_failed_prepare_leaves_the_cache_unchanged(cache, ubatches, why):
    before = snapshot(cache)
    st = MemoryState._from_ubatches(cache._cells, cache, ubatches)
    assert st.status == rc.MemoryStatus.FAILED_PREPARE, why
    assert snapshot(cache) == before
    cache.check()
    with pytest.raises(rc.CoreError):
        st.apply()
    assert snapshot(cache) == before


def test_prepared_hand_built_ubatch_places_and_moves_rows(cache):
    # cells 0, 1, 2 hold seqs 2, 1, 0 (groups are consumed from the end);
    # a new seq 3 and seq 1 must end up in consecutive cells 1 and 2
    st = MemoryState._from_ubatches(cache._cells, cache, [(1, [[3], [1]])])
    assert st.status == rc.MemoryStatus.SUCCESS
    assert snapshot(cache)["cells"] == [[0, 0, 2, [2]], [0, 1, 1, [1]], [0, 2, 0, [0]], [-1, -1, -1, []]]
    row_of_seq_0 = cache.s[0][2].copy()
    row_of_seq_1 = cache.s[0][1].copy()
    st.apply()
    assert (st.head, st.n_kv) == (1, 3)
    assert st.copy_src.tolist() == [1, 1, 2] and st.zero.tolist() == [True, False, False]
    assert cache.cell(1)[3] == (3,) and cache.cell(2)[3] == (1,) and cache.cell(3)[3] == (0,)
    np.testing.assert_array_equal(cache.s[0][1], 0)            # the new sequence starts from zeros
    np.testing.assert_array_equal(cache.s[0][2], row_of_seq_1)  # seq 1's state followed it
    np.testing.assert_array_equal(cache.s[0][3], row_of_seq_0)  # and so did seq 0's
    cache.check()
