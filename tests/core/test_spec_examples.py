"""Hand-worked examples of SPEC.md, run against every implementation (``rc`` fixture).

Every expected value below was worked out by hand from the SPEC text; the
comment above each block shows the reasoning (§ numbers are SPEC sections).

Notation used in the comments:
  * a cell is written ``(pos, src, tail, seq_ids)`` — ``tail`` is the field
    stored on that cell index, i.e. the cell holding the sequence whose id is
    the cell's index (SPEC §1);
  * ``[g0 g1 ...]`` is the list of groups of a ubatch, owner first;
  * "groups consumed from the end" refers to §3 step 3.

State data is tracked with *markers*: ``mark(cache, row, m)`` fills row
``row`` of every layer with a value derived from ``m``, and ``marker(cache,
row)`` reads it back (0 = an all-zero row).  A sequence's marker travelling
with it across cells is how the copy plan (§2) is checked.
"""

from __future__ import annotations

import numpy as np
import pytest

from rows import host

EMPTY = (-1, -1, -1, ())


# -- helpers -------------------------------------------------------------------


def table(cache):
    """The cell table as ``[(pos, src, tail, sorted seq ids), ...]``."""
    return [(p, src, tail, tuple(sorted(ids)))
            for p, src, tail, ids in (cache.cell(i) for i in range(cache.size))]


def mark(cache, row, m):
    """Write marker ``m`` into ``row`` of every layer: r = m + il/2, s = -(m + il/2)."""
    for il in range(cache.n_layer):
        cache.r[il][row] = m + 0.5 * il
        cache.s[il][row] = -(m + 0.5 * il)


def marker(cache, row):
    """The marker held by ``row`` (0 when every layer's row is zero)."""
    m = float(cache.r[0][row][0])
    for il in range(cache.n_layer):
        if m == 0:
            expect_r = expect_s = 0.0
        else:
            expect_r, expect_s = m + 0.5 * il, -(m + 0.5 * il)
        r, s = host(cache.r[il][row]), host(cache.s[il][row])
        assert np.all(r == expect_r), f"row {row} layer {il} r: {r}"
        assert np.all(s == expect_s), f"row {row} layer {il} s: {s}"
    return m


def markers(cache):
    return [marker(cache, row) for row in range(cache.size)]


def group_markers(cache, st):
    """Markers of the ubatch's groups, read through the ``st.r`` / ``st.s`` views."""
    ub = st.ubatch
    found = []
    for s in range(ub.n_seqs):
        # the views must show exactly the cache rows head + s
        for il in range(cache.n_layer):
            np.testing.assert_array_equal(host(st.r(il)[s]), host(cache.r[il][st.head + s]))
            np.testing.assert_array_equal(host(st.s(il)[s]), host(cache.s[il][st.head + s]))
        found.append(marker(cache, st.head + s))
    return found


def mark_groups(cache, st, values):
    """After a ubatch is computed the graph writes each group's new state to row head + s."""
    for s, m in enumerate(values):
        mark(cache, st.head + s, m)


def summary(ub):
    return {
        "n_tokens": ub.n_tokens,
        "n_seq_tokens": ub.n_seq_tokens,
        "n_seqs": ub.n_seqs,
        "token": None if ub.token is None else ub.token.tolist(),
        "pos": ub.pos.tolist(),
        "seq_id": tuple(tuple(ids) for ids in ub.seq_id),
        "output": [bool(x) for x in ub.output],
        "batch_index": ub.batch_index.tolist(),
    }


def plan(st):
    return st.head, st.n_kv, st.copy_src.tolist(), [bool(z) for z in st.zero]


def run(cache, rc, batch, **kwargs):
    """init_batch + apply every ubatch; returns the state."""
    st = cache.init_batch(batch, **kwargs)
    assert st.status == rc.MemoryStatus.SUCCESS
    while True:
        st.apply()
        if not st.next():
            return st


# -- continuous batching ------------------------------------------------------


