"""``seq_add`` / ``seq_div`` on a hybrid memory: both halves still end each sequence at one position, or
the call is refused having changed nothing.

The KV half moves every cell of the sequence in ``[p0, p1)``; the recurrent half moves the sequence's
state only when its position lies in the range.  A range that stops below the last position and pushes
a cell past it, or that moves the last position below one left behind, would part the halves — and a
fork shares both its KV cells and its state, so its halves part when the other sequence's move does.
A brute-force model of the two halves' cells (``moved``) says what each call must do: random histories
with forks and tokens of several sequences, random ranges, shifts and divisors, both engines, and after
every call either it succeeded, ``check()`` passes and the cells are the model's, or it raised
``ArgumentError`` naming the first sequence that would part and its two positions, with every cell,
K / V / r / s row and the rollback reach exactly as before.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, given, settings

from recurrent_cache import Batch
from recurrent_cache.errors import POS_MAX, ArgumentError, PositionError
from recurrent_cache.hybrid import HybridCache

from hybrid_model import Histories, decode, same, snapshot, write

N_SEQ = 3
Cells = list[Any]


def make(engine: str, n_rollback: int, attention: bool) -> HybridCache:
    return HybridCache(3, attn_layers=[1] if attention else [], recr_layers=[0, 2], n_embd_k=2, n_embd_v=2,
                       n_embd_r=2, n_embd_s=2, kv_size=48, n_seq_max=N_SEQ, dtype_k="f32", dtype_v="f32",
                       n_rollback=n_rollback, engine=engine)


def halves(cache: HybridCache) -> tuple[Cells, Cells]:
    """The KV cells ``(pos, seq ids)`` or None, and the recurrent cells ``(pos, seq ids)``."""
    return cache.kv_cells(), [(cell.pos, cell.seq_ids) for cell in map(cache.recurrent_cell, range(N_SEQ))]


def span(p0: int, p1: int) -> range:
    """The positions a range bound pair names (< 0: open)."""
    return range(max(p0, 0), POS_MAX if p1 < 0 else min(p1, POS_MAX))


def moved(kv: Cells, recurrent: Cells, seq: int, p0: int, p1: int, move: Any) -> tuple[Cells, Cells]:
    """Both halves' cells after moving ``seq``'s positions in [p0, p1), by brute force: the KV cells of
    ``seq`` in the range (a cell moved below 0 is freed), and the recurrent cell holding ``seq`` when its
    position is in the range (every sequence sharing a cell moves with it)."""
    def one(cell: Any) -> Any:
        if cell is None or seq not in cell[1] or cell[0] not in span(p0, p1):
            return cell
        return (move(cell[0]), cell[1])
    kv_after = [None if cell is not None and cell[0] < 0 else cell for cell in map(one, kv)]
    return kv_after, [one(cell) for cell in recurrent]


def last_positions(kv: Cells, recurrent: Cells) -> list[tuple[int, int]]:
    """Per sequence: its last KV position and its recurrent state's position (-1: none)."""
    return [(max((cell[0] for cell in kv if cell is not None and s in cell[1]), default=-1),
             next((pos for pos, seqs in recurrent if s in seqs), -1)) for s in range(N_SEQ)]


def reach(cache: HybridCache) -> tuple[list[int], bool]:
    """What ``snapshot`` leaves out: the rollback reach of each sequence, and whether a shift is pending."""
    return [cache.seq_rollback_min(s) for s in range(N_SEQ)], cache.kv_has_shift


