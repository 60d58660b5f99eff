"""Lockstep: random scripts driven through the C API on one HybridCache and through the Python API on a
twin.  After every step both give the same result (return value, or a code whose message is the
Python exception's), and hold the same KV cells (positions, sequence sets, head, pending shifts),
the same recurrent cells, the same K, V, r and s rows, the same rollback reach and the same state
bytes.  A reference-engine twin holds the compiled engine's rule (``_hybrid_rule``, which the C API
and the compiled ``HybridCache`` share) equal to the reference engine's (``hybrid.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recurrent_cache import errors

from capi_hybrid import T, CHybrid, python_decode, same_decode, small_hybrid, state_bytes
from hybrid_model import same, snapshot

pytest.importorskip("recurrent_cache._capi")

CONFIGS = {
    "v_trans": dict(),
    "v_rows": dict(v_trans=False),
    "rollback": dict(n_rollback=3),
    "sliding": dict(n_swa=3, swa_type="standard", kv_size=12),
    "no_attention": dict(attn_layers=[], kv_size=4),
}
N_SEQ = 4
positions = st.integers(-2, 9)
# a bound next to a sequence's last position, ("last", k): where a partial range parts the halves
near_last = st.one_of(positions, st.tuples(st.just("last"), st.integers(-2, 1)))


def python_call(call: Any) -> Any:
    """The Python API's result, or its exception's message (the C API's message for the same refusal)."""
    try:
        result = call()
    except errors.RecurrentCacheError as exc:
        return ("refused", str(exc))
    return 0 if result is None else result if isinstance(result, bytes) else int(result)


def c_call(handle: CHybrid, code: int) -> Any:
    """A C entry's return code as python_call words it (a negative code: its message)."""
    return ("refused", handle.message(code)) if code < 0 else code


def c_position(handle: CHybrid, seq: int, value: int) -> Any:
    """A position the C API returns (seq_pos_min / max, seq_rollback_min) as python_call words it: -1
    means none, and for a seq id out of range also the refusal the Python API raises, whose message
    rc_error_message(RC_ERR_SEQ_RANGE) gives."""
    if value == -1 and not 0 <= seq < handle.cache.n_seq_max:
        return ("refused", handle.message(errors.SEQ_RANGE))
    return value


def run_step(op: tuple, in_c: CHybrid, python: Any, draw: Any) -> None:
    name, args = op[0], op[1:]
    ctx = in_c.ctx
    if name == "decode":
        seqs, lengths, starts, n_ubatch, token0 = args
        tokens, seq_ids, pos = [], [], []
        for seq, n, start in zip(seqs, lengths, starts):
            first = python.seq_pos_max(seq) + 1 if start is None else start
            for k in range(min(n, 2**31 - first)):   # positions C can pass (int32), past a shift to the end
                tokens.append(token0 + len(tokens))
                seq_ids.append(seq)
                pos.append(first + k)
        got = in_c.decode(tokens, seq_ids, pos, n_ubatch)
        expected = python_decode(python, tokens, seq_ids, pos, n_ubatch)
        assert same_decode(got, expected), (got, expected)
        return
    if name in ("state_read", "state_read_truncated"):
        source, target = args
        blob = python.state_write(source)
        if name == "state_read_truncated":
            blob = blob[:len(blob) // 2]
        buffer = bytes(blob)
        expected = python_call(lambda: python.state_read(buffer, target) and None)
        got = c_call(in_c, T.state_read(ctx, target, buffer, len(buffer)))
        assert got == expected, (got, expected)
        return
    if name == "state_write":
        expected = python_call(lambda: python.state_write(args[0]))
        got = state_bytes(in_c, args[0])
        assert got == (expected[1] if isinstance(expected, tuple) else expected), (got, expected)
        return
    if name in ("seq_cp", "seq_add", "seq_div"):   # a bound next to the (source) sequence's last position
        last = python.seq_pos_max(args[0]) if 0 <= args[0] < N_SEQ else -1
        args = tuple(last + arg[1] if isinstance(arg, tuple) else arg for arg in args)
    calls = {
        "seq_rm": (lambda: python.seq_rm(*args), lambda: T.seq_rm(ctx, *args)),
        "seq_cp": (lambda: python.seq_cp(*args), lambda: T.seq_cp_range(ctx, *args)),
        "seq_keep": (lambda: python.seq_keep(*args), lambda: T.seq_keep(ctx, *args)),
        "seq_add": (lambda: python.seq_add(*args), lambda: T.seq_add(ctx, *args)),
        "seq_div": (lambda: python.seq_div(*args), lambda: T.seq_div(ctx, *args)),
        "clear": (lambda: python.clear(), lambda: T.clear(ctx)),
        "kv_reset_shift": (lambda: python.kv_reset_shift(), lambda: T.kv_reset_shift(ctx)),
    }
    py, c = calls[name]
    expected = python_call(py)
    got = c_call(in_c, c())
    assert got == expected, (name, args, got, expected)


def ops(draw: Any) -> tuple:
    seq = st.integers(-1, N_SEQ)
    kind = draw(st.sampled_from(["decode"] * 6 + ["seq_rm"] * 3 + ["seq_cp", "seq_add", "seq_div"] * 2
                                + ["seq_keep", "clear", "state_read", "state_read_truncated", "state_write",
                                   "kv_reset_shift"]))
    if kind == "decode":
        seqs = draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=3, unique=True))
        lengths = [draw(st.integers(1, 3)) for _ in seqs]
        starts = [draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 6))) for _ in seqs]
        return kind, seqs, lengths, starts, draw(st.integers(1, 4)), draw(st.integers(1, 50))
    if kind == "seq_rm":
        return kind, draw(seq), draw(positions), draw(positions)
    if kind == "seq_cp":
        p1 = draw(near_last)
        return kind, draw(st.integers(-1, N_SEQ)), draw(st.integers(0, N_SEQ)), draw(st.integers(-1, 2)), p1
    if kind == "seq_keep":
        return kind, draw(st.integers(0, N_SEQ))
    if kind == "seq_add":
        return kind, draw(seq), draw(near_last), draw(near_last), draw(st.sampled_from([-3, -1, 0, 2, 5, 2**31 - 3]))
    if kind == "seq_div":
        return kind, draw(seq), draw(near_last), draw(near_last), draw(st.integers(0, 3))
    if kind in ("state_read", "state_read_truncated"):
        return kind, draw(st.integers(0, N_SEQ - 1)), draw(st.integers(-1, N_SEQ - 1))
    if kind == "state_write":
        return kind, draw(st.integers(-1, N_SEQ))
    return (kind,)


