"""Rollback for speculative decoding (SPEC §7), hand-worked, on both engines and every dtype.

A toy model stands in for Mamba: the state after a sequence's tokens t0..tq is
r = [t0 + ... + tq] * n_embd_r and s = [q + 1] * n_embd_s, small integers that every
storage type holds exactly, so the state after any position is known by brute force.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import snapshot
from rows import host

N_EMBD_R, N_EMBD_S = 3, 2


class Toy:
    """Runs batches through a cache like a model that writes its step states."""

    def __init__(self, rc, n_rollback, size=4, dtype="f32", n_layer=2):
        self.cache = rc.RecurrentCache(n_layer, N_EMBD_R, N_EMBD_S, n_seq_max=size, dtype_r=dtype,
                                       dtype_s=dtype, n_rollback=n_rollback)
        self.rc = rc
        self.tokens: dict[int, list[int]] = {}   # what each sequence has been fed (brute force)

    def state(self, tokens):
        return float(sum(tokens)), float(len(tokens))

    def feed(self, entries, n_ubatch=512):
        """entries: (seq, [tokens]); each sequence continues where it is."""
        token, pos, seq_id = [], [], []
        for seq, new in entries:
            start = self.cache.seq_pos_max(seq) + 1
            token += new
            pos += range(start, start + len(new))
            seq_id += [seq] * len(new)
        st = self.cache.init_batch(self.rc.Batch(token=token, pos=pos, seq_id=seq_id), n_ubatch=n_ubatch)
        for ub in st:
            n, m = ub.n_seq_tokens, min(self.cache.n_rollback, ub.n_seq_tokens - 1)
            for g, owner in enumerate(ub.seq_owner.tolist()):
                mine = ub.token[g * n:(g + 1) * n].tolist()
                before = self.tokens.get(owner, [])[:self.cache.seq_pos_max(owner) - n + 1]
                for il in range(self.cache.n_layer):
                    r, s = self.state(before + mine)
                    st.r(il)[g], st.s(il)[g] = r, s
                    for j in range(m):
                        r, s = self.state(before + mine[:n - m + j])
                        st.r_steps(il)[g, j], st.s_steps(il)[g, j] = r, s
                self.tokens[owner] = before + mine
                for member in ub.seq_id[g][1:]:
                    self.tokens[member] = before + mine
        return st

    def expect_state(self, seq):
        """The cache holds exactly the brute-force state of ``seq``'s tokens."""
        row = self.cache.cell(self.cache_cell(seq))
        assert row[0] == len(self.tokens[seq]) - 1
        r, s = self.state(self.tokens[seq])
        for il in range(self.cache.n_layer):
            np.testing.assert_array_equal(np.asarray(host(self.cache.r[il][self.cache_cell(seq)]), np.float64), r)
            np.testing.assert_array_equal(np.asarray(host(self.cache.s[il][self.cache_cell(seq)]), np.float64), s)

    def cache_cell(self, seq):
        return self.cache.cell(seq)[2]   # tail of seq

    def rollback(self, seq, p0):
        done = self.cache.seq_rm(seq, p0, -1)
        if done:
            self.tokens[seq] = self.tokens[seq][:p0]
        self.cache.check()
        return done


@pytest.fixture(params=["f32", "f16", "bf16"])
def dtype(request):
    return request.param


def test_spec_example_window(rc, dtype):
    # n_rollback = 4: a 6-token prompt writes the states after positions 1..4; the cache
    # keeps the states after 5 and 6 as one-token steps at 6 and 7 replace them
    toy = Toy(rc, 4, dtype=dtype)
    toy.feed([(0, [1, 2, 3, 4, 5, 6])])
    assert toy.cache.seq_rollback_min(0) == 1
    toy.feed([(0, [7])])
    toy.feed([(0, [8])])
    assert toy.cache.seq_pos_max(0) == 7 and toy.cache.seq_rollback_min(0) == 3
    for q in (6, 5, 4, 3):
        fresh = Toy(rc, 4, dtype=dtype)
        fresh.feed([(0, [1, 2, 3, 4, 5, 6])]), fresh.feed([(0, [7])]), fresh.feed([(0, [8])])
        assert fresh.rollback(0, q + 1) and fresh.cache.seq_pos_max(0) == q
        fresh.expect_state(0)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_roll_back_1_to_k_tokens_after_decode_steps(rc, k):
    for back in range(1, k + 1):
        toy = Toy(rc, k)
        toy.feed([(0, [3, 1])])
        for t in range(6):
            toy.feed([(0, [t + 2])])
        pos = toy.cache.seq_pos_max(0)
        assert toy.rollback(0, pos + 1 - back), back
        toy.expect_state(0)
        assert toy.cache.seq_pos_max(0) == pos - back
        toy.feed([(0, [9])])          # and decoding goes on from there
        toy.expect_state(0)