def outcome(call: Any) -> tuple[str, Any]:
    try:
        call()
    except (ArgumentError, PositionError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", None


def apply_move(cache: HybridCache, op: str, seq: int, p0: int, p1: int, amount: int) -> tuple[str, Any]:
    """One move checked against the model; its outcome (the exception's type and message)."""
    move = (lambda pos: pos + amount) if op == "seq_add" else (lambda pos: pos // amount)
    kv, recurrent = halves(cache)
    kv_after, recurrent_after = moved(kv, recurrent, seq, p0, p1, move)
    before_positions, after_positions = last_positions(kv, recurrent), last_positions(kv_after, recurrent_after)
    before, before_reach = snapshot(cache), reach(cache)
    result = outcome(lambda: getattr(cache, op)(seq, p0, p1, amount))
    state = next((pos for pos, seqs in recurrent if seq in seqs), -1)
    if state in span(p0, p1) and move(state) < 0:   # the recurrent state's own refusal comes first
        assert result[0] == "PositionError", result
    else:
        parted = [s for s in range(N_SEQ) if cache.attn_layers and before_positions[s][0] == before_positions[s][1]
                  and after_positions[s][0] != after_positions[s][1]]
        if parted:
            s = parted[0]
            kv_last, state = after_positions[s]
            assert result == ("ArgumentError", f"{op}: [{p0}, {p1}) of sequence {seq} would leave sequence {s}'s KV "
                              f"cells ending at position {kv_last} but its recurrent state at {state}: a hybrid "
                              "sequence's KV cells and recurrent state end at one position"), result
        else:
            assert result == ("ok", None), result
    if result[0] != "ok":
        assert same(before, snapshot(cache)) and reach(cache) == before_reach, "a refused move changed the memory"
    else:
        assert halves(cache) == (kv_after, recurrent_after)
        cache.check()
    return result


def step(draw: Any, caches: list[HybridCache], histories: list[Histories], token: list[int]) -> None:
    kind = draw(st.sampled_from(["decode", "decode", "fork", "shared tokens", "move", "move", "move"]))
    if kind == "decode":
        seqs = draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ, unique=True))
        tokens = {seq: [token[0] + k for k in range(draw(st.integers(1, 6)))] for seq in seqs}
        token[0] += 10
        for cache, history in zip(caches, histories):
            decode(cache, history, tokens)
    elif kind == "fork":
        src, dst = draw(st.integers(0, N_SEQ - 1)), draw(st.integers(0, N_SEQ - 1))
        for cache, history in zip(caches, histories):
            cache.seq_rm(dst, -1, -1)
            history.forget(dst)
            cache.seq_cp(src, dst)
            history.copy(src, dst)
    elif kind == "shared tokens":   # a prompt of several sequences: one KV cell and one recurrent cell for all
        seqs = draw(st.lists(st.integers(0, N_SEQ - 1), min_size=2, max_size=N_SEQ, unique=True))
        n = draw(st.integers(1, 3))
        for cache, history in zip(caches, histories):
            for seq in seqs:
                cache.seq_rm(seq, -1, -1)
                history.forget(seq)
            state = cache.init_batch(Batch(token=list(range(token[0], token[0] + n)), seq_id=[seqs] * n))
            for ub in state:
                write(cache, state, ub, history)
        token[0] += 10
    else:
        op = draw(st.sampled_from(["seq_add", "seq_div"]))
        held = [s for s in range(N_SEQ) if caches[0].seq_pos_max(s) >= 0]
        seq = draw(st.sampled_from(held or [0]))
        last = max(caches[0].seq_pos_max(seq), 0)
        p0, p1 = draw(st.one_of(st.tuples(st.integers(-1, last + 1), st.integers(-1, last + 2)),   # any
                                st.tuples(st.integers(-1, last), st.integers(0, last)),   # ending below the last
                                st.tuples(st.integers(1, last + 1), st.just(-1))))   # leaving positions below
        amount = draw(st.integers(-6, 8) if op == "seq_add" else st.integers(1, 5))
        results = [apply_move(cache, op, seq, p0, p1, amount) for cache in caches]
        assert results[0] == results[1], results
        event(f"{op}: {results[0][0]}")
        for cache in caches:
            cache.kv_reset_shift()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n_rollback=st.sampled_from([0, 2]), attention=st.sampled_from([True, True, False]))
def test_a_move_keeps_the_halves_agreeing_or_changes_nothing(data, n_rollback, attention):
    caches = [make(engine, n_rollback, attention) for engine in ("compiled", "reference")]
    histories = [Histories(N_SEQ), Histories(N_SEQ)]
    token = [1]
    for _ in range(data.draw(st.integers(2, 14))):
        step(data.draw, caches, histories, token)
    assert same(snapshot(caches[0]), snapshot(caches[1]))
