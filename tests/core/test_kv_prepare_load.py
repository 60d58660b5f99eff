"""The KV cell table's prepare, load and load_seq on hand-built scripts, both engines: the slots
llama.cpp's rules give (docs/hybrid.md, "Preparing and loading"), the table left exactly as it
was where it must be, and refusals that change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache import errors as E
from kv_tables import ENGINES, snapshot


@pytest.fixture(params=sorted(ENGINES))
def table_class(request):
    return ENGINES[request.param]


def ubatch(pos, seq):
    """One sequence's tokens in place_arrays's encoding."""
    n = len(pos)
    return np.asarray(pos, np.int32), np.full(n, seq, np.int32), np.arange(n + 1, dtype=np.int32)


def context(pos, seq_ids):
    """A whole context's cells in place_arrays's encoding (each cell lists its sequences)."""
    offsets = np.zeros(len(pos) + 1, np.int32)
    np.cumsum([len(ids) for ids in seq_ids], out=offsets[1:])
    return np.asarray(pos, np.int32), np.asarray([s for ids in seq_ids for s in ids], np.int32), offsets


# -- prepare -----------------------------------------------------------------------------------------------

def test_each_ubatch_is_placed_where_the_one_before_left_the_table_and_then_nothing_has_changed(table_class):
    table = table_class(8, 2)
    table.place([0, 1, 2], [0, 0, 0])
    table.seq_rm(0, 0, 1)                          # cell 0 free again, head 0
    before = snapshot(table)
    slots = table.prepare([ubatch([3, 4], 0), ubatch([5, 6, 7], 0), ubatch([0], 1)])
    # the second ubatch sees cells 0 and 3 taken by the first and goes on from head 4
    assert [slot.tolist() for slot in slots] == [[0, 3], [4, 5, 6], [7]]
    assert snapshot(table) == before


def test_no_slot_for_a_later_ubatch_gives_none_though_each_fits_alone(table_class):
    table = table_class(4, 1)
    before = snapshot(table)
    assert table.prepare([ubatch([0, 1, 2], 0)]) is not None
    assert table.prepare([ubatch([3, 4], 0)]) is not None
    assert table.prepare([ubatch([0, 1, 2], 0), ubatch([3, 4], 0)]) is None
    assert snapshot(table) == before


def test_the_sliding_window_purge_is_undone_too(table_class):
    """llama.cpp's prepare restores the slot cells and head but leaves the purge done; ours does not."""
    table = table_class(4, 1, 2, "standard")
    table.apply([3, 2, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0])
    before = snapshot(table)
    # position 4 reuses cell 2 (position 1): placing it would purge position 0 (cell 3) as well
    assert [slot.tolist() for slot in table.prepare([ubatch([4], 0)])] == [[2]]
    assert snapshot(table) == before
    assert table.cells() == [(2, (0,)), (3, (0,)), (1, (0,)), (0, (0,))]


@pytest.mark.parametrize("window", [("none", 0), ("standard", 3), ("chunked", 4)])
def test_applying_the_prepared_slots_gives_the_table_placing_each_ubatch_in_turn_gives(table_class, window):
    swa_type, n_swa = window
    prepared, placed = table_class(20, 3, n_swa, swa_type), table_class(20, 3, n_swa, swa_type)
    for table in (prepared, placed):
        table.place(list(range(7)), [0] * 7)
        table.place([0, 1, 2], [[1, 2]] * 3)
        table.seq_rm(0, 1, 3)
    ubatches = [ubatch([7, 8, 9], 0), ubatch([3, 4, 5, 6], 1), ubatch([10, 11], 0), ubatch([3], 2)]
    slots = prepared.prepare(ubatches)
    assert slots is not None
    for (pos, flat, _), slot in zip(ubatches, slots):
        prepared.apply(slot, pos, flat)
        assert placed.place(pos, flat).tolist() == slot.tolist()
    assert snapshot(prepared) == snapshot(placed)


