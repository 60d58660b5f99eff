"""The hybrid memory: one sequence API over the KV half and the recurrent half, all or nothing.

Targeted tests for each operation's rule across the two halves (the half that refuses goes first,
a refused call leaves every cell and row as it was), the state a model reads, rollback, and
staleness; ``test_hybrid_machine.py`` drives random scripts.  Rows are written by the made-up model
of ``hybrid_model`` so a test knows which rows each sequence must hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache import Batch
from recurrent_cache.errors import ArgumentError, ConfigError, OutOfRangeError, PositionError, SeqIdError, UsageError
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.memory_state import MemoryStatus

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot, write

ENGINES = ["compiled", "reference"]


def make(engine: str, **kw) -> HybridCache:
    args = dict(attn_layers=[1, 3], recr_layers=[0, 2, 3], n_embd_k=4, n_embd_v=6, n_embd_r=3, n_embd_s=5,
                kv_size=32, n_seq_max=4, dtype_k="f32", dtype_v="f32", engine=engine)
    args.update(kw)
    return HybridCache(5, **args)


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def test_layout_of_each_layer(engine):
    cache = make(engine)
    assert [k is not None for k in cache.k] == [False, True, False, True, False]
    assert [r is not None for r in cache.r] == [True, False, True, True, False]
    assert cache.k[1].shape == (32, 4) and cache.v[1].shape == (6, 32)          # V transposed by default
    flat = make(engine, v_trans=False, dtype_k="f16", dtype_v="bf16")
    assert flat.v[3].shape == (32, 6) and flat.k[3].dtype == np.float16 and flat.dtype_v == "bf16"
    assert cache.r[0].shape == (4, 3) and cache.s[3].shape == (4, 5)


@pytest.mark.parametrize("bad, message", [
    (dict(attn_layers=[5]), "attn_layers entry"), (dict(recr_layers=[1, 1]), "recr_layers must not repeat"),
    (dict(recr_layers="01"), "recr_layers must be None"), (dict(kv_size=0), "kv_size"),
    (dict(n_embd_k=0), "n_embd_k"), (dict(dtype_k="q8_0"), "dtype_k"), (dict(swa_type="wide"), "swa_type"),
    (dict(n_seq_max=0), "n_seq_max"), (dict(v_trans=2), "v_trans")])
def test_bad_configuration_names_the_value(engine, bad, message):
    with pytest.raises(ConfigError, match=message):
        make(engine, **bad)


def test_a_prompt_lands_in_both_halves_and_the_model_reads_its_cells(engine):
    cache = make(engine)
    histories = Histories(4)
    st = decode(cache, histories, {0: [5, 6, 7], 1: [8, 9]})
    assert st.n_ubatches >= 1
    assert_holds_its_history(cache, histories)
    assert [cache.seq_pos_max(s) for s in range(4)] == [2, 1, -1, -1]
    cache.check()
    # the decode step: one token each; the mask lets each see its own sequence only
    st = cache.init_batch(Batch(token=[1, 2], seq_id=[0, 1]))
    st.apply()
    cells = st.kv_cells.tolist()
    mask = st.kv_mask()
    assert mask.shape == (2, st.n_kv) and st.n_kv == 32
    for t, seq in enumerate(st.ubatch.seq_owner.tolist()):   # one token per group here
        visible = set(np.flatnonzero(mask[t] == 0).tolist())
        assert visible == set(cache.seq_kv_cells(seq).tolist()) and cells[t] in visible
    assert np.all(np.isneginf(mask[mask != 0]))


def test_layers_that_are_both_or_neither(engine):
    cache = make(engine, attn_layers=[0, 1], recr_layers=[1, 2])   # layer 1 both (Falcon-H1), 3 and 4 neither
    histories = Histories(4)
    decode(cache, histories, {2: [1, 2, 3]})
    assert_holds_its_history(cache, histories)
    st = cache.init_batch(Batch(token=[4], seq_id=[2]))
    st.apply()
    st.k(1), st.r(1)
    with pytest.raises(OutOfRangeError, match="layer 3 has no attention"):
        st.k(3)
    with pytest.raises(OutOfRangeError, match="layer 0 holds no recurrent state"):
        st.r(0)


def test_seq_rm_in_the_middle_is_refused_by_the_recurrent_half_and_changes_nothing(engine):
    cache = make(engine)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3, 4], 1: [5, 6]})
    before = snapshot(cache)
    assert cache.seq_rm(0, 1, 2) is False
    assert cache.seq_rm(0, 2, -1) is False            # no rollback history: the state cannot be cut
    assert same(before, snapshot(cache))
    assert cache.seq_rm(0, -1, -1) is True              # the whole sequence: both halves
    histories.forget(0)
    assert_holds_its_history(cache, histories)
    assert cache.seq_rm(7, -1, -1) is False             # no such sequence: nothing, as llama.cpp


def test_rollback_takes_tokens_back_from_both_halves(engine):
    cache = make(engine, n_rollback=3)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3], 1: [7, 8]})
    decode(cache, histories, {0: [4, 5, 6]})          # one ubatch of 3: states after 3 and 4 kept
    assert cache.seq_rollback_min(0) <= 4
    assert cache.seq_rm(0, 4, -1) is True             # back to the state after position 3
    histories.keep_before(0, 4)
    assert_holds_its_history(cache, histories)
    cache.check()
    decode(cache, histories, {0: [9]})                # and on from there, as if 5 and 6 never were
    assert_holds_its_history(cache, histories)


def test_seq_add_refused_by_either_half_changes_neither(engine):
    cache = make(engine)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3]})
    before = snapshot(cache)
    with pytest.raises(PositionError):
        cache.seq_add(0, 0, -1, -3)                   # the recurrent state would move below 0 (KV would free)
    with pytest.raises(PositionError):
        cache.seq_add(0, 0, -1, 2**31 - 3)            # a KV position would reach 2**31 - 1
    with pytest.raises(ArgumentError, match="shift must be in"):
        cache.seq_add(0, 0, -1, 2**40)
    with pytest.raises(SeqIdError):
        cache.seq_add(4, 0, -1, 1)
    assert same(before, snapshot(cache))
    cache.seq_add(0, 1, -1, 10)                       # positions 1, 2 -> 11, 12 in both halves
    assert cache.kv_has_shift and sorted(c[0] for c in cache.kv_cells() if c) == [0, 11, 12]
    assert cache.seq_pos_max(0) == 12 and cache.recurrent_cell(cache.seq_row(0)).pos == 12
    cache.kv_reset_shift()
    assert not cache.kv_has_shift


def test_seq_div_and_keep_act_on_both(engine):
    cache = make(engine)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3, 4, 5], 1: [6, 7]})
    before = snapshot(cache)
    with pytest.raises(Exception, match="d must"):
        cache.seq_div(0, 0, -1, 0)
    assert same(before, snapshot(cache))
    cache.seq_div(0, 0, -1, 2)
    assert sorted(c[0] for c in cache.kv_cells() if c and 0 in c[1]) == [0, 0, 1, 1, 2]
    assert cache.seq_pos_max(0) == 2
    cache.seq_keep(1)
    assert cache.seq_pos_max(0) == -1 and cache.seq_pos_max(1) == 1
    histories.forget(0)
    assert cache.seq_pos_min(1) == 1   # as llama.cpp: the larger minimum, the recurrent state's position


def test_a_move_that_would_part_the_halves_is_refused_and_changes_nothing(engine):
    """The KV half moves the range's cells, the recurrent half the state only when it lies in the range:
    a range ending below the last position, or one moving the last below a position left behind, would
    leave the sequence's KV cells ending elsewhere than its state (test_hybrid_moves.py: every case)."""
    cache = make(engine, n_rollback=2)
    decode(cache, Histories(4), {0: [1, 2, 3, 4, 5, 6], 1: [1, 2]})
    before, reach = snapshot(cache), [cache.seq_rollback_min(s) for s in range(4)]
    for call, kv_last, state in ((lambda: cache.seq_div(0, 3, -1, 3), 2, 1),     # 3, 4, 5 -> 1, 1, 1; 2 stays
                                 (lambda: cache.seq_add(0, 0, 3, 10), 12, 5),    # 0, 1, 2 -> 10, 11, 12; 5 stays
                                 (lambda: cache.seq_add(0, 4, -1, -3), 3, 2)):   # 4, 5 -> 1, 2; 3 stays
        with pytest.raises(ArgumentError, match=f"sequence 0's KV cells ending at position {kv_last} but its "
                                                f"recurrent state at {state}: a hybrid sequence's KV cells"):
            call()
        assert same(before, snapshot(cache)) and [cache.seq_rollback_min(s) for s in range(4)] == reach
    cache.seq_div(0, 3, -1, 2)       # 3, 4, 5 -> 1, 2, 2: the last KV position is the state's, 2
    cache.seq_add(0, 0, 2, 1)        # the positions 0 and 1 -> 1 and 2: none past the last
    assert cache.seq_pos_max(0) == 2
    cache.check()