def test_continuous_batching_three_prompts_then_one_decode_step(rc):
    cache = rc.RecurrentCache(2, 2, 3, n_seq_max=3)
    # batch index:   0   1   2   3   4   5   6   7   8
    # seq:           0   0   0   1   1   2   2   2   2
    # pos:           0   1   2   0   1   0   1   2   3
    # logits:                1       1               1
    batch = rc.Batch(token=[10, 11, 12, 20, 21, 30, 31, 32, 33],
                     pos=[0, 1, 2, 0, 1, 0, 1, 2, 3],
                     seq_id=np.array([0, 0, 0, 1, 1, 2, 2, 2, 2]),
                     logits=[0, 0, 1, 0, 1, 0, 0, 0, 1])
    # §3 split: groups [0](idx 0-2, len 3), [1](idx 3-4, len 2), [2](idx 5-8, len 4);
    # sorted longer first: [2] [0] [1]; consumed from the end: [1] first.
    # ubatch 1: limit 9; [1] fixes length 2; then 2 tokens of [0], 2 of [2] (2+6 <= 9).
    # ubatch 2: left 3; [1] is empty; [0] has 1 left -> length 1; then 1 token of [2].
    # ubatch 3: the last token of [2].
    st = cache.init_batch(batch)
    assert st.status == rc.MemoryStatus.SUCCESS

    # find_slot ub1 on the empty cache: next_empty 0; owner 1 -> cell 0, owner 0 -> cell 1,
    # owner 2 -> cell 2; min 0, max 2, no swap; every cell new: copy itself, zeroed.
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 6, "n_seq_tokens": 2, "n_seqs": 3,
        "token": [20, 21, 10, 11, 30, 31], "pos": [0, 1, 0, 1, 0, 1],
        "seq_id": ((1,), (0,), (2,)),
        "output": [False, True, False, False, False, False],
        "batch_index": [3, 4, 0, 1, 5, 6]}
    assert plan(st) == (0, 3, [0, 1, 2], [True, True, True])
    assert cache.n == 3
    # tails: seq 0 -> cell 1 (stored on cell 0), seq 1 -> cell 0, seq 2 -> cell 2
    assert table(cache) == [(1, 0, 1, (1,)), (1, 1, 0, (0,)), (1, 2, 2, (2,))]
    assert (cache.head, cache.used) == (0, 3)
    assert group_markers(cache, st) == [0, 0, 0]
    mark_groups(cache, st, [11, 10, 12])  # seq 1, seq 0, seq 2

    # ub2 [0] [2] at pos 2: both hold their cells alone and keep them (cells 1, 2);
    # min 1 max 2, in order already; src == cell so the rows stay where they are.
    assert st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 2, "n_seq_tokens": 1, "n_seqs": 2, "token": [12, 32], "pos": [2, 2],
        "seq_id": ((0,), (2,)), "output": [True, False], "batch_index": [2, 7]}
    assert plan(st) == (1, 2, [1, 2], [False, False])
    assert table(cache) == [(1, 0, 1, (1,)), (2, 1, 0, (0,)), (2, 2, 2, (2,))]
    assert group_markers(cache, st) == [10, 12]
    mark_groups(cache, st, [20, 22])

    # ub3 [2] at pos 3: keeps cell 2; head 2, n 1.
    assert st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 1, "n_seq_tokens": 1, "n_seqs": 1, "token": [33], "pos": [3],
        "seq_id": ((2,),), "output": [True], "batch_index": [8]}
    assert plan(st) == (2, 1, [2], [False])
    assert group_markers(cache, st) == [22]
    mark_groups(cache, st, [32])
    assert not st.next()
    # outputs in ubatch order: idx 4 (ub1), idx 2 (ub2), idx 8 (ub3)
    assert st.out_ids.tolist() == [4, 2, 8]
    assert st.out_ids.dtype == np.int64
    assert table(cache) == [(1, 0, 1, (1,)), (2, 1, 0, (0,)), (3, 2, 2, (2,))]
    assert (cache.head, cache.used, cache.n) == (2, 3, 1)
    assert markers(cache) == [11, 20, 32]
    cache.check()

    # One decode step of all three (batch order seq 0, 1, 2): one group per token, all of
    # length 1, stable order [0] [1] [2], consumed from the end -> [2] [1] [0].
    # find_slot: head 2 <= used 3 + 6, no reset; everyone keeps its cell: seq 2 in 2,
    # seq 1 in 0, seq 0 in 1 -> min 0, max 2.
    # gather s=0: seq 2 must be in cell 0: swap cells 0 and 2 -> cell 0 = (3, src 2, {2}),
    #   cell 2 = (1, src 0, {1}); tails: seq 1 -> 2, seq 2 -> 0.
    # gather s=1: seq 1 must be in cell 1: swap 1 and 2 -> cell 1 = (1, src 0, {1}),
    #   cell 2 = (2, src 1, {0}); tails: seq 1 -> 1, seq 0 -> 2.
    # gather s=2: seq 0 is in cell 2. New pos: 4, 2, 3.
    # copy plan: copy_src = srcs [2, 0, 1], nothing zeroed; each group's row gets its
    # sequence's marker back.
    st = cache.init_batch(rc.Batch(token=[13, 22, 34], pos=[3, 2, 4], seq_id=[0, 1, 2]))
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 3, "n_seq_tokens": 1, "n_seqs": 3, "token": [34, 22, 13], "pos": [4, 2, 3],
        "seq_id": ((2,), (1,), (0,)), "output": [True, False, False], "batch_index": [2, 1, 0]}
    assert plan(st) == (0, 3, [2, 0, 1], [False, False, False])
    assert table(cache) == [(4, 0, 2, (2,)), (2, 1, 1, (1,)), (3, 2, 0, (0,))]
    assert group_markers(cache, st) == [32, 11, 20]
    assert not st.next()
    assert st.out_ids.tolist() == [2]  # default logits: only the last batch token
    cache.check()


def three_sequences(rc):
    """The cache of the first half of the test above: seq 0 at pos 2 in cell 1,
    seq 1 at pos 1 in cell 0, seq 2 at pos 3 in cell 2, rows marked 10/11/12."""
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=3)
    run(cache, rc, rc.Batch(token=[1] * 9, pos=[0, 1, 2, 0, 1, 0, 1, 2, 3],
                            seq_id=[0, 0, 0, 1, 1, 2, 2, 2, 2]))
    assert table(cache) == [(1, 0, 1, (1,)), (2, 1, 0, (0,)), (3, 2, 2, (2,))]
    mark(cache, 0, 11)
    mark(cache, 1, 10)
    mark(cache, 2, 12)
    return cache


def test_seq_pos_min_and_max_report_the_cell_pos_of_each_sequence(rc):
    cache = three_sequences(rc)
    # one cell per sequence, so min == max == that cell's pos
    assert [cache.seq_pos_min(s) for s in range(3)] == [2, 1, 3]
    assert [cache.seq_pos_max(s) for s in range(3)] == [2, 1, 3]
    cache.seq_rm(1, -1, -1)
    assert (cache.seq_pos_min(1), cache.seq_pos_max(1)) == (-1, -1)
    # "-1 when none": no cell holds an id outside [0, size) either
    assert (cache.seq_pos_min(7), cache.seq_pos_max(7)) == (-1, -1)


