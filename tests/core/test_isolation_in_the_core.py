"""Where the surfaces meet the one memory core: no sequence ever gets another sequence's state.

Each test here reproduces a seam defect of issue 17 (they failed before the core owned the
cells, rows, history and change counter alone): a restored sequence inheriting the previous
occupant's rollback history, step states filed late over a newcomer placed through C, a
``restore_rows`` that raised half-way, ``rc_ctx_new(NULL)``, and two change counters.  The
model's states are functions of the sequence and position (``state_value``), so a test knows
which state every sequence must hold.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache
from recurrent_cache.stores import restore_rows

from capi_table import P, Ubatch, ints, table

N_ROLLBACK = 4
N_LAYER, N_EMBD_R, N_EMBD_S = 2, 3, 5


def state_value(seq: int, pos: int, k: int) -> float:
    """The value every entry of tensor k holds after sequence seq's token at pos (a made-up model)."""
    return 1000.0 * (seq + 1) + 10.0 * pos + k


def make(engine: str) -> recurrent_cache.RecurrentCache:
    return recurrent_cache.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=4, n_rollback=N_ROLLBACK,
                                          engine=engine)


def decode_python(cache: recurrent_cache.RecurrentCache, seq: int, first: int, n: int) -> None:
    """Tokens first .. first + n - 1 of seq in one ubatch, the model writing every state it promises."""
    st = cache.init_batch(recurrent_cache.Batch(token=[0] * n, seq_id=[seq] * n, pos=list(range(first, first + n))))
    for ub in st:
        last = int(ub.pos[-1])
        for il in range(N_LAYER):
            for k, rows, steps in ((il, st.r(il), st.r_steps(il)), (N_LAYER + il, st.s(il), st.s_steps(il))):
                m = steps.shape[1]
                for j in range(m):
                    steps[0, j] = state_value(seq, last - m + j, k)
                rows[0] = state_value(seq, last, k)


def cell_of(cache: recurrent_cache.RecurrentCache, seq: int) -> int:
    """The cell holding seq, or -1 (read through ``cell``, as every version of the API reads it)."""
    return cache.cell(seq)[2]


def state_of(cache: recurrent_cache.RecurrentCache, seq: int) -> list[np.ndarray]:
    """seq's rows, r then s (the cell's src row: where its data lives)."""
    src = cache.cell(cell_of(cache, seq))[1]
    return [t[src] for t in cache.r + cache.s]


def holds(cache: recurrent_cache.RecurrentCache, seq: int, pos: int, owner: int | None = None) -> bool:
    """Whether seq's rows are exactly the model's state of `owner` (default: seq) after pos."""
    owner = seq if owner is None else owner
    return all(np.all(row == state_value(owner, pos, k)) for k, row in enumerate(state_of(cache, seq)))