@pytest.mark.parametrize(("ubatches", "kind", "words"), [
    ([], E.ArgumentError, "non-empty list"),
    ("not a list", E.ArgumentError, "non-empty list"),
    ([ubatch([5], 0), [1, 2, 3]], E.ArgumentError, "ubatch 1 must be a (pos, flat, offsets) tuple"),
    ([ubatch([5], 0), (np.asarray([6], np.int64), np.zeros(1, np.int32), np.arange(2, dtype=np.int32))],
     E.BatchError, "ubatch 1: pos must be a 1-D int32 numpy array"),
    ([ubatch([5], 0), (np.asarray([6, 7], np.int32), np.zeros(1, np.int32), np.asarray([0, 1, 1], np.int32))],
     E.BatchError, "ubatch 1: token 1 has no seq id"),
    ([ubatch([5], 0), ubatch([6, 7], 3)], E.SeqIdError, "seq_id 3 is out of range [0, 2)"),
    ([ubatch([5], 0), ubatch([6, 2**31 - 1], 1)], E.PositionError, "token 1 has position 2147483647"),
    ([ubatch([5], 0), context([6], [[1, 1]])], E.BatchError, "token 0 lists seq_id 1 twice"),
])
def test_a_bad_ubatch_anywhere_is_refused_before_any_is_placed(table_class, ubatches, kind, words):
    table = table_class(8, 2)
    table.place([0, 1, 2, 3, 4], [0] * 5)
    before = snapshot(table)
    with pytest.raises(kind) as refused:
        table.prepare(ubatches)
    assert words in str(refused.value)
    assert snapshot(table) == before


# -- load --------------------------------------------------------------------------------------------------

def test_load_replaces_every_cell_from_cell_0_with_head_0_and_no_shift(table_class):
    table = table_class(6, 3)
    table.place([0, 1, 2, 3], [0, 0, 1, 1])
    table.seq_add(1, -1, -1, 2)
    table.place([5], [2])
    assert table.has_shift and table.head != 0
    table.load(*context([7, 8, 0], [[0, 2], [0], [1]]))
    assert table.cells() == [(7, (0, 2)), (8, (0,)), (0, (1,)), None, None, None]
    assert (table.head, table.used, table.has_shift, table.shifts().tolist()) == (0, 3, False, [0] * 6)
    assert [(table.seq_pos_min(s), table.seq_pos_max(s)) for s in range(3)] == [(7, 8), (0, 0), (7, 7)]
    table.check()
    table.load(*context([], []))
    assert table.used == 0


@pytest.mark.parametrize(("cells", "kind", "words"), [
    (context(list(range(7)), [[0]] * 7), E.StateError, "load: 7 cells do not fit a table of 6"),
    (context([0, 1], [[0], [2]]), E.SeqIdError, "seq_id 2 is out of range [0, 2)"),
    (context([0, 1], [[0], [-1]]), E.SeqIdError, "seq_id -1 is out of range [0, 2)"),
    (context([0, 1], [[0], [1, 1]]), E.BatchError, "token 1 lists seq_id 1 twice"),
    ((np.asarray([0, 1], np.int32), np.asarray([0], np.int32), np.asarray([0, 1, 1], np.int32)), E.BatchError,
     "load: token 1 has no seq id"),
    (context([0, -1], [[0], [1]]), E.PositionError, "token 1 has position -1"),
    (context([2**31 - 1], [[0]]), E.PositionError, "token 0 has position 2147483647"),
    ((np.asarray([0], np.int32), np.asarray([0], np.int32), np.asarray([0, 2], np.int32)), E.BatchError,
     "load: offsets must be [n + 1], from 0 to len(flat)"),
])
def test_load_refuses_cells_a_table_cannot_hold_and_changes_nothing(table_class, cells, kind, words):
    table = table_class(6, 2)
    table.place([0, 1, 2], [1, 1, 1])
    table.seq_add(1, 1, -1, 3)
    before = snapshot(table)
    with pytest.raises(kind) as refused:
        table.load(*cells)
    assert words in str(refused.value)
    assert snapshot(table) == before