def test_clear_empties_every_cell_and_zeroes_every_row(rc):
    cache = three_sequences(rc)
    cache.clear()
    assert table(cache) == [EMPTY] * 3
    assert (cache.head, cache.used) == (0, 0)
    assert markers(cache) == [0, 0, 0]
    cache.check()
    # a new prompt starts in cell 0 from zeros
    st = cache.init_batch(rc.Batch(token=[5, 6], seq_id=[2, 2], pos=[0, 1]))
    st.apply()
    assert plan(st) == (0, 1, [0], [True])
    assert table(cache) == [(1, 0, -1, (2,)), EMPTY, (-1, -1, 0, ())]


def test_iterating_a_state_applies_each_ubatch_in_turn(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=3)
    # same split as the continuous batching test: [1 0 2] x2 tokens, [0 2], [2]
    batch = rc.Batch(token=list(range(9)), pos=[0, 1, 2, 0, 1, 0, 1, 2, 3],
                     seq_id=[0, 0, 0, 1, 1, 2, 2, 2, 2])
    st = cache.init_batch(batch)
    seen = []
    for ub in st:
        # the ubatch yielded is already placed: each owner's pos is its last token's pos
        for s, ids in enumerate(ub.seq_id):
            assert cache.seq_pos_max(ids[0]) == ub.pos[(s + 1) * ub.n_seq_tokens - 1]
        seen.append(([ids[0] for ids in ub.seq_id], st.head, st.n_kv))
    assert seen == [([1, 0, 2], 0, 3), ([0, 2], 1, 2), ([2], 2, 1)]
    assert table(cache) == [(1, 0, 1, (1,)), (2, 1, 0, (0,)), (3, 2, 2, (2,))]
    assert st.out_ids.tolist() == [8]


# -- forks, shared prompts, removal -------------------------------------------


def test_fork_with_seq_cp_then_divergent_decoding(rc):
    cache = rc.RecurrentCache(2, 2, 3, n_seq_max=4)
    run(cache, rc, rc.Batch(token=[1, 2, 3]))  # seq 0, pos 0..2 -> cell 0
    assert table(cache) == [(2, 0, 0, (0,)), EMPTY, EMPTY, EMPTY]
    mark(cache, 0, 7)  # the parent's state

    # seq_cp: the children join the parent's cell; their tails (on cells 1, 2) point at 0
    cache.seq_cp(0, 1, -1, -1)
    cache.seq_cp(0, 2, 0, 1)  # the range is ignored: the whole state is shared
    assert table(cache) == [(2, 0, 0, (0, 1, 2)), (-1, -1, 0, ()), (-1, -1, 0, ()), EMPTY]
    assert cache.used == 1
    assert [cache.seq_pos_max(s) for s in range(4)] == [2, 2, 2, -1]
    cache.check()

    # Decode one token each (batch order 0, 1, 2) -> groups [2] [1] [0].
    # next_empty = 1. seq 2 shares cell 0 -> takes cell 1 (pos 2, src 0), leaves cell 0;
    # next_empty -> 2. seq 1 shares cell 0 with seq 0 -> takes cell 2 (pos 2, src 0).
    # seq 0 is now alone in cell 0 and keeps it. min 0, max 2.
    # gather s=0: seq 2 (cell 1) -> swap 0,1; s=1: seq 1 (cell 2) -> swap 1,2; s=2: seq 0 ok.
    # Cells: 0 = {2}, 1 = {1}, 2 = {0}, all with src 0 -> copy_src [0, 0, 0], no zero:
    # every child starts from the parent's state.
    st = cache.init_batch(rc.Batch(token=[4, 5, 6], pos=[3, 3, 3], seq_id=[0, 1, 2]))
    st.apply()
    assert st.ubatch.seq_id == ((2,), (1,), (0,))
    assert plan(st) == (0, 3, [0, 0, 0], [False, False, False])
    assert table(cache) == [(3, 0, 2, (2,)), (3, 1, 1, (1,)), (3, 2, 0, (0,)), EMPTY]
    assert group_markers(cache, st) == [7, 7, 7]
    mark_groups(cache, st, [32, 31, 30])  # the three states diverge
    assert not st.next()
    cache.check()

    # Next step: everyone alone in its cell, gather order already right; rows stay put.
    st = cache.init_batch(rc.Batch(token=[7, 8, 9], pos=[4, 4, 4], seq_id=[0, 1, 2]))
    st.apply()
    assert plan(st) == (0, 3, [0, 1, 2], [False, False, False])
    assert group_markers(cache, st) == [32, 31, 30]
    assert table(cache) == [(4, 0, 2, (2,)), (4, 1, 1, (1,)), (4, 2, 0, (0,)), EMPTY]


def test_seq_cp_onto_an_existing_sequence_frees_its_old_cell(rc):
    cache = three_sequences(rc)
    # seq 2 leaves cell 2 (the last member: freed), then joins seq 0's cell 1.
    cache.seq_cp(0, 2, -1, -1)
    assert table(cache) == [(1, 0, 1, (1,)), (2, 1, 0, (0, 2)), (-1, -1, 1, ())]
    assert cache.used == 2
    # no-ops: src == dst, ids outside [0, size)
    before = table(cache)
    cache.seq_cp(1, 1, -1, -1)
    cache.seq_cp(1, 3, -1, -1)
    cache.seq_cp(-1, 1, -1, -1)
    assert table(cache) == before
    # copying a sequence without a cell: dst only leaves its cell
    cache.seq_rm(1, -1, -1)
    cache.seq_cp(1, 0, -1, -1)
    assert table(cache) == [EMPTY, (2, 1, -1, (2,)), (-1, -1, 1, ())]
    cache.check()