def filled(cache: recurrent_cache.RecurrentCache, seq: int, pos: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    r_rows = [np.full(N_EMBD_R, state_value(seq, pos, il), np.float32) for il in range(N_LAYER)]
    s_rows = [np.full(N_EMBD_S, state_value(seq, pos, N_LAYER + il), np.float32) for il in range(N_LAYER)]
    return r_rows, s_rows


def frees_a_cell_with_history(cache: recurrent_cache.RecurrentCache) -> int:
    """Sequence 0 decodes 10 tokens (history of states after 5..8 in its cell), then leaves; its cell."""
    decode_python(cache, 0, 0, 10)
    cell = cell_of(cache, 0)
    assert cache.seq_rollback_min(0) == 10 - 1 - N_ROLLBACK
    assert cache.seq_rm(0, -1, -1)
    return cell


# -- 1. a restored sequence starts with no history --------------------------------------------

RESTORES = {
    "seq_restore": lambda cache, seq, pos, rows: cache.seq_restore(seq, pos, *rows),
    "restore_rows": lambda cache, seq, pos, rows: restore_rows(cache, seq, pos + 1, *rows),
}


@pytest.mark.parametrize("engine", ["compiled", "reference"])
@pytest.mark.parametrize("how", sorted(RESTORES))
def test_a_restored_sequence_has_no_rollback_history_of_the_cells_previous_occupant(engine, how):
    cache = make(engine)
    cell = frees_a_cell_with_history(cache)
    assert RESTORES[how](cache, 1, 9, filled(cache, 1, 9)) == cell == cell_of(cache, 1)
    assert holds(cache, 1, 9)
    assert cache.seq_rollback_min(1) == -1
    assert not cache.seq_rm(1, 7, -1)   # no state after 6 of sequence 1 is held: nothing to roll back to
    assert holds(cache, 1, 9)
    cache.check()


@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_a_prefix_cache_restore_has_no_rollback_history_of_the_cells_previous_occupant(engine):
    cache = make(engine)
    prefix = recurrent_cache.PrefixCache(cache, 1 << 16, block_size=4)
    tokens = np.arange(12, dtype=np.int32)
    decode_python(cache, 2, 0, 8)
    assert prefix.save(2, tokens[:8])
    assert cache.seq_rm(2, -1, -1)
    cell = frees_a_cell_with_history(cache)
    assert prefix.restore(1, tokens) == 8 and cell_of(cache, 1) == cell
    assert holds(cache, 1, 7, owner=2)
    assert cache.seq_rollback_min(1) == -1
    assert not cache.seq_rm(1, 5, -1)
    cache.check()


# -- 3. every public call is all-or-nothing -----------------------------------------------------

@pytest.mark.parametrize("engine", ["compiled", "reference"])
@pytest.mark.parametrize("defect", ["second layer too wide", "second layer float64", "one layer missing"])
def test_restore_rows_that_do_not_fit_change_nothing(engine, defect):
    cache = make(engine)
    decode_python(cache, 0, 0, 3)
    cache.seq_rm(0, -1, -1)   # a free cell whose rows still hold something
    before = [t.copy() for t in cache.r + cache.s], [cache.cell(i) for i in range(cache.size)]
    reach_before = [cache.seq_rollback_min(seq) for seq in range(cache.size)]
    r_rows, s_rows = filled(cache, 1, 4)
    if defect == "second layer too wide":
        s_rows[1] = np.zeros(N_EMBD_S + 1, np.float32)
    elif defect == "second layer float64":
        s_rows[1] = s_rows[1].astype(np.float64)
    else:
        s_rows = s_rows[:1]
    with pytest.raises(recurrent_cache.ArgumentError, match="s_rows"):
        restore_rows(cache, 1, 5, r_rows, s_rows)
    assert [t.tobytes() for t in cache.r + cache.s] == [t.tobytes() for t in before[0]]
    assert [cache.cell(i) for i in range(cache.size)] == before[1]
    assert [cache.seq_rollback_min(seq) for seq in range(cache.size)] == reach_before
    assert cell_of(cache, 1) == -1


# -- the C API meets the Python API (compiled engine) --------------------------------------------

T = table()


def c_decode(ctx, seq: int, first: int, n: int) -> int:
    """Tokens first .. first + n - 1 of seq through the C API, the model writing its step states;
    returns the code of the last rc_batch_apply (1: applied)."""
    batch = P()
    code = T.batch_init(ctx, n, ints([seq] * n), None, ints(list(range(first, first + n))), None, 512, 0,
                        ctypes.byref(batch))
    assert code == 0, code
    ub = Ubatch()
    try:
        code = T.batch_apply(batch, ctypes.byref(ub))
        m = T.batch_n_steps(batch)
        for k in range(2 * N_LAYER):
            data, row_bytes = P(), ctypes.c_size_t()
            assert T.tensor(ctx, k, ctypes.byref(data), ctypes.byref(row_bytes)) == 0
            width = row_bytes.value // 4
            for j in range(m):
                row = P()
                assert T.batch_step_row(batch, k, 0, j, ctypes.byref(row)) == 0
                values = np.full(width, state_value(seq, first + n - 1 - m + j, k), np.float32)
                ctypes.memmove(row, values.ctypes.data, row_bytes.value)
            values = np.full(width, state_value(seq, first + n - 1, k), np.float32)
            ctypes.memmove(data.value + ub.head * row_bytes.value, values.ctypes.data, row_bytes.value)
        return code
    finally:
        T.batch_release(batch)


@pytest.fixture
def compiled():
    cache = make("compiled")
    ctx = T.ctx_new(cache)
    yield cache, ctx
    assert T.ctx_free(ctx) == 0


def test_step_states_of_a_python_ubatch_are_filed_before_c_calls_change_the_cells(compiled):
    """Python applies a ubatch (its step states pending); C drops the sequence and places another
    in the same cell: the newcomer's history is its own, never the dropped sequence's."""
    cache, ctx = compiled
    decode_python(cache, 0, 0, 8)            # step states after 3..6 written, not yet filed
    cell = cell_of(cache, 0)
    assert T.seq_rm(ctx, 0, -1, -1) == 1
    assert c_decode(ctx, 1, 0, 6) == 1       # seq 1 in the freed cell, step states after 1..4
    assert cell_of(cache, 1) == cell
    assert cache.seq_rollback_min(1) == 1
    for q in (4, 3, 2, 1):
        assert cache.seq_rm(1, q + 1, -1) and holds(cache, 1, q), q
    cache.check()


def test_a_python_memory_state_goes_stale_when_the_c_api_changes_the_cache(compiled):
    cache, ctx = compiled
    decode_python(cache, 0, 0, 2)
    st = cache.init_batch(recurrent_cache.Batch(token=[0], seq_id=[0], pos=[2]))
    assert T.seq_cp(ctx, 0, 1) == 0
    with pytest.raises(recurrent_cache.UsageError, match="changed"):
        st.apply()
    st = cache.init_batch(recurrent_cache.Batch(token=[0], seq_id=[0], pos=[2]))
    st.apply()
    assert T.seq_rm(ctx, 1, -1, -1) == 1
    with pytest.raises(recurrent_cache.UsageError, match="changed"):
        st.r(0)


def test_a_c_batch_goes_stale_when_the_python_api_changes_the_cache(compiled):
    cache, ctx = compiled
    decode_python(cache, 0, 0, 2)
    batch = P()
    assert T.batch_init(ctx, 1, ints([0]), None, ints([2]), None, 512, 0, ctypes.byref(batch)) == 0
    try:
        cache.seq_cp(0, 1)
        assert T.batch_apply(batch, ctypes.byref(Ubatch())) == recurrent_cache.errors.CAPI_STALE
    finally:
        T.batch_release(batch)


def test_rc_ctx_new_of_null_raises_instead_of_crashing():
    script = f"""
import ctypes, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from capi_table import table
new = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(ctypes.cast(table().ctx_new, ctypes.c_void_p).value)
try:
    new(None)
except TypeError as exc:
    print("TypeError:", exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TypeError: rc_ctx_new takes a recurrent_cache.RecurrentCache, got NULL" in result.stdout


# -- the facade's calls for one sequence's state --------------------------------------------------

@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_seq_cell_state_and_restore_round_trip(engine):
    cache = make(engine)
    decode_python(cache, 0, 0, 3)
    cache.seq_cp(0, 2)
    assert cache.seq_cell(0) == cache.seq_cell(2) == cell_of(cache, 0) and cache.seq_cell(1) == -1
    r_rows, s_rows = cache.seq_state(2)
    assert [row.tolist() for row in r_rows + s_rows] == [row.tolist() for row in state_of(cache, 0)]
    r_rows[0][...] = -1   # copies: the cache is untouched
    assert holds(cache, 0, 2)
    assert cache.seq_restore(1, 2, *cache.seq_state(0)) == cache.seq_cell(1) != cache.seq_cell(0)
    assert [row.tobytes() for row in state_of(cache, 1)] == [row.tobytes() for row in state_of(cache, 0)]
    with pytest.raises(recurrent_cache.ArgumentError, match="holds no cell"):
        cache.seq_state(3)
    with pytest.raises(recurrent_cache.ArgumentError, match="already holds a cell"):
        cache.seq_restore(1, 2, *cache.seq_state(0))
    with pytest.raises(recurrent_cache.SeqIdError):
        cache.seq_cell(cache.size)
    cache.check()



# -- random interleavings of the two APIs on one cache -------------------------------------------

def python_step(cache: recurrent_cache.RecurrentCache, seqs: list[int], n: int) -> None:
    """n tokens for each of seqs at their next positions through the Python API (the model
    writes every state it promises)."""
    seq_ids = [seq for seq in seqs for _ in range(n)]
    pos = [cache.seq_pos_max(seq) + 1 + t for seq in seqs for t in range(n)]
    st = cache.init_batch(recurrent_cache.Batch(token=[0] * len(pos), seq_id=seq_ids, pos=pos))
    for ub in st:
        last = ub.pos.reshape(ub.n_seqs, ub.n_seq_tokens)[:, -1]
        for g, seq in enumerate(ub.seq_owner.tolist()):
            for il in range(N_LAYER):
                for k, rows, steps in ((il, st.r(il), st.r_steps(il)), (N_LAYER + il, st.s(il), st.s_steps(il))):
                    m = steps.shape[1]
                    for j in range(m):
                        steps[g, j] = state_value(seq, int(last[g]) - m + j, k)
                    rows[g] = state_value(seq, int(last[g]), k)


def c_step(cache: recurrent_cache.RecurrentCache, ctx, seqs: list[int], n: int) -> None:
    """The same step through the C API."""
    seq_ids = [seq for seq in seqs for _ in range(n)]
    pos = [cache.seq_pos_max(seq) + 1 + t for seq in seqs for t in range(n)]
    batch = P()
    assert T.batch_init(ctx, len(pos), ints(seq_ids), None, ints(pos), None, 512, 0, ctypes.byref(batch)) == 0
    ub = Ubatch()
    try:
        while T.batch_apply(batch, ctypes.byref(ub)) == 1:
            m = T.batch_n_steps(batch)
            for g in range(ub.n_seqs):
                token = ub.token_order[g * ub.n_seq_tokens + ub.n_seq_tokens - 1]
                seq, last = seq_ids[token], pos[token]
                for k in range(2 * N_LAYER):
                    data, row_bytes = P(), ctypes.c_size_t()
                    T.tensor(ctx, k, ctypes.byref(data), ctypes.byref(row_bytes))
                    width = row_bytes.value // 4
                    for j in range(m):
                        row = P()
                        assert T.batch_step_row(batch, k, g, j, ctypes.byref(row)) == 0
                        values = np.full(width, state_value(seq, last - m + j, k), np.float32)
                        ctypes.memmove(row, values.ctypes.data, row_bytes.value)
                    values = np.full(width, state_value(seq, last, k), np.float32)
                    ctypes.memmove(data.value + (ub.head + g) * row_bytes.value, values.ctypes.data, row_bytes.value)
    finally:
        T.batch_release(batch)


def every_state_is_of_its_position(cache: recurrent_cache.RecurrentCache) -> None:
    """Each sequence's rows are a state the model wrote after the sequence's own position."""
    for seq in range(cache.size):
        cell = cell_of(cache, seq)
        if cell < 0 or cache.cell(cell)[1] < 0:
            continue
        pos = cache.cell(cell)[0]
        for k, row in enumerate(state_of(cache, seq)):
            owner = (int(row[0]) - 10 * pos - k) // 1000 - 1
            assert np.all(row == state_value(owner, pos, k)), (seq, pos, k, row)


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_of_python_and_c_calls_match_the_reference(compiled, seed):
    """Random steps, removals, rollbacks, forks and state reads, each through Python or C at
    random, on one compiled cache; the same through Python on the reference engine."""
    cache, ctx = compiled
    reference = make("reference")
    rng = np.random.default_rng(seed)
    for step in range(60):
        op, seq, other = rng.choice(["step", "step", "remove", "rollback", "fork", "read"]), *rng.integers(0, 4, 2)
        seq, other, by_c = int(seq), int(other), bool(rng.integers(2))
        if op == "step":
            seqs = sorted({seq, other}) if rng.integers(2) else [seq]
            n = 1 if len(seqs) > 1 else int(rng.integers(1, 7))
            if by_c:
                c_step(cache, ctx, seqs, n)
            else:
                python_step(cache, seqs, n)
            python_step(reference, seqs, n)
        elif op == "remove":
            done = T.seq_rm(ctx, seq, -1, -1) == 1 if by_c else cache.seq_rm(seq, -1, -1)
            assert done == reference.seq_rm(seq, -1, -1)
        elif op == "rollback" and cache.seq_pos_max(seq) > 0:
            p0 = int(rng.integers(1, cache.seq_pos_max(seq) + 1))
            done = T.seq_rm(ctx, seq, p0, -1) == 1 if by_c else cache.seq_rm(seq, p0, -1)
            assert done == reference.seq_rm(seq, p0, -1), (step, seq, p0)
        elif op == "fork":
            assert (T.seq_cp(ctx, seq, other) == 0) if by_c else cache.seq_cp(seq, other) is None
            reference.seq_cp(seq, other)
        elif op == "read":
            blob = cache.state_write(seq)
            if by_c:
                assert T.state_read(ctx, other, blob, len(blob)) == 0
            else:
                cache.state_read(blob, other)
            reference.state_read(blob, other)
        every_state_is_of_its_position(cache)
        if rng.integers(2):   # the checks too go through either API
            reach = [T.seq_rollback_min(ctx, s) for s in range(4)]
            size, written = ctypes.c_size_t(), ctypes.c_size_t()
            assert T.state_size(ctx, -1, ctypes.byref(size)) == 0
            blob = ctypes.create_string_buffer(size.value)
            assert T.state_write(ctx, -1, blob, size.value, ctypes.byref(written)) == 0
            blob = blob.raw[:written.value]
        else:
            reach, blob = [cache.seq_rollback_min(s) for s in range(4)], cache.state_write()
        assert reach == [reference.seq_rollback_min(s) for s in range(4)], (step, op)
        assert blob == reference.state_write(), (step, op)
    cache.check()