# -- load_seq ----------------------------------------------------------------------------------------------

def test_load_seq_removes_the_sequence_then_takes_the_first_free_cells_from_head(table_class):
    table = table_class(8, 2)
    table.place([0, 1, 2], [0, 0, 0])
    table.place([0, 1], [1, 1])                    # seq 1 at cells 3, 4; head 5
    # seq 0 leaves cells 0-2 (head drops to 0); its four cells are the first free ones from there
    assert table.load_seq(0, [10, 11, 12, 13]).tolist() == [0, 1, 2, 5]
    assert table.cells() == [(10, (0,)), (11, (0,)), (12, (0,)), (0, (1,)), (1, (1,)), (13, (0,)), None, None]
    assert table.head == 6


def test_load_seq_takes_positions_in_the_order_the_blob_lists_its_cells(table_class):
    """llama.cpp writes a sequence's cells in cell order, so after a wrap its positions are not
    increasing, and after a seq_rm inside the sequence they have gaps; it reads them back as they are."""
    table = table_class(8, 1)
    assert table.load_seq(0, [8, 9, 3, 4, 6]).tolist() == [0, 1, 2, 3, 4]
    assert (table.seq_pos_min(0), table.seq_pos_max(0)) == (3, 9)


def test_load_seq_with_no_slot_gives_none_and_the_sequence_keeps_its_old_cells(table_class):
    """llama.cpp removes the destination's cells first and leaves them removed when no slot exists."""
    table = table_class(4, 2)
    table.place([0, 1], [0, 0])
    table.place([0, 1], [1, 1])
    before = snapshot(table)
    assert table.load_seq(0, [5, 6, 7]) is None       # seq 0's two cells are all it could have
    assert table.load_seq(0, list(range(5))) is None  # more cells than the table has
    assert snapshot(table) == before
    assert table.load_seq(0, [5, 6]).tolist() == [0, 1]


def test_load_seq_of_no_cells_changes_nothing(table_class):
    """llama.cpp skips a stream with no cells: the destination keeps its cells."""
    table = table_class(4, 2)
    table.place([0, 1], [0, 0])
    before = snapshot(table)
    assert table.load_seq(0, []).tolist() == []
    assert snapshot(table) == before


@pytest.mark.parametrize(("seq", "pos", "kind", "words"), [
    (2, [0], E.SeqIdError, "seq_id 2 is out of range [0, 2)"),
    (-1, [0], E.SeqIdError, "seq_id -1 is out of range [0, 2)"),
    (0, [0, -1], E.PositionError, "token 1 has position -1"),
    (0, [2**31 - 1], E.PositionError, "token 0 has position 2147483647"),
    (0, [[0, 1]], E.BatchError, "load_seq: positions must be a 1-D integer array"),
    (0, [0.5], E.BatchError, "load_seq: positions must be a 1-D integer array"),
])
def test_load_seq_refuses_a_bad_sequence_or_position_and_changes_nothing(table_class, seq, pos, kind, words):
    table = table_class(4, 2)
    table.place([0, 1], [0, 0])
    before = snapshot(table)
    with pytest.raises(kind) as refused:
        table.load_seq(seq, pos)
    assert words in str(refused.value)
    assert snapshot(table) == before


def test_load_seq_under_a_sliding_window_purges_as_apply_does(table_class):
    table = table_class(4, 2, 2, "standard")
    table.place([0, 1, 2], [1, 1, 1])
    table.place([0], [0])                              # cell 3
    # seq 0 leaves cell 3; three cells: 3, then cells 0 and 1, which seq 1 (at 2) no longer sees
    assert table.load_seq(0, [4, 5, 6]).tolist() == [3, 0, 1]
    assert table.cells() == [(5, (0,)), (6, (0,)), (2, (1,)), (4, (0,))]