def test_seq_keep_frees_every_other_cell(rc):
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=4)
    # seqs 0, 1, 2 at pos 0: groups [2] [1] [0] -> cells 0, 1, 2 (no swap)
    run(cache, rc, rc.Batch(token=[1, 2, 3], pos=[0, 0, 0], seq_id=[0, 1, 2]))
    assert table(cache) == [(0, 0, 2, (2,)), (0, 1, 1, (1,)), (0, 2, 0, (0,)), EMPTY]
    mark(cache, 0, 12)
    mark(cache, 1, 11)
    mark(cache, 2, 10)
    # decoding seq 1 alone leaves head at its cell, 1
    run(cache, rc, rc.Batch(token=[4], pos=[1], seq_id=[1]))
    cache.seq_cp(1, 3, -1, -1)
    assert table(cache) == [(0, 0, 2, (2,)), (1, 1, 1, (1, 3)), (0, 2, 0, (0,)), (-1, -1, 1, ())]
    assert cache.head == 1

    # seq_keep(1): cells 0 and 2 freed, cell 1 keeps only seq 1, every other tail -1,
    # head moves down to the first cell not holding seq 1: 0. Data untouched.
    cache.seq_keep(1)
    assert table(cache) == [EMPTY, (1, 1, 1, (1,)), EMPTY, EMPTY]
    assert (cache.head, cache.used) == (0, 1)
    assert [cache.seq_pos_max(s) for s in range(4)] == [-1, 1, -1, -1]
    assert markers(cache) == [12, 11, 10, 0]
    cache.check()

    # keeping a sequence that has no cell empties the whole table
    cache.seq_keep(3)
    assert table(cache) == [EMPTY] * 4
    assert (cache.head, cache.used) == (0, 0)
    cache.check()


def prompt_of_five_and_two(rc):
    """size 3: seq 0 at pos 4 in cell 0 (marker 10), seq 1 at pos 1 in cell 1 (marker 11)."""
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=3)
    run(cache, rc, rc.Batch(token=[1, 2, 3, 4, 5]))  # default seq 0, pos 0..4 -> cell 0
    # seq 1: head 0, next_empty 1 -> cell 1, head 1
    run(cache, rc, rc.Batch(token=[6, 7], pos=[0, 1], seq_id=[1, 1]))
    assert table(cache) == [(4, 0, 0, (0,)), (1, 1, 1, (1,)), EMPTY]
    assert (cache.head, cache.used) == (1, 2)
    mark(cache, 0, 10)
    mark(cache, 1, 11)
    return cache


@pytest.mark.parametrize("seq, p0, p1", [
    (0, 2, -1),   # 0 < p0=2 <= pos 4: cuts the state in the middle
    (0, 0, 3),    # 0 < p1=3 <= 4
    (0, 4, 5),    # 0 < p0=4 <= 4: even the last token alone cannot be taken back
    (0, 1, 4),
    (1, 1, 2),    # 0 < p0=1 <= pos 1 of seq 1
    (-1, 1, -1),  # all sequences, but neither empty nor everything
    (-1, 0, 4),
    (3, -1, -1),  # seq >= size
    (9, 0, 1),
])
def test_partial_seq_rm_returns_false_and_changes_nothing(rc, seq, p0, p1):
    cache = prompt_of_five_and_two(rc)
    before = (table(cache), cache.head, cache.used, markers(cache))
    assert cache.seq_rm(seq, p0, p1) is False
    assert (table(cache), cache.head, cache.used, markers(cache)) == before


def test_seq_rm_of_a_range_past_the_state_is_true_and_changes_nothing(rc):
    cache = prompt_of_five_and_two(rc)
    before = table(cache)
    # p0 = 5 > pos 4 and p1 = inf: no partial intersection; no cell pos in [5, inf)
    assert cache.seq_rm(0, 5, -1) is True
    assert cache.seq_rm(2, 0, 3) is True  # seq 2 has no cell
    assert cache.seq_rm(-1, 3, 3) is True  # empty range
    assert table(cache) == before


def test_whole_seq_rm_frees_the_cell_and_moves_head_down(rc):
    cache = prompt_of_five_and_two(rc)
    # [0, 5) contains pos 4: seq 0 leaves cell 0, the cell is freed, head 1 -> 0
    assert cache.seq_rm(0, 0, 5) is True
    assert table(cache) == [EMPTY, (1, 1, 1, (1,)), EMPTY]
    assert (cache.head, cache.used) == (0, 1)
    # freeing a cell above head does not move head up
    assert cache.seq_rm(1, -1, -1) is True
    assert table(cache) == [EMPTY, EMPTY, EMPTY]
    assert (cache.head, cache.used) == (0, 0)
    cache.check()


def test_seq_rm_of_every_sequence_empties_cells_and_tails(rc):
    cache = prompt_of_five_and_two(rc)
    cache.seq_cp(1, 2, -1, -1)  # a shared cell too
    # FIX of §1: the tails of removed sequences become -1 as well
    assert cache.seq_rm(-1, 0, -1) is True
    assert table(cache) == [EMPTY] * 3
    assert (cache.head, cache.used) == (0, 0)
    cache.check()
    # afterwards seq 1 can start again, from zeros, in cell 0
    st = cache.init_batch(rc.Batch(token=[1], pos=[0], seq_id=[1]))
    st.apply()
    assert plan(st) == (0, 1, [0], [True])
    assert group_markers(cache, st) == [0]


