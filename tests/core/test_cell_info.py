"""``cache.cell(i)`` as a named tuple whose fields say what they are, and ``seq_cell`` / ``seq_row``:
where a sequence's state is, in one call (issue 21), checked against a scan of the whole table."""

from __future__ import annotations

import random


def scan(cache, seq: int) -> tuple[int, int]:
    """(the cell listing seq, that cell's src) by looking at every cell; (-1, -1) when none."""
    for i in range(cache.size):
        if seq in cache.cell(i).seq_ids:
            return i, cache.cell(i).src
    return -1, -1


def test_the_fields_are_named_and_the_tuple_unpacks_as_before(rc):
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=4)
    for _ in cache.init_batch(rc.Batch(token=[1, 2], seq_id=[2, 2])):
        pass
    cell = cache.cell(cache.seq_cell(2))
    assert isinstance(cell, rc.CellInfo) and cell._fields == ("pos", "src", "holder_of_seq", "seq_ids")
    assert (cell.pos, cell.src, cell.seq_ids) == (1, cache.seq_cell(2), (2,))
    pos, src, holder, seq_ids = cell
    assert (pos, src, holder, seq_ids) == tuple(cell)


def test_holder_of_seq_belongs_to_the_sequence_of_that_index_not_to_the_cell(rc):
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=4)
    for _ in cache.init_batch(rc.Batch(token=[1], seq_id=[3])):
        pass
    held = cache.seq_cell(3)
    assert cache.cell(3).holder_of_seq == held            # entry 3 says where sequence 3 is ...
    assert cache.cell(held).seq_ids == (3,)
    if held != 3:
        assert cache.cell(held).holder_of_seq == -1        # ... whatever cell `held` itself holds


def test_seq_cell_and_seq_row_agree_with_a_scan_after_random_operations(rc):
    rng = random.Random(4)
    cache = rc.RecurrentCache(1, 2, 2, n_seq_max=6)
    for _ in range(200):
        seq, other = rng.randrange(6), rng.randrange(6)
        roll = rng.random()
        if roll < 0.5:
            for _ in cache.init_batch(rc.Batch(token=[1], seq_id=[seq], pos=[cache.seq_pos_max(seq) + 1])):
                pass
        elif roll < 0.7:
            cache.seq_cp(seq, other)
        elif roll < 0.85:
            cache.seq_rm(seq)
        else:
            cache.seq_keep(seq)
        for q in range(6):
            cell, src = scan(cache, q)
            assert cache.seq_cell(q) == cell
            assert cache.seq_row(q) == src