def test_beyond_reach_returns_false_and_changes_nothing(rc):
    toy = Toy(rc, 2)
    toy.feed([(0, [1, 2, 3])])
    toy.feed([(0, [4])])
    before = snapshot(toy.cache)
    assert toy.cache.seq_rollback_min(0) == 1
    assert not toy.rollback(0, 1)     # the state after 0 is out of the window
    assert not toy.cache.seq_rm(0, 1, 3)   # a range inside the state is still not removable
    assert snapshot(toy.cache) == before
    assert toy.rollback(0, 2)
    toy.expect_state(0)


def test_shared_cell_is_copied_on_write(rc):
    toy = Toy(rc, 3)
    toy.feed([(0, [1, 2, 3, 4])])
    toy.cache.seq_cp(0, 1)
    toy.tokens[1] = list(toy.tokens[0])
    cell = toy.cache_cell(0)
    assert toy.rollback(1, 2)
    assert toy.cache_cell(1) != cell and toy.cache_cell(0) == cell
    toy.expect_state(0)                # the others keep their state
    toy.expect_state(1)                # the rolled-back branch has the state after 1
    assert toy.cache.seq_rollback_min(1) == 0   # and the history it had before
    toy.feed([(1, [7]), (0, [8])])
    toy.expect_state(0), toy.expect_state(1)


def test_copy_on_write_always_finds_a_cell_in_the_smallest_cache(rc):
    # "no free cell: False" cannot happen through the API: a sequence that shares its cell
    # leaves at most size - 1 cells in use (seq ids are < size); the smallest case shows it
    toy = Toy(rc, 3, size=2)
    toy.feed([(0, [1, 2, 3, 4])])
    toy.cache.seq_cp(0, 1)
    toy.tokens[1] = list(toy.tokens[0])
    assert toy.cache.used == 1
    assert toy.rollback(1, 2)
    assert toy.cache.used == 2 and toy.cache_cell(0) != toy.cache_cell(1)
    toy.expect_state(0), toy.expect_state(1)


def test_fork_then_roll_back_one_branch(rc, dtype):
    toy = Toy(rc, 4, dtype=dtype)
    toy.feed([(0, [5, 6, 7])])
    toy.cache.seq_cp(0, 1)
    toy.tokens[1] = list(toy.tokens[0])
    toy.feed([(0, [1]), (1, [2])])     # the fork: seq 1 moves to a cell of its own ...
    toy.feed([(0, [3]), (1, [4])])
    assert toy.cache.seq_rollback_min(1) == 0   # ... and keeps the history it shared
    assert toy.rollback(1, 2)          # back before the fork
    toy.expect_state(1), toy.expect_state(0)
    assert toy.rollback(0, 4)
    toy.expect_state(0)


def test_history_survives_a_move_to_another_cell(rc):
    toy = Toy(rc, 3, size=4)
    toy.feed([(2, [1])])
    toy.feed([(0, [1, 2, 3])])
    toy.cache.seq_cp(0, 3)
    toy.tokens[3] = list(toy.tokens[0])
    toy.cache.seq_rm(2, -1, -1)
    cell = toy.cache_cell(0)
    toy.feed([(0, [4])])               # seq 0 gets a cell of its own: its rows and history move
    assert toy.cache_cell(0) != cell
    assert toy.rollback(0, 2)
    toy.expect_state(0), toy.expect_state(3)