def test_a_freed_cell_reused_by_a_new_sequence_starts_from_zeros(rc):
    cache = prompt_of_five_and_two(rc)
    assert cache.seq_rm(0, -1, -1) is True  # frees cell 0 (marker 10 stays in the row)
    assert table(cache) == [EMPTY, (1, 1, 1, (1,)), EMPTY]
    assert cache.head == 0
    # seq 2: head 0, next_empty 0 -> cell 0; src -1 -> copy_src [0], zero [True]
    st = cache.init_batch(rc.Batch(token=[8, 9], pos=[0, 1], seq_id=[2, 2]))
    st.apply()
    assert plan(st) == (0, 1, [0], [True])
    assert table(cache) == [(1, 0, -1, (2,)), (1, 1, 1, (1,)), (-1, -1, 0, ())]
    assert group_markers(cache, st) == [0]  # FIX: not the old occupant's 10
    assert markers(cache) == [0, 11, 0]


def test_a_token_shared_by_three_sequences(rc):
    cache = rc.RecurrentCache(2, 2, 3, n_seq_max=4)
    # idx 0, 1: the shared prompt of seqs 0, 1, 2 (pos 0, 1); idx 2, 3, 4: one own token
    # each (pos 2). Sorted: the 3-id tokens first; groups [0,1,2](len 2), [0], [1], [2].
    # Ordered fewer ids first -> [0] [1] [2] [0,1,2]; the shared group is consumed first
    # and stops the ubatch. Then [2] [1] [0], one token each.
    batch = rc.Batch(token=[100, 101, 10, 11, 12], pos=[0, 1, 2, 2, 2],
                     seq_id=[[0, 1, 2], [0, 1, 2], [0], [1], [2]])
    st = cache.init_batch(batch, logits_all=True)

    # ub1: owner 0 -> cell 0 with seq ids {0,1,2}, pos 1; all three tails -> 0
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 2, "n_seq_tokens": 2, "n_seqs": 1, "token": [100, 101], "pos": [0, 1],
        "seq_id": ((0, 1, 2),), "output": [True, True], "batch_index": [0, 1]}
    assert plan(st) == (0, 1, [0], [True])
    assert table(cache) == [(1, 0, 0, (0, 1, 2)), (-1, -1, 0, ()), (-1, -1, 0, ()), EMPTY]
    assert cache.used == 1
    mark_groups(cache, st, [5])  # the shared state after the prompt

    # ub2 [2] [1] [0]: as in the fork test, seqs 2 and 1 take cells 1 and 2 copying
    # (pos 1, src 0) and the gather swaps them into 0 = {2}, 1 = {1}, 2 = {0}.
    assert st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 3, "n_seq_tokens": 1, "n_seqs": 3, "token": [12, 11, 10], "pos": [2, 2, 2],
        "seq_id": ((2,), (1,), (0,)), "output": [True, True, True], "batch_index": [4, 3, 2]}
    assert plan(st) == (0, 3, [0, 0, 0], [False, False, False])
    assert table(cache) == [(2, 0, 2, (2,)), (2, 1, 1, (1,)), (2, 2, 0, (0,)), EMPTY]
    assert group_markers(cache, st) == [5, 5, 5]
    assert not st.next()
    assert st.out_ids.tolist() == [0, 1, 4, 3, 2]  # logits_all, in ubatch order
    cache.check()


def test_new_sequence_taking_a_cell_the_gather_moves_keeps_its_own_state(rc):
    # The tail-swap case of §2 step 5 (the reference's bug).
    cache = rc.RecurrentCache(2, 2, 3, n_seq_max=2)
    # seqs 0 and 1 at pos 0: groups [1] [0] -> seq 1 in cell 0, seq 0 in cell 1
    st = cache.init_batch(rc.Batch(token=[1, 2], pos=[0, 0], seq_id=[0, 1]))
    st.apply()
    assert st.ubatch.seq_id == ((1,), (0,))
    assert table(cache) == [(0, 0, 1, (1,)), (0, 1, 0, (0,))]
    mark(cache, st.head + 0, 41)  # seq 1's state
    mark(cache, st.head + 1, 40)  # seq 0's state
    assert not st.next()

    assert cache.seq_rm(1, -1, -1) is True
    assert table(cache) == [(-1, -1, 1, ()), (0, 1, -1, (0,))]
    assert (cache.head, cache.used) == (0, 1)

    # batch: idx 0 = seq 0 pos 1, idx 1-2 = seq 1 pos 0, 1 (a brand new seq 1).
    # groups [0](len 1), [1](len 2) -> ordered [1] [0], consumed from the end:
    # ub1 = [0] [1] with one token each, ub2 = [1] with its second token.
    st = cache.init_batch(rc.Batch(token=[3, 4, 5], pos=[1, 0, 1], seq_id=[0, 1, 1]))
    # find_slot ub1: next_empty 0. seq 0 keeps cell 1; new seq 1 takes cell 0 (tail 0,
    # not yet entered in it). min 0, max 1.
    # gather s=0: seq 0 must be in cell 0 -> swap cells 0 and 1: cell 0 = (0, src 1, {0}),
    # cell 1 = empty; EVERY tail is fixed: seq 0 -> 0, and seq 1 (pointing at 0) -> 1.
    # gather s=1: seq 1 is in cell 1. New pos: cell 0 = 1 {0}, cell 1 = 0 {1}.
    # copy plan: cell 0 src 1 -> copy 1; cell 1 src -1 -> copy itself, zeroed.
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 2, "n_seq_tokens": 1, "n_seqs": 2, "token": [3, 4], "pos": [1, 0],
        "seq_id": ((0,), (1,)), "output": [False, False], "batch_index": [0, 1]}
    assert plan(st) == (0, 2, [1, 1], [False, True])
    assert table(cache) == [(1, 0, 0, (0,)), (0, 1, 1, (1,))]
    assert group_markers(cache, st) == [40, 0]  # seq 0 its own state, seq 1 zeros
    mark_groups(cache, st, [50, 51])

    # ub2: seq 1 keeps cell 1; head 1, n 1; its row is untouched
    assert st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 1, "n_seq_tokens": 1, "n_seqs": 1, "token": [5], "pos": [1],
        "seq_id": ((1,),), "output": [True], "batch_index": [2]}
    assert plan(st) == (1, 1, [1], [False])
    assert table(cache) == [(1, 0, 0, (0,)), (1, 1, 1, (1,))]
    assert group_markers(cache, st) == [51]
    assert markers(cache) == [50, 51]
    assert not st.next()
    assert st.out_ids.tolist() == [2]
    cache.check()


