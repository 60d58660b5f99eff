"""A made-up hybrid model for the hybrid memory's tests: every row it writes names the history it saw.

Each distinct token history (the tokens of one sequence from its first, in order) gets a number;
a K row holds that number, the V row its negative, the recurrent r row the number and the s row its
negative (written after each token, steps included).  So a row read back says exactly which history
it belongs to, and a test knows which rows each sequence must hold: its KV cells, ordered by
position, hold the histories of its prefixes, and its recurrent row the whole of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recurrent_cache import Batch
from recurrent_cache.hybrid import HybridCache, HybridState

from rows import host


class Histories:
    """The number of each history, and per sequence what the model saw: its tokens, the position of
    each, and how many of the first ones have left the KV half (a shift below position 0 frees them)."""

    def __init__(self, n_seq_max: int) -> None:
        self.numbers: dict[tuple[int, ...], int] = {}
        self.of_seq: list[tuple[int, ...]] = [() for _ in range(n_seq_max)]
        self.positions: list[list[int]] = [[] for _ in range(n_seq_max)]
        self.kv_lost = [0] * n_seq_max

    def number(self, history: tuple[int, ...]) -> float:
        return float(self.numbers.setdefault(history, len(self.numbers) + 1))

    def history(self, number: float) -> tuple[int, ...] | None:
        for history, n in self.numbers.items():
            if n == number:
                return history
        return None

    def forget(self, seq: int) -> None:
        self.of_seq[seq], self.positions[seq], self.kv_lost[seq] = (), [], 0

    def copy(self, src: int, dst: int) -> None:
        self.of_seq[dst], self.positions[dst], self.kv_lost[dst] = \
            self.of_seq[src], list(self.positions[src]), self.kv_lost[src]

    def adopt(self, other: Histories, seq: int) -> None:
        """``seq`` now holds what it held in ``other`` (a state read across memories; one numbering)."""
        self.of_seq[seq], self.positions[seq], self.kv_lost[seq] = \
            other.of_seq[seq], list(other.positions[seq]), other.kv_lost[seq]

    def keep_before(self, seq: int, p0: int) -> None:
        """A rollback to the state after ``p0 - 1``: the tokens at ``p0`` and after are gone."""
        kept = sum(p < p0 for p in self.positions[seq]) if p0 > 0 else 0   # (tokens below 0 go with the rest)
        self.of_seq[seq], self.positions[seq] = self.of_seq[seq][:kept], self.positions[seq][:kept]
        self.kv_lost[seq] = min(self.kv_lost[seq], kept)

    def shift(self, seq: int, p0: int, delta: int) -> None:
        """``seq_add(seq, p0, -1, delta)`` of a sequence sharing no KV cell: positions from p0 move; the
        ones pushed below 0 leave the KV half."""
        moved = [p + delta if p >= p0 else p for p in self.positions[seq]]
        self.kv_lost[seq] = max(self.kv_lost[seq], sum(p < 0 for p in moved))
        self.positions[seq] = moved

    def saved(self) -> tuple[Any, ...]:
        return list(self.of_seq), [list(p) for p in self.positions], list(self.kv_lost)

    def restore(self, saved: tuple[Any, ...]) -> None:
        self.of_seq, self.positions, self.kv_lost = saved


def decode(cache: HybridCache, histories: Histories, tokens: dict[int, list[int]], n_ubatch: int = 512) -> HybridState:
    """Each sequence's tokens (continuing it) in one batch; the model writes every row it promises."""
    flat_tokens, seq_ids = [], []
    for seq, new in tokens.items():
        flat_tokens += new
        seq_ids += [seq] * len(new)
    st = cache.init_batch(Batch(token=flat_tokens, seq_id=seq_ids), n_ubatch=n_ubatch)
    for ub in st:
        write(cache, st, ub, histories)
    return st