def assert_twins(in_c: CHybrid, python: Any) -> None:
    cache = in_c.cache
    assert same(snapshot(cache), snapshot(python))
    assert cache.state_write() == python.state_write()
    for seq in range(-1, N_SEQ + 1):
        for name in ("seq_pos_min", "seq_pos_max", "seq_rollback_min"):
            got = c_position(in_c, seq, getattr(T, name)(in_c.ctx, seq))
            assert got == python_call(lambda: getattr(python, name)(seq)), (name, seq)
    assert T.kv_used(in_c.ctx) == python.kv_used
    assert T.kv_has_shift(in_c.ctx) == int(python.kv_has_shift)
    assert python_call(cache.check) == python_call(python.check) == 0   # no move parts the halves


@pytest.mark.parametrize("engine", ["compiled", "reference"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_c_api_and_the_python_api_agree_step_by_step(config, engine, data):
    """The twin runs the compiled engine (the C API's plumbing against the facade's, over the one rule
    of _hybrid_rule) or the reference engine (against the rule hybrid.py keeps for it, and the
    reference tables)."""
    in_c = CHybrid(small_hybrid(n_seq_max=N_SEQ, **CONFIGS[config]))
    python = small_hybrid(n_seq_max=N_SEQ, engine=engine, **CONFIGS[config])
    try:
        for _ in range(data.draw(st.integers(4, 14))):
            op = data.draw(st.composite(lambda draw: ops(draw))())
            run_step(op, in_c, python, data.draw)
            assert_twins(in_c, python)
    finally:
        in_c.close()


def forked_twins(engine: str) -> tuple[CHybrid, Any]:
    """Twins where sequence 1 shares sequence 0's first six KV cells, and each then went on alone."""
    in_c, python = CHybrid(small_hybrid(n_seq_max=N_SEQ)), small_hybrid(n_seq_max=N_SEQ, engine=engine)

    def decode(tokens: list[int], seq_ids: list[int], pos: list[int]) -> None:
        assert same_decode(in_c.decode(tokens, seq_ids, pos, 4), python_decode(python, tokens, seq_ids, pos, 4))
    decode([1, 2, 3, 4, 5, 6], [0] * 6, list(range(6)))
    assert T.seq_cp(in_c.ctx, 0, 1) == 0
    python.seq_cp(0, 1)
    decode([7, 8, 9], [0, 1, 1], [6, 6, 7])
    return in_c, python


@pytest.mark.parametrize("engine", ["compiled", "reference"])
def test_every_move_around_a_forked_history_goes_alike(engine):
    """seq_add / seq_div over every range around the positions of a fork: a range ending below the last
    position, one moving the last below a position left behind, one moving the shared cells past the
    other sequence's state — the C API refuses each with the facade's code and words, and does what the
    facade does otherwise."""
    parted = set()
    for op, amounts in (("seq_add", (-4, -1, 2, 5)), ("seq_div", (2, 3))):
        for p0 in range(-1, 8):
            for p1 in range(-1, 9):
                for amount in amounts:
                    in_c, python = forked_twins(engine)
                    try:
                        expected = python_call(lambda: getattr(python, op)(0, p0, p1, amount))
                        assert c_call(in_c, getattr(T, op)(in_c.ctx, 0, p0, p1, amount)) == expected
                        assert_twins(in_c, python)
                    finally:
                        in_c.close()
                    if isinstance(expected, tuple) and " would leave sequence " in expected[1]:
                        parted.add(int(expected[1].split(" would leave sequence ")[1].split("'")[0]))
    assert parted == {0, 1}   # each sequence's halves were kept from parting
