"""The KV cell table on hand-built scripts, both engines: llama.cpp's rules worked out by hand
(docs/hybrid.md), the mask against a brute force of its definition, and refusals that change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from recurrent_cache import errors as E
from kv_tables import ENGINES, snapshot


@pytest.fixture(params=sorted(ENGINES))
def table_class(request):
    return ENGINES[request.param]


# -- placement -------------------------------------------------------------------------------------------

def test_the_search_restarts_at_cell_0_when_head_lies_past_twice_the_ubatch_of_free_room(table_class):
    table = table_class(40, 2)
    table.apply([35], [0], [0])                      # head 36, one cell used
    assert table.head == 36
    # 36 > 1 + 2 * 17: the search starts at cell 0
    assert table.find_slot(list(range(1, 18)), [0] * 17).tolist() == list(range(17))
    # 36 > 1 + 2 * 18 does not hold: from head, wrapping around
    assert table.find_slot(list(range(1, 19)), [0] * 18).tolist() == [36, 37, 38, 39] + list(range(14))


@pytest.mark.parametrize(("taken", "n_tokens", "restarts"), [
    ([0, 35], 16, True),     # head 36 > 2 + 2 * 16
    ([0, 35], 17, False),    # head 36 = 2 + 2 * 17: not past it
    ([35], 17, True),        # head 36 = 1 + 2 * 17 + 1: one past it
    ([35], 18, False),
])
def test_the_search_restarts_exactly_when_head_lies_past_used_plus_twice_the_ubatch(table_class, taken, n_tokens,
                                                                                     restarts):
    table = table_class(40, 2)
    table.apply(taken, list(range(len(taken))), [1] * len(taken))
    assert table.head == 36
    free = [cell for cell in range(40) if cell not in taken]
    start = 0 if restarts else table.head
    in_search_order = [cell for cell in free if cell >= start] + [cell for cell in free if cell < start]
    assert table.find_slot(list(range(n_tokens)), [0] * n_tokens).tolist() == in_search_order[:n_tokens]


def test_continuous_slots_skip_a_run_that_a_used_cell_breaks(table_class):
    table = table_class(8, 2)
    table.apply([2], [0], [1])                       # cell 2 taken, head 3
    table.seq_rm(1, -1, -1)
    table.apply([2], [0], [1])
    table.seq_add(1, -1, -1, 0)                      # no shift: nothing happens, head stays
    assert table.head == 3
    assert table.find_slot([0, 1, 2], [0, 0, 0], cont=True).tolist() == [3, 4, 5]
    assert table.find_slot([0] * 6, [[0]] * 6, cont=True) is None   # 6 in a row exist nowhere
    assert table.find_slot([0] * 6, [[0]] * 6).tolist() == [3, 4, 5, 6, 7, 0]


def test_a_sliding_window_reuses_cells_its_sequence_no_longer_sees_and_purges_older_positions(table_class):
    table = table_class(4, 1, 2, "standard")
    table.apply([3, 2, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0])
    assert table.head == 2
    # cell 2 (position 1) is out of the window of a token at 4; taking it purges position 0 too
    assert table.place([4], [0]).tolist() == [2]
    assert table.cells() == [(2, (0,)), (3, (0,)), (4, (0,)), None]
    assert table.head == 3 and table.seq_pos_min(0) == 2


def test_a_cell_just_outside_the_window_is_reused_and_one_just_inside_is_not(table_class):
    table = table_class(4, 1, 2, "standard")
    table.apply([2, 0, 1, 3], [0, 3, 2, 1], [0, 0, 0, 0])   # head 4: the search wraps to cell 0
    # the next token, at 4, sees position 3 (cell 0) but not 2 (cell 1: 4 - 2 >= n_swa), the first it may take
    assert table.find_slot([4], [0]).tolist() == [1]


def test_reusing_a_window_cell_purges_every_position_up_to_it_including_a_second_copy(table_class):
    table = table_class(5, 2, 2, "standard")
    table.apply([2, 3, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0])
    table.apply([4], [2], [1])
    table.seq_cp(1, 0)
    table.seq_rm(1)                                   # sequence 0 holds position 2 twice: cells 0 and 4
    assert table.place([4], [0]).tolist() == [0]      # search wraps to 0: position 2 is outside the window
    # the purge removes [0, 2 + 1): cells 2, 3 and the other copy of position 2, cell 4
    assert table.cells() == [(4, (0,)), (3, (0,)), None, None, None]
    assert table.seq_pos_min(0) == 3 and table.used == 2
    table.check()


def test_shared_cells_partial_removal_keep_and_shift(table_class):
    table = table_class(8, 3)
    table.place([0, 1, 2, 3], [0, 0, 0, 0])
    table.seq_cp(0, 1, 1, 3)                         # seq 1 shares positions 1 and 2
    assert table.cells()[:4] == [(0, (0,)), (1, (0, 1)), (2, (0, 1)), (3, (0,))]
    table.seq_rm(0, 2, -1)                           # cell 2 stays for seq 1, cell 3 is freed
    assert table.cells()[:4] == [(0, (0,)), (1, (0, 1)), (2, (1,)), None] and table.head == 3
    table.seq_add(1, 0, -1, -2)                      # position 1 drops below 0: seq 1 leaves cell 1 ...
    assert table.cells()[:4] == [(0, (0,)), None, (0, (1,)), None]   # ... which moved for seq 0 too
    assert table.has_shift and table.shifts()[:3].tolist() == [0, 0, -2] and table.head == 1
    table.seq_keep(1)
    assert table.cells()[:3] == [None, None, (0, (1,))] and table.head == 0
    table.reset_shift()
    assert not table.has_shift and not table.shifts().any()


def test_seq_div_rounds_positions_down_and_records_the_shift(table_class):
    table = table_class(8, 1)
    table.place([0, 1, 2, 3, 4, 5], [0] * 6)
    table.seq_div(0, 2, 6, 2)
    assert [cell[0] for cell in table.cells()[:6]] == [0, 1, 1, 1, 2, 2]
    # the shift is how far each position moved (llama.cpp records old - new: [0, 0, 1, 2, 2, 3])
    assert table.shifts()[:6].tolist() == [0, 0, -1, -2, -2, -3] and table.seq_pos_max(0) == 2


# -- the mask --------------------------------------------------------------------------------------------

def visible(cell, seq, p1, n_swa, swa_type):
    """The definition, written out once more: the cell holds seq at p0 <= p1, inside the window."""
    if cell is None or seq not in cell[1] or cell[0] > p1:
        return False
    p0 = cell[0]
    return {"none": True, "standard": p1 - p0 < n_swa, "chunked": p0 >= p1 // max(n_swa, 1) * n_swa,
            "symmetric": p1 - p0 <= n_swa // 2}[swa_type]


@pytest.mark.parametrize("window", [("none", 0), ("standard", 3), ("chunked", 4), ("symmetric", 5)])
def test_the_mask_is_its_definition_on_random_tables(table_class, window):
    swa_type, n_swa = window
    rng = np.random.default_rng(sum(map(ord, swa_type)))
    for _ in range(30):
        table = table_class(int(rng.integers(1, 70)), 4, n_swa, swa_type)
        for _ in range(int(rng.integers(1, 12))):
            seqs = rng.integers(0, 4, int(rng.integers(1, 6))).tolist()
            table.place([table.seq_pos_max(s) + 1 + int(rng.integers(0, 2)) for s in seqs], seqs)
            if rng.integers(0, 4) == 0:
                table.seq_cp(int(rng.integers(0, 4)), int(rng.integers(0, 4)))
        seqs = rng.integers(0, 4, int(rng.integers(1, 9))).tolist()
        pos = rng.integers(0, 30, len(seqs)).tolist()
        for sliding in (True, False):
            n_kv = int(rng.integers(1, table.size + 1))
            out = np.full((len(seqs), n_kv), 3.0, np.float32)
            table.mask(pos, seqs, out, sliding)
            cells = table.cells()
            want = [[0.0 if visible(cells[j], s, p, n_swa, swa_type if sliding else "none") else -np.inf
                     for j in range(n_kv)] for s, p in zip(seqs, pos)]
            assert np.array_equal(out, np.asarray(want, np.float32))


def test_the_mask_of_a_worked_example(table_class):
    table = table_class(8, 2, 2, "chunked")
    table.place([0, 1, 2, 3, 0, 1], [0, 0, 0, 0, [1, 0], 1])
    out = np.zeros((2, 8), np.float32)
    table.mask([3, 1], [0, 1], out)
    x = -np.inf
    # seq 0 at 3 sees its chunk [2, 4): cells 2 and 3; seq 1 at 1 sees chunk [0, 2): cells 4 and 5
    assert out.tolist() == [[x, x, 0, 0, x, x, x, x], [x, x, x, x, 0, 0, x, x]]
    assert table.n_kv() == 8 and table.n_kv(4) == 8 and table.n_kv(1) == 6


@pytest.mark.parametrize("out", [np.zeros((2, 4), np.float64), np.zeros((3, 4), np.float32),
                                 np.zeros((2, 9), np.float32), np.zeros((2, 8), np.float32)[:, ::2],
                                 np.zeros((2, 0), np.float32)])
def test_a_mask_array_of_the_wrong_kind_is_refused(table_class, out):
    table = table_class(8, 1)
    with pytest.raises(E.ArgumentError):
        table.mask([0, 1], [0, 0], out)


# -- refusals change nothing -----------------------------------------------------------------------------

def test_a_ubatch_that_fits_nowhere_is_refused_with_nothing_changed(table_class):
    table = table_class(6, 2)
    table.place([0, 1, 2, 3], [0, 0, 1, 1])
    before = snapshot(table)
    assert table.find_slot([4, 5, 6], [0, 0, 0]) is None
    assert table.place([4, 5, 6], [0, 0, 0]) is None
    assert table.place(list(range(7)), [1] * 7) is None       # more tokens than cells
    assert snapshot(table) == before


BAD_CALLS = [
    ("place", ([0, 1], [0, 2]), E.SeqIdError, "seq_id 2"),
    ("place", ([0, -1], [0, 0]), E.PositionError, "position -1"),
    ("place", ([2**31 - 1], [0]), E.PositionError, "2147483647"),
    ("place", ([0], [[1, 1]]), E.BatchError, "seq_id 1 twice"),
    ("place", ([0, 1], [[0], []]), E.BatchError, "token 1 has no seq id"),
    ("place", ([], []), E.BatchError, "at least one"),
    ("place", ([0, 1], [0]), E.BatchError, "2 positions"),
    ("find_slot", ([0], [-1]), E.SeqIdError, "seq_id -1"),
    ("apply", ([9], [5], [0]), E.OutOfRangeError, "cell index 9"),
    ("apply", ([4, 4], [5, 6], [0, 0]), E.ArgumentError, "cell 4"),
    ("apply", ([0], [5], [0]), E.ArgumentError, "cell 0"),                # cell 0 is shared by seqs 0 and 1
    ("apply", ([4], [5, 6], [0, 0]), E.BatchError, "1 cells for 2 tokens"),
    ("seq_rm", (2, 0, -1), E.SeqIdError, "seq_id 2"),
    ("seq_rm", (-2, 0, -1), E.SeqIdError, "seq_id -2"),
    ("seq_rm", (0, 2**31, -1), E.ArgumentError, "p0 = 2147483648"),
    ("seq_cp", (0, 5), E.SeqIdError, "seq_id 5"),
    ("seq_keep", (7,), E.SeqIdError, "seq_id 7"),
    ("seq_add", (0, 0, -1, 2**31 - 2), E.PositionError, "2**31 - 1"),
    ("seq_add", (0, 0, -1, 2**31), E.ArgumentError, "delta"),
    ("seq_div", (0, 0, -1, 0), E.ArgumentError, "d must be >= 1, got 0"),
    ("seq_pos_max", (3,), E.SeqIdError, "seq_id 3"),
    ("seq_pos_min", (1.5,), E.ArgumentError, "seq_id must be an integer"),
    ("cell", (8,), E.OutOfRangeError, "cell index 8"),
]


@pytest.mark.parametrize(("name", "args", "error", "names"), BAD_CALLS, ids=[f"{c[0]}-{c[3]}" for c in BAD_CALLS])
def test_a_bad_argument_is_refused_by_name_with_nothing_changed(table_class, name, args, error, names):
    table = table_class(8, 2)
    table.place([0, 1, 2, 3], [[0, 1], 0, 0, 1])
    table.seq_add(1, 3, 4, 1)                        # a pending shift, which a refusal must keep too
    before = snapshot(table)
    with pytest.raises(error, match=None) as raised:
        getattr(table, name)(*args)
    assert names in str(raised.value)
    assert snapshot(table) == before
    table.check()


@pytest.mark.parametrize(("size", "n_seq_max", "n_swa", "swa_type"),
                         [(0, 1, 0, "none"), (4, 0, 0, "none"), (4, 257, 0, "none"), (4, 1, 0, "sliding"),
                          (4, 1, 0, "standard"), (4, 1, -3, "chunked")])
def test_a_table_llamacpp_could_not_hold_is_refused(table_class, size, n_seq_max, n_swa, swa_type):
    with pytest.raises(E.ConfigError):
        table_class(size, n_seq_max, n_swa, swa_type)


@pytest.mark.parametrize(("flat", "offsets"), [([0, 1], [0, 2, 1, 2]), ([0, 1], [0, 0, 1, 2]), ([0], [0, 1, 1, 1]),
                                               ([0, 1, 1], [0, 1, 2, 2]), ([0, 1, 0], [0, 1, 2])])
def test_place_arrays_refuses_offsets_that_would_read_outside_the_ids(flat, offsets):
    """Every token needs an id and no read may leave ``flat``: the compiled table reads them in C."""
    table = ENGINES["compiled"](8, 2)
    before = snapshot(table)
    with pytest.raises(E.BatchError):
        table.place_arrays(np.zeros(3, np.int32), np.asarray(flat, np.int32), np.asarray(offsets, np.int32))
    assert snapshot(table) == before