def test_a_fork_shares_kv_cells_and_the_recurrent_state(engine):
    cache = make(engine)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3]})
    cache.seq_cp(0, 2)
    histories.copy(0, 2)
    assert cache.kv_used == 3                           # shared, not copied
    assert_holds_its_history(cache, histories)
    decode(cache, histories, {0: [4], 2: [5]})          # each goes on alone
    assert_holds_its_history(cache, histories)
    with pytest.raises(SeqIdError):
        cache.seq_cp(0, 9)
    before = snapshot(cache)
    with pytest.raises(ArgumentError, match="holds positions"):
        cache.seq_cp(0, 2)                              # 2 holds its own tokens
    with pytest.raises(ArgumentError, match="does not cover"):
        cache.seq_cp(0, 3, 0, 2)                        # part of the KV cells beside a whole state
    with pytest.raises(ArgumentError, match="does not cover"):
        cache.seq_cp(0, 3, 1, -1)
    assert same(before, snapshot(cache))
    cache.seq_cp(0, 3, 0, 100)                          # a range covering every position is the whole
    histories.copy(0, 3)
    assert_holds_its_history(cache, histories)
    cache.check()


def test_a_state_is_stale_after_any_change(engine):
    cache = make(engine)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2]})
    st = cache.init_batch(Batch(token=[3], seq_id=[0]))
    cache.seq_rm(1, -1, -1)
    before = snapshot(cache)
    with pytest.raises(UsageError, match="changed"):
        st.apply()
    assert same(before, snapshot(cache))
    st = cache.init_batch(Batch(token=[3], seq_id=[0]))
    st.apply()
    cache.kv_reset_shift()
    with pytest.raises(UsageError, match="changed"):
        st.kv_mask()