# -- find_slot search start ---------------------------------------------------


def lone_sequence_in_cell_5(rc, size):
    """seqs 0..5 at pos 0 -> groups [5]..[0] -> seq 5-c in cell c; then all but seq 0
    (cell 5) removed (head back to 0) and seq 0 decoded once (head 5, used 1)."""
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=size)
    run(cache, rc, rc.Batch(token=[0] * 6, pos=[0] * 6, seq_id=[0, 1, 2, 3, 4, 5]))
    assert [cache.cell(c)[3] for c in range(6)] == [(5,), (4,), (3,), (2,), (1,), (0,)]
    for s in range(1, 6):
        assert cache.seq_rm(s, -1, -1)
    assert cache.head == 0
    run(cache, rc, rc.Batch(token=[0], pos=[1], seq_id=[0]))
    assert (cache.head, cache.used) == (5, 1)
    return cache


def test_find_slot_restarts_the_search_at_0_when_head_is_far_past_used(rc):
    cache = lone_sequence_in_cell_5(rc, 8)
    # 1 token: head 5 > used 1 + 2*1 -> head = 0, next_empty 0
    st = cache.init_batch(rc.Batch(token=[0], pos=[0], seq_id=[6]))
    st.apply()
    assert plan(st) == (0, 1, [0], [True])
    assert cache.cell(0) == (0, 0, 5, (6,))


def test_find_slot_searches_from_head_when_it_is_not_far_past_used(rc):
    cache = lone_sequence_in_cell_5(rc, 8)
    # 2 tokens: head 5 > 1 + 4 is false -> search from 5: cell 5 is taken -> cell 6
    st = cache.init_batch(rc.Batch(token=[0, 0], pos=[0, 1], seq_id=[6, 6]))
    st.apply()
    assert plan(st) == (6, 1, [6], [True])
    assert cache.cell(6) == (1, 6, 6, (6,))


def test_find_slot_search_wraps_around_the_end(rc):
    cache = lone_sequence_in_cell_5(rc, 6)
    # no reset (5 > 1 + 4 is false); cell 5 is the last and taken -> wraps to cell 0
    st = cache.init_batch(rc.Batch(token=[0, 0], pos=[0, 1], seq_id=[1, 1]))
    st.apply()
    assert plan(st) == (0, 1, [0], [True])
    assert cache.cell(0) == (1, 0, 5, (1,))
    assert cache.cell(1) == (-1, -1, 0, ())


# -- splitting and outputs on a mixed batch ------------------------------------

# idx   token  seq ids  pos
#  0    100    [0]      0
#  1    101    [1, 2]   0
#  2    102    [0]      1
#  3    103    [1, 2]   1
#  4    104    [1]      2
#  5    105    [2]      2
#  6    106    [2]      3
#  7    107    [0]      2
# §3 step 1 order: idx 1, 3 (two ids), then [0]: 0, 2, 7; [1]: 4; [2]: 5, 6.
# step 2 groups: A=[1,2](1,3) G0=[0](0,2,7) G1=[1](4) G2=[2](5,6)
# step 3 order: G0(len 3) G2(len 2) G1(len 1) A(two ids); consumed from the end.
MIXED = dict(token=[100, 101, 102, 103, 104, 105, 106, 107],
             pos=[0, 0, 1, 1, 2, 2, 3, 2],
             seq_id=[[0], [1, 2], [0], [1, 2], [1], [2], [2], [0]])


def ubatch_shapes(st):
    """Apply every ubatch; per ubatch (owners' seq-id lists, n_seq_tokens, batch_index)."""
    return [(tuple(tuple(ids) for ids in ub.seq_id), ub.n_seq_tokens, ub.batch_index.tolist())
            for ub in st]


