"""The hybrid step's KV half on the compiled engine (``_hybrid_step``: the KV tokens taken from the
recurrent split's C arrays, prepare and apply one compiled call each) places exactly what the
reference engine's numpy path places: every ubatch's cells, ``n_kv`` and masks, for batches of
several ubatches, groups of several tokens and tokens shared by several sequences; and on the
index path (a storage without host memory) as on numpy."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache import Batch
from recurrent_cache.errors import UsageError
from recurrent_cache.hybrid import HybridCache

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot, write


def make(engine: str, **kw) -> HybridCache:
    args = dict(attn_layers=[0, 2], recr_layers=[1, 2], n_embd_k=2, n_embd_v=3, n_embd_r=2, n_embd_s=3,
                kv_size=64, n_seq_max=5, dtype_k="f32", dtype_v="f32", kv_pad=8, n_swa=3, swa_type="standard",
                engine=engine)
    args.update(kw)
    return HybridCache(3, **args)


# (batch: tokens per sequence set, n_ubatch): every ubatch shape the split makes
BATCHES = [
    ({(0,): 1, (1,): 1, (2,): 1, (3,): 1}, 512),             # a decode step: one ubatch of one token per group
    ({(0,): 5, (1,): 5, (2,): 3}, 4),                        # several ubatches, groups of several tokens
    ({(0, 2): 3, (1,): 3, (3, 4): 2}, 512),                  # tokens shared by several sequences
    ({(4, 1, 3): 4, (0,): 2}, 3),                            # shared ids, not in order, several ubatches
    ({(1,): 2, (2, 4): 2, (3,): 2, (0,): 2}, 6),             # ubatches of several groups of several tokens
]


def batch_of(groups: dict[tuple[int, ...], int], start: dict[int, int]) -> Batch:
    seq_ids, positions = [], []
    for seqs, n in groups.items():
        first = start.get(seqs[0], 0)
        seq_ids += [list(seqs)] * n
        positions += list(range(first, first + n))
    return Batch(token=list(range(len(seq_ids))), seq_id=seq_ids, pos=positions)


def steps_of(cache: HybridCache) -> list[tuple]:
    """Each batch of BATCHES in turn (after a prompt for sequence 0): every ubatch's cells, n_kv and
    both masks, and the table after it."""
    seen = []
    decode(cache, Histories(5), {0: [7, 8, 9]})
    for groups, n_ubatch in BATCHES:
        start = {seq: max(cache.seq_pos_max(seq), -1) + 1 for seq in range(5)}
        st = cache.init_batch(batch_of(groups, start), n_ubatch=n_ubatch)
        assert st.n_ubatches >= 1
        for _ in st:
            seen.append((st.kv_cells.tolist(), st.n_kv, st.kv_mask().tolist(), st.kv_mask(sliding=True).tolist(),
                         cache.kv_cells(), cache.kv_head))
        for seq in range(1, 5):   # the shared sequences go on alone from here
            cache.seq_rm(seq, -1, -1)
    return seen


def test_the_compiled_step_places_what_the_reference_places():
    compiled, reference = steps_of(make("compiled")), steps_of(make("reference"))
    assert len(compiled) == len(reference) > len(BATCHES)
    assert compiled == reference


@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_a_stale_state_is_refused_before_either_half_changes(engine):
    cache = make(engine)
    histories = Histories(5)
    decode(cache, histories, {0: [1, 2], 1: [3]})
    st = cache.init_batch(Batch(token=[4, 5], seq_id=[0, 1]))
    other = cache.init_batch(Batch(token=[6], seq_id=[2]))
    other.apply()                                            # another state's apply: st is stale
    before = snapshot(cache)
    with pytest.raises(UsageError, match="changed"):
        st.apply()
    assert same(before, snapshot(cache))
    with pytest.raises(UsageError, match="not applied"):
        _ = st.kv_cells


@pytest.mark.needs_torch
def test_the_index_path_steps_as_host_memory():
    pytest.importorskip("torch", reason="the index path needs torch (TorchStorage)")
    from recurrent_cache.storage import TorchStorage
    on_numpy, on_index = make("compiled"), make("compiled", storage=TorchStorage("cpu", host_access=False))
    histories = {id(on_numpy): Histories(5), id(on_index): Histories(5)}
    for cache in (on_numpy, on_index):
        decode(cache, histories[id(cache)], {0: [1, 2, 3], 1: [4, 5]}, n_ubatch=2)
        for step in range(3):
            st = cache.init_batch(Batch(token=[10 + step, 20 + step], seq_id=[0, 1]))
            for ub in st:
                write(cache, st, ub, histories[id(cache)])
        assert_holds_its_history(cache, histories[id(cache)])
        cache.check()
    assert on_numpy.kv_cells() == on_index.kv_cells()
    k_numpy = np.asarray(on_numpy.kv_tensors[0])
    k_index = on_index.kv_tensors[0].numpy()
    assert np.array_equal(k_numpy, k_index)