def test_the_history_handed_out_is_a_copy(rc):
    """What ``memory_core.history()`` returns keeps its values while the cache goes on filing states."""
    toy = Toy(rc, 3)
    toy.feed([(0, [1, 2, 3, 4])])
    tags, history = toy.cache.memory_core.history()
    held = [array.tobytes() for array in history]
    assert any(np.any(array) for array in history)   # the feed filed states: a change would show
    toy.feed([(0, [4, 4, 4])])                     # files other states over the same slots
    assert [array.tobytes() for array in history] == held
    assert [array.tobytes() for array in toy.cache.memory_core.history()[1]] != held


def test_seq_add_state_read_and_clear_forget_history(rc):
    toy = Toy(rc, 3)
    toy.feed([(0, [1, 2, 3, 4])]), toy.feed([(1, [1, 2, 3])])
    toy.cache.seq_add(0, -1, -1, 10)
    assert toy.cache.seq_rollback_min(0) == -1 and not toy.cache.seq_rm(0, 12, -1)
    assert toy.cache.seq_rollback_min(1) == 0
    toy.cache.state_read(toy.cache.state_write(1), 1)
    assert toy.cache.seq_rollback_min(1) == -1
    toy.feed([(1, [9, 9])])
    assert toy.cache.seq_rollback_min(1) == 2
    toy.cache.clear()
    assert [toy.cache.seq_rollback_min(s) for s in range(4)] == [-1] * 4


def test_step_arrays_shape_and_errors(rc):
    cache = rc.RecurrentCache(2, N_EMBD_R, N_EMBD_S, n_seq_max=2, n_rollback=3)
    st = cache.init_batch(rc.Batch(token=[1] * 6, seq_id=[0] * 6, pos=range(6)))
    st.apply()
    assert st.r_steps(0).shape == (1, 3, N_EMBD_R) and st.s_steps(1).shape == (1, 3, N_EMBD_S)
    with pytest.raises(rc.OutOfRangeError):
        st.r_steps(2)
    st = cache.init_batch(rc.Batch(token=[1], seq_id=[0], pos=[6]))
    with pytest.raises(rc.UsageError):
        st.r_steps(0)
    st.apply()
    assert st.r_steps(0).shape == (1, 0, N_EMBD_R)
    with pytest.raises(rc.ArgumentError, match=r"n_rollback must be in \[0, 2\*\*31\), got -1"):
        rc.RecurrentCache(1, 1, 1, n_rollback=-1)
    plain = rc.RecurrentCache(1, 1, 1, n_seq_max=1)
    for _ in plain.init_batch(rc.Batch(token=[1, 2], pos=[0, 1])):
        pass
    assert not plain.seq_rm(0, 1, -1) and plain.seq_rollback_min(0) == -1


def test_speculative_loop_equals_plain_decoding(rc):
    """Draft k tokens (some right, some wrong), verify them in one batch, keep the accepted
    ones and roll the rest back: the states equal plain token-by-token decoding."""
    rng = np.random.default_rng(7)
    truth = rng.integers(0, 5, size=60).tolist()
    plain, spec = Toy(rc, 4), Toy(rc, 4)
    plain.feed([(0, truth[:3])]), spec.feed([(0, truth[:3])])
    for t in truth[3:]:
        plain.feed([(0, [t])])
    done = 3
    while done < len(truth):
        k = int(rng.integers(1, 5))
        draft = [t if rng.random() < 0.6 else (t + 1) % 5 for t in truth[done:done + k]]
        spec.feed([(0, draft)])
        accepted = 0
        while accepted < len(draft) and draft[accepted] == truth[done + accepted]:
            accepted += 1
        if accepted < len(draft):
            assert spec.rollback(0, done + accepted)
        done += accepted
        if accepted < len(draft) or not draft:
            spec.feed([(0, [truth[done]])])   # the model's own token at the first mismatch
            done += 1
        spec.expect_state(0)
    assert spec.tokens[0] == plain.tokens[0] == truth
    for il in range(2):
        spec_row, plain_row = spec.cache.r[il][spec.cache_cell(0)], plain.cache.r[il][plain.cache_cell(0)]
        assert host(spec_row).tobytes() == host(plain_row).tobytes()