def test_split_equal_of_a_mixed_batch_and_its_placement(rc):
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=4)
    st = cache.init_batch(rc.Batch(**MIXED, logits=[0, 1, 0, 0, 1, 0, 1, 1]))

    # ub1: A fixes length 2 and stops (more than one id). Owner 1 -> cell 0, ids {1, 2}.
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 2, "n_seq_tokens": 2, "n_seqs": 1, "token": [101, 103], "pos": [0, 1],
        "seq_id": ((1, 2),), "output": [True, False], "batch_index": [1, 3]}
    assert plan(st) == (0, 1, [0], [True])
    assert table(cache) == [(1, 0, -1, (1, 2)), (-1, -1, 0, ()), (-1, -1, 0, ()), EMPTY]
    mark_groups(cache, st, [50])

    # ub2: limit 6: G1 fixes length 1; then 1 of G2, 1 of G0 -> [1] [2] [0], pos 2, 2, 0.
    # find_slot: next_empty 1; seq 1 shares cell 0 -> cell 1 (pos 1, src 0), next_empty 2;
    # seq 2 now alone in cell 0 keeps it; new seq 0 takes cell 2. min 0 max 2.
    # gather s=0: seq 1 is in cell 1 -> swap 0,1 (tails: seq 2 -> 1, seq 1 -> 0).
    # Cells: 0 = (2, src 0, {1}), 1 = (2, src 0, {2}), 2 = (0, src -1, {0}).
    st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 3, "n_seq_tokens": 1, "n_seqs": 3, "token": [104, 105, 100], "pos": [2, 2, 0],
        "seq_id": ((1,), (2,), (0,)), "output": [True, False, False], "batch_index": [4, 5, 0]}
    assert plan(st) == (0, 3, [0, 0, 2], [False, False, True])
    assert table(cache) == [(2, 0, 2, (1,)), (2, 1, 0, (2,)), (0, 2, 1, (0,)), EMPTY]
    assert group_markers(cache, st) == [50, 50, 0]  # both children start from the prompt
    mark_groups(cache, st, [61, 62, 60])

    # ub3: limit 3: G2 (1 left) fixes length 1, then 1 of G0 -> [2] [0] at pos 3, 1;
    # both keep cells 1 and 2.
    st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 2, "n_seq_tokens": 1, "n_seqs": 2, "token": [106, 102], "pos": [3, 1],
        "seq_id": ((2,), (0,)), "output": [True, False], "batch_index": [6, 2]}
    assert plan(st) == (1, 2, [1, 2], [False, False])
    assert group_markers(cache, st) == [62, 60]

    # ub4: the last token of G0
    st.next()
    st.apply()
    assert summary(st.ubatch) == {
        "n_tokens": 1, "n_seq_tokens": 1, "n_seqs": 1, "token": [107], "pos": [2],
        "seq_id": ((0,),), "output": [True], "batch_index": [7]}
    assert plan(st) == (2, 1, [2], [False])
    assert not st.next()
    assert table(cache) == [(2, 0, 2, (1,)), (3, 1, 0, (2,)), (2, 2, 1, (0,)), EMPTY]
    assert (cache.head, cache.used) == (2, 3)
    # explicit flags on idx 1, 4, 6, 7, listed in ubatch order
    assert st.out_ids.tolist() == [1, 4, 6, 7]
    cache.check()


def test_split_equal_with_a_small_n_ubatch(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=4)
    # limit 2 each time:
    # ub1: A, length 2, stop.   ub2: G1 length 1 + 1 of G2 (1 + 2 > 2 stops).
    # ub3: G2 length 1 + 1 of G0.   ub4: G0 (2 left) fixes length 2.
    st = cache.init_batch(rc.Batch(**MIXED), n_ubatch=2)
    assert ubatch_shapes(st) == [
        (((1, 2),), 2, [1, 3]),
        (((1,), (2,)), 1, [4, 5]),
        (((2,), (0,)), 1, [6, 0]),
        (((0,),), 2, [2, 7]),
    ]
    assert [cache.seq_pos_max(s) for s in range(4)] == [2, 2, 3, -1]
    assert st.out_ids.tolist() == [7]  # default: only batch index n_tokens - 1


def test_split_seq_for_pooled_embeddings_takes_one_group_per_ubatch(rc):
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=4)
    st = cache.init_batch(rc.Batch(**MIXED), embd_pooled=True, logits_all=True)
    # one group per ubatch, consumed from the end: A, G1, G2, G0
    # ub1: A -> cell 0 ({1, 2}).  ub2: seq 1 shares cell 0 -> next_empty 1, copying src 0.
    # ub3: seq 2 alone in cell 0 keeps it.  ub4: new seq 0 -> next_empty from head 0 = 2.
    seen = []
    for ub in st:
        seen.append((tuple(tuple(ids) for ids in ub.seq_id), ub.n_seq_tokens,
                     ub.batch_index.tolist(), plan(st)))
        if ub.seq_id == ((1, 2),):
            mark_groups(cache, st, [9])
        else:
            assert group_markers(cache, st) == [0 if ub.seq_id == ((0,),) else 9]
    assert seen == [
        (((1, 2),), 2, [1, 3], (0, 1, [0], [True])),
        (((1,),), 1, [4], (1, 1, [0], [False])),
        (((2,),), 2, [5, 6], (0, 1, [0], [False])),
        (((0,),), 3, [0, 2, 7], (2, 1, [2], [True])),
    ]
    assert table(cache) == [(3, 0, 2, (2,)), (2, 1, 1, (1,)), (2, 2, 0, (0,)), EMPTY]
    assert st.out_ids.tolist() == [1, 3, 4, 5, 6, 0, 2, 7]


def test_split_seq_with_a_small_n_ubatch_cuts_long_groups(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=4)
    st = cache.init_batch(rc.Batch(**MIXED), n_ubatch=2, embd_pooled=True)
    assert ubatch_shapes(st) == [
        (((1, 2),), 2, [1, 3]),
        (((1,),), 1, [4]),
        (((2,),), 2, [5, 6]),
        (((0,),), 2, [0, 2]),
        (((0,),), 1, [7]),
    ]