def test_a_batch_that_does_not_fit_fails_to_prepare_and_changes_nothing(engine):
    cache = make(engine, kv_size=4)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3]})
    before = snapshot(cache)
    st = cache.init_batch(Batch(token=[4, 5], seq_id=[1, 1]))
    assert st.status is MemoryStatus.FAILED_PREPARE and st.n_ubatches == 0
    assert same(before, snapshot(cache))


def test_ubatches_find_their_cells_up_front(engine):
    cache = make(engine, kv_size=12)
    histories = Histories(4)
    decode(cache, histories, {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 10, 11]}, n_ubatch=2)
    assert_holds_its_history(cache, histories)
    cache.check()


def test_tokens_shared_by_several_sequences_are_one_cell_each(engine):
    cache = make(engine)
    histories = Histories(4)
    st = cache.init_batch(Batch(token=[1, 2, 3], seq_id=[[0, 2], [0, 2], [0, 2]]))
    for ub in st:
        write(cache, st, ub, histories)
    assert cache.kv_used == 3 and all(c[1] == (0, 2) for c in cache.kv_cells() if c)
    assert_holds_its_history(cache, histories)
    decode(cache, histories, {0: [4], 2: [5, 6]})
    assert cache.kv_used == 6
    assert_holds_its_history(cache, histories)
    cache.check()