def write(cache: HybridCache, st: HybridState, ub: Any, histories: Histories) -> None:
    """The model's writes for one applied ubatch: K / V at each token's cell, r / s for each group
    (and the step states the rollback history keeps)."""
    n_seq_tokens = ub.n_seq_tokens
    cells = st.kv_cells
    for g, seq in enumerate(ub.seq_owner.tolist()):
        seen = []
        for k in range(n_seq_tokens):
            token = int(ub.token[g * n_seq_tokens + k])
            histories.of_seq[seq] += (token,)
            histories.positions[seq].append(int(ub.pos[g * n_seq_tokens + k]))
            seen.append(histories.number(histories.of_seq[seq]))
            for il in cache.attn_layers:
                cell = int(cells[g * n_seq_tokens + k])
                st.k(il)[cell] = seen[-1]
                if cache.v_trans:
                    st.v(il)[:, cell] = -seen[-1]
                else:
                    st.v(il)[cell] = -seen[-1]
        for il in cache.recr_layers:
            st.r(il)[g] = seen[-1]
            st.s(il)[g] = -seen[-1]
            if cache.n_rollback:
                steps_r, steps_s = st.r_steps(il), st.s_steps(il)
                m = steps_r.shape[1]
                for j in range(m):
                    steps_r[g, j] = seen[n_seq_tokens - 1 - m + j]
                    steps_s[g, j] = -seen[n_seq_tokens - 1 - m + j]
        for other in ub.seq_id[g][1:]:   # a token of several sequences: they share its history
            histories.copy(seq, other)


def kv_histories(cache: HybridCache, histories: Histories, seq: int) -> list[tuple[int, ...] | None]:
    """The histories ``seq``'s KV rows name, by position; also checks V and every layer agree with K."""
    named = []
    for cell in cache.seq_kv_cells(seq).tolist():
        values = set()
        for il in cache.attn_layers:
            k_row = host(cache.k[il][cell])
            v_row = host(cache.v[il][:, cell] if cache.v_trans else cache.v[il][cell])
            values |= set(k_row.tolist()) | {-x for x in v_row.tolist()}
        assert len(values) <= 1, f"sequence {seq}'s cell {cell} holds rows of several histories: {values}"
        named.append(histories.history(values.pop()) if values else None)
    return named


def recurrent_history(cache: HybridCache, histories: Histories, seq: int) -> tuple[int, ...] | None:
    """The history ``seq``'s recurrent rows name (None: no row, or rows of no one history)."""
    row = cache.seq_row(seq)
    if row < 0:
        return None
    values = set()
    for il in cache.recr_layers:
        values |= set(host(cache.r[il][row]).tolist()) | {-x for x in host(cache.s[il][row]).tolist()}
    return histories.history(values.pop()) if len(values) == 1 else None


def assert_holds_its_history(cache: HybridCache, histories: Histories) -> None:
    """The history oracle: every sequence holds exactly the rows of its own history — its KV cells,
    by position, its prefixes one by one (from the first still in the KV half) at the positions it
    decoded them (as moved since); its recurrent row the whole history."""
    for seq in range(cache.n_seq_max):
        history, lost = histories.of_seq[seq], histories.kv_lost[seq]
        expected = [history[:i + 1] for i in range(lost, len(history))]
        if cache.attn_layers:
            assert kv_histories(cache, histories, seq) == expected, f"sequence {seq}'s KV rows"
            held = sorted(cache.kv_cell(c)[0] for c in cache.seq_kv_cells(seq).tolist())
            assert held == histories.positions[seq][lost:], f"sequence {seq}'s KV positions"
        if cache.recr_layers and history:
            assert recurrent_history(cache, histories, seq) == history, f"sequence {seq}'s recurrent rows"
        if not history:
            assert cache.seq_pos_max(seq) == -1, f"sequence {seq} holds positions but has no history"


def snapshot(cache: HybridCache) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: both halves' cells and every row."""
    recurrent = [tuple(cache.recurrent_cell(i)) for i in range(cache.n_seq_max)]
    rows = [np.array(host(t)) for t in cache.kv_tensors] + [np.array(host(t)) for t in cache.r + cache.s
                                                             if t is not None]
    return (cache.kv_cells(), cache.kv_head, cache.kv_shifts().tolist(), recurrent,
            [(cache.seq_pos_min(s), cache.seq_pos_max(s)) for s in range(cache.n_seq_max)], rows)


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:-1] == b[:-1] and all(np.array_equal(x, y) for x, y in zip(a[-1], b[-1]))