@pytest.mark.parametrize("logits, logits_all, expected", [
    (None, False, [7]),                                   # default: last batch index only
    ([1, 0, 0, 0, 0, 0, 0, 0], False, [0]),               # idx 0 is in the 2nd ubatch
    ([1, 1, 1, 0, 0, 0, 0, 0], False, [1, 0, 2]),         # ubatch order, not batch order
    ([False, True, False, True, True, True, True, False], False, [1, 3, 4, 5, 6]),
    ([0] * 8, False, []),
    (None, True, [1, 3, 4, 5, 0, 6, 2, 7]),               # ub order: [1,3] [4,5,0] [6,2] [7]
    ([0] * 8, True, [1, 3, 4, 5, 0, 6, 2, 7]),            # logits_all wins over flags
])
def test_out_ids_map_output_rows_back_to_batch_order(rc, logits, logits_all, expected):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=4)
    st = cache.init_batch(rc.Batch(**MIXED, logits=logits), logits_all=logits_all)
    outputs = []
    for ub in st:
        outputs += ub.batch_index[ub.output.astype(bool)].tolist()
    assert outputs == expected
    assert st.out_ids.tolist() == expected


def test_embedding_batches_carry_embedding_rows_in_ubatch_order(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=2)
    embd = np.array([[0.5, 1.0], [1.5, 2.0], [2.5, 3.0]], dtype=np.float32)
    # groups [0](idx 0, 2) [1](idx 1) -> ordered [0] [1], consumed from the end:
    # ub1 = [1] [0] one token each (idx 1, 0), ub2 = [0] (idx 2)
    st = cache.init_batch(rc.Batch(embd=embd, pos=[0, 0, 1], seq_id=[0, 1, 0]))
    rows = []
    for ub in st:
        assert ub.token is None
        rows.append(ub.embd.tolist())
    assert rows == [[[1.5, 2.0], [0.5, 1.0]], [[2.5, 3.0]]]


# -- defaults -----------------------------------------------------------------


def test_default_seq_ids_positions_and_outputs(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=2)
    # defaults: seq [0] for every token, pos seq_pos_max(0) + 1 = 0, 1, 2; last output
    st = cache.init_batch(rc.Batch(token=[1, 2, 3]))
    (ub,) = list(st)
    assert summary(ub) == {
        "n_tokens": 3, "n_seq_tokens": 3, "n_seqs": 1, "token": [1, 2, 3], "pos": [0, 1, 2],
        "seq_id": ((0,),), "output": [False, False, True], "batch_index": [0, 1, 2]}
    assert st.out_ids.tolist() == [2]
    # the next default batch continues seq 0 at 3
    (ub,) = list(cache.init_batch(rc.Batch(token=[4, 5])))
    assert ub.pos.tolist() == [3, 4]
    # each token continues its own (first) sequence, as current llama.cpp does
    (ub,) = list(cache.init_batch(rc.Batch(token=[6, 7], seq_id=[1, 1])))
    assert ub.pos.tolist() == [0, 1]
    assert table(cache) == [(4, 0, 0, (0,)), (1, 1, 1, (1,))]
    # counting the earlier tokens of each sequence in the same batch, in batch order
    st = cache.init_batch(rc.Batch(token=[8, 9, 10, 11], seq_id=[1, 0, 1, 0]))
    assert [ub.pos.tolist() for ub in st] == [[2, 3, 5, 6]]   # groups: seq 1, then seq 0
    assert sorted(zip(st.ubatch.batch_index.tolist(), st.ubatch.pos.tolist())) == [(0, 2), (1, 5), (2, 3), (3, 6)]


def test_init_full_covers_the_whole_cache(rc):
    cache = three_sequences(rc)
    before = (table(cache), markers(cache))
    st = cache.init_full()
    assert st.status == rc.MemoryStatus.SUCCESS
    assert (st.head, st.n_kv) == (0, 3)
    assert (table(cache), markers(cache)) == before
    big = rc.RecurrentCache(0, 1, 1, n_seq_max=2, size=7)
    st = big.init_full()
    assert (st.head, st.n_kv) == (0, 7)


# -- seq_add / seq_div --------------------------------------------------------


def test_seq_add_and_seq_div_move_the_tail_cell_pos(rc):
    cache = rc.RecurrentCache(1, 1, 1, n_seq_max=2)
    run(cache, rc, rc.Batch(token=[1, 2, 3, 4, 5]))  # seq 0 at pos 4 in cell 0

    steps = [
        ("add", (-1, -1, 3), 7),     # 4 in [0, inf): 4 + 3
        ("add", (0, 7, 5), 7),       # 7 not in [0, 7)
        ("add", (7, 8, -2), 5),      # 7 in [7, 8): 7 - 2
        ("add", (3, 3, 10), 5),      # p0 == p1: no-op
        ("add", (-1, -1, 0), 5),     # shift 0: no-op
        ("div", (-1, -1, 2), 2),     # 5 // 2
        ("div", (0, 2, 2), 2),       # 2 not in [0, 2)
        ("div", (-1, -1, 1), 2),     # d == 1: no-op
        ("div", (2, 3, 3), 0),       # 2 // 3
    ]
    for op, (p0, p1, arg), expected in steps:
        getattr(cache, "seq_" + op)(0, p0, p1, arg)
        assert cache.cell(0) == (expected, 0, 0, (0,)), (op, p0, p1, arg)
        assert cache.seq_pos_max(0) == expected

    # a sequence without a cell: nothing to move
    cache.seq_add(1, -1, -1, 4)
    cache.seq_div(1, -1, -1, 2)
    assert cache.cell(1) == (-1, -1, -1, ())

    # the next batch must continue the moved pos: 0 + 1
    (ub,) = list(cache.init_batch(rc.Batch(token=[6], pos=[1])))
    assert cache.cell(0) == (1, 0, 0, (0,))

    # the pos belongs to the cell, so it moves for every sequence sharing it
    cache.seq_cp(0, 1, -1, -1)
    cache.seq_add(1, -1, -1, 10)
    assert (cache.seq_pos_max(0), cache.seq_pos_max(1)) == (11, 11)
    cache.check()
