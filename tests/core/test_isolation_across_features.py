"""Where the features meet: no sequence ever holds another sequence's state (issue 17).

Rollback, the prefix cache, the stores, ``state_read`` and the C API each pass their
own tests; this suite drives them *together* on one cache, through their public
interfaces only, against an oracle model whose every state is a function of the
sequence's history: after a sequence has consumed tokens t_0..t_p, tensor k of its
cell holds ``history_row(k, (t_0, .., t_p))`` — small integers from a hash, exact in
f32, f16 and bf16, never 0 — and the step states of a ubatch hold the value of the
history up to their step.  The oracle knows, after every operation, the token
history each live sequence must hold (a fork shares its parent's, a rollback
truncates it, a restore takes the restored prompt's) and which earlier states a
rollback may reach (SPEC §7: the states the cache filed for *this* history within
the last ``n_rollback`` positions, never those of a cell's previous occupant).  So
a sequence that holds anything else — a stale row, zeros, the previous occupant's
state or history — is caught at the operation that caused it.

Both engines run the Python-only interleavings, and the compiled engine on torch storage
(``cpu``, through index arrays as on a GPU); the C API (through ctypes on the
capsule's function table, ``capi_table.py``) exists on the compiled engine only.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pytest

import recurrent_cache
from capi_table import P, Ubatch, header_codes, ints, message, table
from variants import VARIANTS, package_on
from recurrent_cache import stores
from rows import assign, host
from rows import dtype as dtype_of

T = table()
N_LAYER, N_EMBD_R, N_EMBD_S = 2, 3, 4
SIZE = 5
DTYPES = ("f32", "f16", "bf16")
VOCAB = 4             # few distinct tokens: different sequences often share prefixes
CODES = header_codes()    # capi.h's RC_ERR_* names: the C API's contract


# -- the oracle ------------------------------------------------------------------------

@cache
def history_values(tensor: int, history: tuple[int, ...], width: int) -> tuple[int, ...]:
    """The state of tensor ``tensor`` after ``history``: integers in [1, 251], exact in every dtype."""
    digest = hashlib.blake2b(repr((tensor, history)).encode(), digest_size=16).digest()
    return tuple(b % 251 + 1 for b in digest[:width])


def encode(values: Sequence[float], dtype: np.dtype) -> np.ndarray:
    """``values`` stored as a row of ``dtype`` (bf16 without ml_dtypes: the upper half of each f32)."""
    as_f32 = np.asarray(values, dtype=np.float32)
    if dtype == np.uint16:
        return (as_f32.view(np.uint32) >> 16).astype(np.uint16)
    return as_f32.astype(dtype)


def tensors(cache) -> list[np.ndarray]:
    """r[0..n_layer) then s[0..n_layer): the C API's tensor numbering."""
    return list(cache.r) + list(cache.s)


def history_row(cache, k: int, history: tuple[int, ...]) -> np.ndarray:
    """What row ``k`` of a cell holding ``history`` must be (zeros for no history: a fresh cell)."""
    tensor = tensors(cache)[k]
    if not history:
        return np.zeros(tensor.shape[1], dtype=dtype_of(tensor))
    return encode(history_values(k, history, tensor.shape[1]), dtype_of(tensor))


class Oracle:
    """Each live sequence's token history, its position (the history's length - 1 until
    ``seq_add`` / ``seq_div`` move it: ``offset``) and the positions its rollback may reach (SPEC §7)."""

    def __init__(self, n_rollback: int) -> None:
        self.n_rollback = n_rollback
        self.history: dict[int, tuple[int, ...]] = {}
        self.offset: dict[int, int] = {}         # position - (len(history) - 1)
        self.window: dict[int, set[int]] = {}    # q: the state after position q is held for rollback

    def pos(self, seq: int) -> int:
        return len(self.history.get(seq, ())) - 1 + self.offset.get(seq, 0)

    def advance(self, members: Sequence[int], before: tuple[int, ...], tokens: Sequence[int], m: int) -> None:
        """A ubatch group of ``members`` (owner first) continued ``before`` by ``tokens``: the cache
        filed the state it started from, the model wrote the states after the ``m`` tokens
        before its last one (SPEC §7)."""
        owner = members[0]
        start = self.pos(owner) if before else -1         # the position the group continues
        offset = self.offset.get(owner, 0) if before else 0
        last = start + len(tokens)
        held = set(self.window.get(owner, ())) if before else set()
        if before:
            held.add(start)                               # the state the group started from
        held.update(range(last - m, last))                # the step states the model wrote
        held = {q for q in held if last - self.n_rollback <= q < last}
        for seq in members:
            self.history[seq] = before + tuple(tokens)
            self.offset[seq] = offset
            self.window[seq] = set(held)

    def drop(self, seq: int) -> None:
        self.history.pop(seq, None)
        self.offset.pop(seq, None)
        self.window.pop(seq, None)

    def place(self, seq: int, history: tuple[int, ...], pos: int | None = None) -> None:
        """``seq`` now holds ``history``'s state at ``pos`` (default: its length - 1), placed from
        outside: nothing to roll back to."""
        self.history[seq] = history
        self.offset[seq] = 0 if pos is None else pos - (len(history) - 1)
        self.window[seq] = set()

    def move(self, sharers: Sequence[int], pos: int) -> None:
        """``seq_add`` / ``seq_div`` moved the cell of ``sharers`` to ``pos``: its history is forgotten."""
        for seq in sharers:
            self.offset[seq] = pos - (len(self.history[seq]) - 1)
            self.window[seq] = set()

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Apply ``seq_rm(seq, p0, p1)`` to a live ``seq`` (SPEC §1 and §7); what it must return."""
        pos = self.pos(seq)
        p0 = max(p0, 0)
        p1 = p1 if p1 >= 0 else 2**31 - 1
        if 0 < p0 <= pos and p1 > pos:                    # a rollback to the state after p0 - 1
            q = p0 - 1
            if q not in self.window[seq]:
                return False
            self.history[seq] = self.history[seq][:p0 - self.offset[seq]]
            self.window[seq] = {x for x in self.window[seq] if x < q}
            return True
        if 0 < p0 <= pos or 0 < p1 <= pos:               # would cut the state
            return False
        if p0 <= pos < p1:
            self.drop(seq)
        return True

    def seq_cp(self, src: int, dst: int) -> None:
        if src == dst:
            return
        self.drop(dst)
        if src in self.history:
            self.history[dst] = self.history[src]
            self.offset[dst] = self.offset[src]
            self.window[dst] = set(self.window[src])      # a fork shares the cell's history

    def seq_keep(self, seq: int) -> None:
        for other in list(self.history):
            if other != seq:
                self.drop(other)

    def clear(self) -> None:
        self.history.clear()
        self.offset.clear()
        self.window.clear()


# -- one cache driven through Python and C ------------------------------------------------

class Harness:
    """One cache, the oracle, and every surface that changes the cache, each checked after use."""

    def __init__(self, cache, n_rollback: int, with_c: bool) -> None:
        self.cache = cache
        self.oracle = Oracle(n_rollback)
        self.ctx = T.ctx_new(cache) if with_c else None
        self.prefix_cache = recurrent_cache.PrefixCache(cache, 1 << 20, block_size=4)
        self.saved: set[tuple[int, ...]] = set()
        self.log: list[str] = []
        self.rollbacks = 0     # seq_rm calls that rolled a sequence back: the scripts must make some

    def close(self) -> None:
        if self.ctx is not None:
            assert T.ctx_free(self.ctx) == 0
            self.ctx = None

    def where(self) -> str:
        return "after: " + "; ".join(self.log[-12:])

    def cells(self) -> list[tuple]:
        return [self.cache.cell(i) for i in range(self.cache.size)]

    def everything(self) -> tuple:
        """The cells and every byte of every row: what a refused call must leave as it was."""
        return self.cells(), self.cache.state_write(), [host(t) for t in tensors(self.cache)]

    def expect_unchanged(self, before: tuple, what: str) -> None:
        after = self.everything()
        assert after[0] == before[0], f"{what} changed the cells; {self.where()}"
        assert after[1] == before[1], f"{what} changed the state; {self.where()}"
        for a, b in zip(after[2], before[2]):
            assert a.tobytes() == b.tobytes(), f"{what} changed the rows; {self.where()}"

    # -- the model: writes the oracle's states, checks the state each group starts from

    def group(self, rows: Callable[[int], np.ndarray], steps: Callable[[int, int, np.ndarray], None],
              members: Sequence[int], tokens: Sequence[int], first_pos: int, m: int, api: str) -> None:
        """The model on one group of an applied ubatch: its row ``rows(k)`` of tensor k must hold the
        state of the owner's history (zeros for a new sequence); it writes the state after
        ``tokens`` there and the ``m`` step states through ``steps(k, j, value)``."""
        owner = members[0]
        known = self.oracle.history.get(owner, ())
        assert self.oracle.pos(owner) + 1 == first_pos, (
            f"{api}: seq {owner} continues at {first_pos}, the oracle's at {self.oracle.pos(owner)}")
        for k in range(2 * self.cache.n_layer):
            start = rows(k)
            expected = history_row(self.cache, k, known)
            assert host(start).tobytes() == expected.tobytes(), (
                f"{api}: seq {owner} starts from {start.tolist()}, not the state of its history {known} "
                f"({expected.tolist()}); {self.where()}")
            assign(start, history_row(self.cache, k, known + tuple(tokens)))
            for j in range(m):
                steps(k, j, history_row(self.cache, k, known + tuple(tokens[:len(tokens) - m + j])))
        self.oracle.advance(members, known, tokens, m)

    def batch_entries(self, entries: list[tuple[tuple[int, ...], list[int]]]):
        """Per token: its seq ids (owner first), token, position."""
        flat = []
        for seqs, new in entries:
            start = self.oracle.pos(seqs[0]) + 1
            flat += [(seqs, t, start + i) for i, t in enumerate(new)]
        return flat

    def feed_python(self, entries, n_ubatch: int) -> bool:
        """One ``init_batch`` through the Python API, the model run on every ubatch."""
        flat = self.batch_entries(entries)
        seq_id = [list(s) for s, _, _ in flat] if any(len(s) > 1 for s, _, _ in flat) else [s[0] for s, _, _ in flat]
        batch = recurrent_cache.Batch(token=[t for _, t, _ in flat], pos=[p for _, _, p in flat], seq_id=seq_id)
        before = self.everything()
        st = self.cache.init_batch(batch, n_ubatch=n_ubatch)
        if st.status != recurrent_cache.MemoryStatus.SUCCESS:
            self.expect_unchanged(before, "a batch that does not fit")
            return False
        for ub in st:
            n = ub.n_seq_tokens
            m = st.r_steps(0).shape[1]
            for g in range(ub.n_seqs):
                def rows(k, g=g):
                    il = k % self.cache.n_layer
                    return (st.r(il) if k < self.cache.n_layer else st.s(il))[g]

                def steps(k, j, value, g=g):
                    il = k % self.cache.n_layer
                    assign((st.r_steps(il) if k < self.cache.n_layer else st.s_steps(il))[g, j], value)

                self.group(rows, steps, ub.seq_id[g], ub.token[g * n:(g + 1) * n].tolist(),
                           int(ub.pos[g * n]), m, "python batch")
        return True

    def feed_c(self, entries, n_ubatch: int) -> bool:
        """The same through ``rc_batch_init`` / ``rc_batch_apply`` / ``rc_batch_step_row``."""
        flat = self.batch_entries(entries)
        seq_ids = [s for seqs, _, _ in flat for s in seqs]
        offsets = np.cumsum([0] + [len(seqs) for seqs, _, _ in flat]).tolist()
        tokens = [t for _, t, _ in flat]
        before = self.everything()
        batch = P()
        code = T.batch_init(self.ctx, len(flat), ints(seq_ids), ints(offsets), ints([p for _, _, p in flat]),
                            None, n_ubatch, 0, ctypes.byref(batch))
        if code == CODES["RC_ERR_NO_FREE_CELL"]:
            self.expect_unchanged(before, "a C batch that does not fit")
            return False
        assert code == 0, message(T, self.ctx, code)
        try:
            ub = Ubatch()
            while (code := T.batch_apply(batch, ctypes.byref(ub))) == 1:
                n, m = ub.n_seq_tokens, T.batch_n_steps(batch)
                for g in range(ub.n_seqs):
                    order = [ub.token_order[g * n + i] for i in range(n)]
                    members = flat[order[0]][0]

                    def rows(k, g=g, head=ub.head):
                        return tensors(self.cache)[k][head + g]

                    def steps(k, j, value, g=g):
                        row = P()
                        assert T.batch_step_row(batch, k, g, j, ctypes.byref(row)) == 0
                        ctypes.memmove(row, value.tobytes(), value.nbytes)

                    self.group(rows, steps, members, [tokens[i] for i in order], flat[order[0]][2], m, "C batch")
            assert code == 0, message(T, self.ctx, code)
        finally:
            T.batch_release(batch)
        return True

    # -- sequence operations through either API

    def seq_rm(self, seq: int, p0: int, p1: int, api: str) -> None:
        length = len(self.oracle.history.get(seq, ()))
        expected = self.oracle.seq_rm(seq, p0, p1) if seq in self.oracle.history else True
        if api == "C":
            done = T.seq_rm(self.ctx, seq, p0, p1)
            assert done in (0, 1), message(T, self.ctx, done)
        else:
            done = self.cache.seq_rm(seq, p0, p1)
        assert bool(done) == expected, (
            f"{api} seq_rm({seq}, {p0}, {p1}) returned {bool(done)}; the oracle says {expected} "
            f"(its window: {sorted(self.oracle.window.get(seq, ()))}); {self.where()}")
        self.rollbacks += 0 < len(self.oracle.history.get(seq, ())) < length

    def seq_cp(self, src: int, dst: int, api: str) -> None:
        if api == "C":
            assert T.seq_cp(self.ctx, src, dst) == 0
        else:
            self.cache.seq_cp(src, dst)
        self.oracle.seq_cp(src, dst)

    def seq_keep(self, seq: int, api: str) -> None:
        if api == "C":
            assert T.seq_keep(self.ctx, seq) == 0
        else:
            self.cache.seq_keep(seq)
        self.oracle.seq_keep(seq)

    def move(self, seq: int, op: str, amount: int, api: str) -> None:
        """``seq_add(seq, 0, -1, amount)`` or ``seq_div(seq, 0, -1, amount)``: every sequence
        sharing ``seq``'s cell moves with it, and the cell's history is forgotten (SPEC §7)."""
        cell = self.cache.cell(seq)[2]
        sharers = [s for s in self.oracle.history if self.cache.cell(s)[2] == cell]
        pos = self.oracle.pos(seq)
        if api == "C":
            assert getattr(T, op)(self.ctx, seq, 0, -1, amount) == 0
        else:
            getattr(self.cache, op)(seq, 0, -1, amount)
        self.oracle.move(sharers, pos + amount if op == "seq_add" else pos // amount)

    def clear(self, api: str) -> None:
        if api == "C":
            assert T.clear(self.ctx) == 0
        else:
            self.cache.clear()
        self.oracle.clear()

    def state_write(self, seq: int, api: str) -> bytes:
        if api == "C":
            n = ctypes.c_size_t()
            assert T.state_size(self.ctx, seq, ctypes.byref(n)) == 0
            buffer = ctypes.create_string_buffer(max(1, n.value))
            written = ctypes.c_size_t()
            assert T.state_write(self.ctx, seq, buffer, n.value, ctypes.byref(written)) == 0
            return buffer.raw[:written.value]
        return self.cache.state_write(seq)

    def state_read(self, blob: bytes, seq: int, api: str) -> None:
        if api == "C":
            code = T.state_read(self.ctx, seq, blob, len(blob))
            assert code == 0, message(T, self.ctx, code)
        else:
            self.cache.state_read(blob, seq)

    def copy_by_state(self, src: int, dst: int, api_write: str, api_read: str) -> None:
        """``state_write(src)`` read into ``dst``: dst holds src's state and no history."""
        blob = self.state_write(src, api_write)
        self.state_read(blob, dst, api_read)
        if src in self.oracle.history:
            self.oracle.place(dst, self.oracle.history[src], self.oracle.pos(src))
        else:
            self.oracle.drop(dst)

    def round_trip(self, api_write: str, api_read: str) -> None:
        """The whole cache through a blob: every state kept, every history forgotten."""
        self.state_read(self.state_write(-1, api_write), -1, api_read)
        for seq in self.oracle.window:
            self.oracle.window[seq] = set()

    # -- the prefix cache and the stores (Python only)

    def save(self, seq: int) -> None:
        """``PrefixCache.save`` of a sequence whose position is its history's length - 1."""
        tokens = self.oracle.history[seq]
        assert self.prefix_cache.save(seq, list(tokens)), f"save of {tokens} not let in; {self.where()}"
        self.saved.add(tokens)

    def restore(self, seq: int, tokens: tuple[int, ...]) -> None:
        n = self.prefix_cache.restore(seq, list(tokens))
        held = [len(p) for p in self.saved if len(p) < len(tokens) and tokens[:len(p)] == p]
        assert n == max(held, default=0), f"restore of {tokens} matched {n}, saved {held}; {self.where()}"
        if n:
            self.oracle.place(seq, tokens[:n])

    def restore_rows(self, src: int, dst: int) -> None:
        r_rows, s_rows = stores.sequence_rows(self.cache, src)
        history = self.oracle.history[src]
        stores.restore_rows(self.cache, dst, len(history), r_rows, s_rows)
        self.oracle.place(dst, history)

    # -- the check after every operation

    def verify(self, rollback_min: Callable[[int], int]) -> None:
        cache, oracle = self.cache, self.oracle
        cache.check()
        tails = set()
        for seq in range(cache.size):
            tail = cache.cell(seq)[2]
            if seq not in oracle.history:
                assert tail == -1 and cache.seq_pos_max(seq) == -1, (
                    f"seq {seq} should hold nothing but is in cell {tail}; {self.where()}")
                continue
            history = oracle.history[seq]
            assert tail >= 0, f"seq {seq} lost its cell (history {history}); {self.where()}"
            tails.add(tail)
            pos, src, _, seq_ids = cache.cell(tail)
            assert seq in seq_ids and pos == cache.seq_pos_max(seq) == oracle.pos(seq), (
                f"seq {seq}: cell {tail} at pos {pos} with {seq_ids}, history {history}; {self.where()}")
            for k, tensor in enumerate(tensors(cache)):
                row = host(tensor[src]) if src >= 0 else np.zeros_like(host(tensor[0]))
                expected = history_row(cache, k, history)
                assert row.tobytes() == expected.tobytes(), (
                    f"seq {seq} (cell {tail}, row {src}) tensor {k} holds {row.tolist()}, not the state of its "
                    f"history {history} {expected.tolist()}; {self.where()}")
            window = oracle.window[seq]
            got = rollback_min(seq)
            assert got == (min(window) if window else -1), (
                f"seq_rollback_min({seq}) is {got}; it holds the states after {sorted(window)} "
                f"(history {history}); {self.where()}")
        assert cache.used == len(tails), f"used {cache.used}, {len(tails)} cells hold sequences; {self.where()}"


# -- random interleavings ----------------------------------------------------------------

def new_cache(engine: str, dtype: str, n_rollback: int, size: int = SIZE):
    return package_on(engine).RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=size, dtype_r=dtype,
                                             dtype_s=dtype, n_rollback=n_rollback)


def free_cells(h: Harness) -> int:
    return h.cache.size - h.cache.used


def random_batch(h: Harness, rng: random.Random):
    """Prompts of new sequences (some shared by two new sequences) and steps of live ones,
    never needing more cells than are free (a shared cell's owner needs its own)."""
    live = sorted(h.oracle.history)
    tails = [h.cache.cell(s)[2] for s in live]
    shared = {s for s, tail in zip(live, tails) if tails.count(tail) > 1}
    room = free_cells(h)
    entries = []
    for seq in rng.sample(live, rng.randint(0, len(live))):
        if seq in shared:
            if room == 0:
                continue
            room -= 1
        entries.append(((seq,), [rng.randrange(VOCAB) for _ in range(rng.choice((1, 1, 2, 3)))]))
    free_seqs = [s for s in range(h.cache.size) if s not in h.oracle.history]
    rng.shuffle(free_seqs)
    while room and free_seqs and rng.random() < 0.7:
        owners = (free_seqs.pop(),)
        if free_seqs and rng.random() < 0.25:
            owners += (free_seqs.pop(),)      # one prompt for two new sequences: one shared cell
        room -= 1
        entries.append((owners, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]))
    return entries


def run_script(h: Harness, rng: random.Random, n_ops: int, use_c: bool, use_snapshots: bool) -> None:
    """``n_ops`` random operations, each through a random API, the oracle checked after each."""
    cache = h.cache

    def api() -> str:
        return "C" if use_c and rng.random() < 0.5 else "Python"

    def rollback_min(seq: int) -> int:
        if use_c and rng.random() < 0.5:
            return int(T.seq_rollback_min(h.ctx, seq))
        return cache.seq_rollback_min(seq)

    ops = ["batch"] * 6 + ["rollback"] * 4 + ["drop", "cut", "fork", "state_one", "whole", "move"]
    ops += ["keep", "clear"] if rng.random() < 0.5 else []
    ops += ["save", "save", "restore", "restore", "restore_rows"] if use_snapshots else []
    for _ in range(n_ops):
        live = sorted(h.oracle.history)
        op = rng.choice(ops)
        seq = rng.choice(live) if live else None
        free_seq = [s for s in range(cache.size) if s not in h.oracle.history]
        if op == "batch":
            entries = random_batch(h, rng)
            if not entries:
                continue
            via, n_ubatch = api(), rng.choice((1, 2, 3, 4, 8))
            h.log.append(f"{via} batch {entries} n_ubatch {n_ubatch}")
            (h.feed_c if via == "C" else h.feed_python)(entries, n_ubatch)
        elif op == "rollback" and seq is not None and h.oracle.pos(seq) > 0:
            p0, via = rng.randint(1, h.oracle.pos(seq)), api()
            h.log.append(f"{via} seq_rm({seq}, {p0}, -1)")
            h.seq_rm(seq, p0, -1, via)
        elif op == "drop" and seq is not None:
            via, p0 = api(), rng.choice((-1, 0))
            h.log.append(f"{via} seq_rm({seq}, {p0}, -1)")
            h.seq_rm(seq, p0, -1, via)
        elif op == "cut" and seq is not None and h.oracle.pos(seq) > 1:
            p1, via = rng.randint(1, h.oracle.pos(seq)), api()
            h.log.append(f"{via} seq_rm({seq}, 0, {p1})")
            h.seq_rm(seq, 0, p1, via)
        elif op == "fork" and seq is not None:
            dst, via = rng.randrange(cache.size), api()
            h.log.append(f"{via} seq_cp({seq}, {dst})")
            h.seq_cp(seq, dst, via)
        elif op == "move" and seq is not None:
            via, how = api(), rng.choice((("seq_add", 1), ("seq_add", 2), ("seq_add", -1), ("seq_div", 2)))
            if h.oracle.pos(seq) + how[1] < 0:
                continue
            h.log.append(f"{via} {how[0]}({seq}, 0, -1, {how[1]})")
            h.move(seq, *how, via)
        elif op == "keep" and seq is not None:
            via = api()
            h.log.append(f"{via} seq_keep({seq})")
            h.seq_keep(seq, via)
        elif op == "clear":
            via = api()
            h.log.append(f"{via} clear")
            h.clear(via)
        elif op == "state_one" and seq is not None and free_seq and free_cells(h):
            dst, write, read = rng.choice(free_seq), api(), api()
            h.log.append(f"{write} state_write({seq}) -> {read} state_read(seq {dst})")
            h.copy_by_state(seq, dst, write, read)
        elif op == "whole":
            write, read = api(), api()
            h.log.append(f"{write} state_write() -> {read} state_read()")
            h.round_trip(write, read)
        elif op == "save" and seq is not None and h.oracle.offset[seq] == 0:
            h.log.append(f"save({seq})")
            h.save(seq)
        elif op == "restore" and h.saved and free_seq and free_cells(h):
            dst = rng.choice(free_seq)
            tokens = rng.choice(sorted(h.saved)) + (rng.randrange(VOCAB),) * rng.randint(1, 2)
            h.log.append(f"restore(seq {dst}, {tokens})")
            h.restore(dst, tokens)
        elif op == "restore_rows" and seq is not None and free_seq and free_cells(h):
            dst = rng.choice(free_seq)
            h.log.append(f"restore_rows({seq} -> {dst})")
            h.restore_rows(seq, dst)
        else:
            continue
        h.verify(rollback_min)


def run_scripts(engine: str, n_rollback: int, seeds: range, use_c: bool, use_snapshots: bool) -> None:
    """One script of 100 operations per seed, the dtype changing with the seed."""
    rollbacks = 0
    for seed in seeds:
        h = Harness(new_cache(engine, DTYPES[seed % 3], n_rollback), n_rollback, with_c=use_c)
        try:
            run_script(h, random.Random(seed), 100, use_c=use_c, use_snapshots=use_snapshots)
        finally:
            h.close()
        rollbacks += h.rollbacks
    assert rollbacks > 0 if n_rollback else rollbacks == 0, f"{rollbacks} rollbacks in {len(seeds)} scripts"


@pytest.mark.parametrize("n_rollback", [0, 3])
@pytest.mark.parametrize("engine", VARIANTS)
def test_python_interleavings_of_batches_sequences_and_state_io(engine, n_rollback):
    """Batches, rollbacks, drops, forks, keeps, clears and state blobs in random order."""
    run_scripts(engine, n_rollback, range(10 if engine == "compiled" else 5), use_c=False, use_snapshots=False)


@pytest.mark.parametrize("n_rollback", [0, 3])
@pytest.mark.parametrize("engine", VARIANTS)
def test_python_interleavings_with_prefix_cache_and_stores(engine, n_rollback):
    """The same with ``PrefixCache.save`` / ``restore`` and ``stores.restore_rows`` mixed in."""
    run_scripts(engine, n_rollback, range(1000, 1010 if engine == "compiled" else 1005), use_c=False,
                use_snapshots=True)


@pytest.mark.parametrize("use_snapshots", [False, True], ids=["cells", "snapshots"])
@pytest.mark.parametrize("n_rollback", [0, 3])
def test_python_and_c_interleavings_on_one_cache(n_rollback, use_snapshots):
    """Every operation through the Python API or the C API at random, on one compiled cache."""
    run_scripts("compiled", n_rollback, range(2000, 2010), use_c=True, use_snapshots=use_snapshots)


# -- a restored sequence never inherits the previous occupant's history --------------------

def feed(h: Harness, seq: int, tokens: Sequence[int], via: str = "Python") -> None:
    assert (h.feed_c if via == "C" else h.feed_python)([((seq,), list(tokens))], 512)


def drop_leaving_its_history(h: Harness, seq: int, others: Sequence[int]) -> int:
    """Give each of ``others`` a one-token prompt, then drop ``seq``: its cell, with its rollback
    history, is free again and the first a placement finds.  Returns that cell."""
    for other in others:
        feed(h, other, [other % VOCAB])
    cell = h.cache.cell(seq)[2]
    h.seq_rm(seq, -1, -1, "Python")
    return cell


def expect_no_rollback_into_the_past(h: Harness, seq: int) -> None:
    """``seq`` was placed from outside: no rollback may reach behind its position, and any that
    claims to must at least leave ``seq``'s own state, not the previous occupant's."""
    history = h.oracle.history[seq]
    for p0 in range(len(history) - 1, 0, -1):
        done = h.cache.seq_rm(seq, p0, -1)
        if done:
            tail = h.cache.cell(seq)[2]
            for k, tensor in enumerate(tensors(h.cache)):
                assert host(tensor[tail]).tobytes() == history_row(h.cache, k, history[:p0]).tobytes(), (
                    f"seq_rm({seq}, {p0}, -1) rolled the restored sequence back to another sequence's state: "
                    f"tensor {k} holds {tensor[tail].tolist()}")
        assert not done, f"seq_rm({seq}, {p0}, -1) rolled back a sequence restored at {len(history) - 1}"
    h.verify(h.cache.seq_rollback_min)


RESTORES = [(engine, via) for engine in VARIANTS
            for via in ("PrefixCache.restore", "stores.restore_rows", "state_read")]
RESTORES.append(("compiled", "rc_state_read"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine, via", RESTORES)
def test_a_sequence_restored_into_a_freed_cell_has_no_rollback_history(engine, via, dtype):
    """Restored into the cell of a dropped sequence whose window covers the same positions: the
    restored sequence can roll back to nothing before its own next step (SPEC §7: a placed state
    has no history), never to the dropped sequence's states."""
    h = Harness(new_cache(engine, dtype, 3, size=3), 3, with_c=via == "rc_state_read")
    prompt, other = (1, 2, 3, 0, 1, 2), (3, 3, 1, 0, 2, 2)
    feed(h, 1, prompt)
    blob, rows = h.cache.state_write(1), stores.sequence_rows(h.cache, 1)
    h.save(1)
    h.seq_rm(1, -1, -1, "Python")
    feed(h, 0, other)                       # same positions, another conversation
    feed(h, 0, [1])                         # its cell holds its states after 3, 4 and 5
    h.verify(h.cache.seq_rollback_min)
    cell = drop_leaving_its_history(h, 0, [2])
    if via == "PrefixCache.restore":
        h.restore(1, prompt + (0,))
    elif via == "stores.restore_rows":
        stores.restore_rows(h.cache, 1, len(prompt), *rows)
        h.oracle.place(1, prompt)
    else:
        h.state_read(blob, 1, "C" if via == "rc_state_read" else "Python")
        h.oracle.place(1, prompt)
    try:
        assert h.cache.cell(1)[2] == cell
        expect_no_rollback_into_the_past(h, 1)
        feed(h, 1, [2])                          # from here on the window is its own
        h.seq_rm(1, len(prompt), -1, "Python")
        h.verify(h.cache.seq_rollback_min)
        assert h.oracle.history[1] == prompt
    finally:
        h.close()


# -- Python then C, C then Python ----------------------------------------------------------------

@pytest.fixture
def mixed():
    h = Harness(new_cache("compiled", "f32", 3, size=2), 3, with_c=True)
    yield h
    h.close()


def c_rollback_min(h: Harness) -> Callable[[int], int]:
    return lambda seq: int(T.seq_rollback_min(h.ctx, seq))


def test_python_step_states_never_land_in_a_cell_c_gave_to_another_sequence(mixed):
    """The step states a model wrote through Python are filed for their own sequence, whichever API
    changes the cache next."""
    # the model writes seq 0's step states through Python; C drops seq 0 and gives its cell to
    # seq 1 at the same positions; whatever Python does next must not file seq 0's states there
    h = mixed
    feed(h, 0, [1, 2, 3, 0])
    h.seq_rm(0, -1, -1, "C")
    feed(h, 1, [3, 3, 2, 1], via="C")
    h.seq_rm(1, 2, -1, "Python")                 # back to the state after position 1: seq 1's own
    h.verify(h.cache.seq_rollback_min)
    h.verify(c_rollback_min(h))


def test_c_rolls_back_to_step_states_written_through_python(mixed):
    """Step states written through Python are held when C asks, as when Python asks."""
    h = mixed
    feed(h, 0, [1, 2, 3, 0])
    h.verify(c_rollback_min(h))
    h.seq_rm(0, 2, -1, "C")
    h.verify(c_rollback_min(h))


def test_python_rolls_back_to_step_states_written_through_c(mixed):
    """And the other way round."""
    h = mixed
    feed(h, 0, [1, 2, 3, 0], via="C")
    h.verify(h.cache.seq_rollback_min)
    h.seq_rm(0, 2, -1, "Python")
    h.verify(h.cache.seq_rollback_min)


def test_a_memory_state_is_stale_once_c_changed_the_cache(mixed):
    """A ``MemoryState`` prepared before a C call changed the cells must not apply on them."""
    h = mixed
    feed(h, 0, [1, 2])
    st = h.cache.init_batch(recurrent_cache.Batch(token=[3], pos=[2], seq_id=[0]))
    h.seq_rm(0, -1, -1, "C")
    feed(h, 1, [2, 2, 2], via="C")
    before = h.everything()
    with pytest.raises(recurrent_cache.UsageError):
        st.apply()
    h.expect_unchanged(before, "a stale MemoryState")
    h.verify(h.cache.seq_rollback_min)


def test_a_c_batch_is_stale_once_python_changed_the_cache(mixed):
    """A C batch prepared before a Python call changed the cells reports ``RC_ERR_STALE``."""
    h = mixed
    feed(h, 0, [1, 2])
    batch = P()
    assert T.batch_init(h.ctx, 1, ints([0]), None, ints([2]), None, 512, 0, ctypes.byref(batch)) == 0
    try:
        h.seq_rm(0, -1, -1, "Python")
        feed(h, 1, [2, 2, 2])
        before = h.everything()
        assert T.batch_apply(batch, ctypes.byref(Ubatch())) == CODES["RC_ERR_STALE"]
        h.expect_unchanged(before, "a stale C batch")
    finally:
        T.batch_release(batch)
    h.verify(h.cache.seq_rollback_min)


# -- restore_rows with rows that do not fit ------------------------------------------------------

def misfits(cache) -> dict[str, tuple[list[np.ndarray], list[np.ndarray]]]:
    """Rows for a state of ``cache`` that are wrong in one way each."""
    r = [host(tensor[0]) for tensor in cache.r]
    s = [host(tensor[0]) for tensor in cache.s]
    other = np.float16 if dtype_of(cache.s[0]) != np.float16 else np.float32
    return {
        "r one wider": ([np.zeros(cache.n_embd_r + 1, dtype_of(cache.r[0]))] * cache.n_layer, s),
        "last layer's s narrower": (r, s[:-1] + [np.zeros(cache.n_embd_s - 1, dtype_of(cache.s[0]))]),
        "f64 rows": ([row.astype(np.float64) for row in r], [row.astype(np.float64) for row in s]),
        "s rows of another dtype": (r, [np.zeros(cache.n_embd_s, other) for _ in s]),
        "a layer short": (r[:-1], s[:-1]),
        "a layer too many": (r + r[:1], s + s[:1]),
        "2-D rows": ([row[None] for row in r], s),
    }


@pytest.mark.parametrize("case", list(misfits(new_cache("compiled", "f32", 0))))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", VARIANTS)
def test_restore_rows_that_do_not_fit_change_nothing(engine, dtype, case):
    """Rows of the wrong width, dtype or layer count raise the package's error before anything
    changes: the cells, every row (the free cell's too) and every rollback window as they were."""
    h = Harness(new_cache(engine, dtype, 3, size=3), 3, with_c=False)
    feed(h, 0, [1, 2, 3, 0])
    feed(h, 1, [2, 1, 0, 3, 3])
    drop_leaving_its_history(h, 1, [2])
    r_rows, s_rows = misfits(h.cache)[case]
    before = h.everything()
    with pytest.raises(recurrent_cache.RecurrentCacheError):
        stores.restore_rows(h.cache, 1, 5, r_rows, s_rows)
    h.expect_unchanged(before, f"restore_rows with {case}")
    h.verify(h.cache.seq_rollback_min)


# -- saves and restores racing a decoding thread -----------------------------------------------

RACE_SECONDS = 1.0       # the threads race this long, and up to 3x longer while they have not met
STUCK_SECONDS = 20.0


class Contended:
    """Calls into a cache another thread uses: ``UsageError`` (the one-thread rule) is counted
    and the call repeated, since a call that raised has changed nothing."""

    def __init__(self) -> None:
        self.refused = 0

    def __call__(self, call: Callable[[], object]):
        give_up = time.monotonic() + STUCK_SECONDS
        while True:
            try:
                return call()
            except recurrent_cache.UsageError:
                self.refused += 1
                assert time.monotonic() < give_up, "a call was refused for 20 s"
                time.sleep(0)


def decode_step(cache, oracle: Oracle, seqs: Sequence[int], rng: random.Random, contended: Contended) -> None:
    """One token for each of ``seqs`` (one ubatch; one-token groups have no step states), the model
    writing the oracle's states into the sequences' cells.  A refused or stale ``apply`` is a retry
    of the whole step: it changed nothing."""
    tokens = [rng.randrange(VOCAB) for _ in seqs]
    batch = recurrent_cache.Batch(token=tokens, pos=[oracle.pos(s) + 1 for s in seqs], seq_id=list(seqs))
    while True:
        st = contended(lambda: cache.init_batch(batch, n_ubatch=8))
        assert st.status == recurrent_cache.MemoryStatus.SUCCESS
        try:
            st.apply()
            break
        except recurrent_cache.UsageError:
            contended.refused += 1
    for seq, token in zip(seqs, tokens):
        cell = contended(lambda seq=seq: cache.cell(seq)[2])
        before = oracle.history[seq]
        for k, tensor in enumerate(tensors(cache)):
            assert host(tensor[cell]).tobytes() == history_row(cache, k, before).tobytes(), (
                f"decoding seq {seq} starts from a state that is not its own")
            assign(tensor[cell], history_row(cache, k, before + (token,)))
        oracle.advance([seq], before, [token], 0)


def expect_state(cache, seq: int, history: tuple[int, ...], contended: Contended, what: str) -> None:
    cell = contended(lambda: cache.cell(seq)[2])
    src = contended(lambda: cache.cell(cell)[1])
    for k, tensor in enumerate(tensors(cache)):
        assert host(tensor[src]).tobytes() == history_row(cache, k, history).tobytes(), (
            f"{what}: seq {seq} tensor {k} holds {tensor[src].tolist()}, not the state of {history}")


def snapshots_held(pc) -> tuple[int, int]:
    stats = pc.stats()
    return stats["snapshots"], stats["bytes"]


@pytest.mark.parametrize("engine", VARIANTS)
def test_saves_and_restores_racing_a_decoding_thread(engine):
    """One thread decodes (and rolls back) sequences 0 and 1 while another grows sequence 2,
    saves each of its prefixes and restores them into sequence 3: a call refused by the
    one-thread rule changes nothing, and every snapshot held restores to its own prompt's state."""
    cache = new_cache(engine, "bf16", 3)
    pc = recurrent_cache.PrefixCache(cache, 1 << 20, block_size=4)
    decoding, saving = Oracle(3), Oracle(3)
    saved: set[tuple[int, ...]] = set()
    refused_saves: set[tuple[int, ...]] = set()
    contended_decode, contended_save = Contended(), Contended()
    failures: list[BaseException] = []
    start = time.monotonic()

    def racing() -> bool:
        elapsed = time.monotonic() - start
        met = contended_decode.refused + contended_save.refused + len(refused_saves)
        return elapsed < RACE_SECONDS or (not met and elapsed < 3 * RACE_SECONDS)

    def decoder() -> None:
        rng = random.Random(1)
        for seq in (0, 1):
            decoding.place(seq, ())
        for step in range(5000):
            if not racing():
                return
            decode_step(cache, decoding, (0, 1), rng, contended_decode)
            for seq in (0, 1):     # (its calls keep the cache busy for the other thread, too)
                expect_state(cache, seq, decoding.history[seq], contended_decode, "after a step")
            if step % 7 == 6:    # undo the last token: the state the cache filed when it was applied
                seq = step % 2
                assert contended_decode(lambda seq=seq: cache.seq_rm(seq, decoding.pos(seq), -1))
                assert decoding.seq_rm(seq, decoding.pos(seq), -1)
                expect_state(cache, seq, decoding.history[seq], contended_decode, "after a rollback")

    def saver() -> None:
        rng = random.Random(2)
        for step in range(5000):
            if not racing():
                return
            if saving.pos(2) >= 9:
                assert contended_save(lambda: cache.seq_rm(2, -1, -1))
                saving.drop(2)
            if 2 not in saving.history:
                saving.place(2, ())
            decode_step(cache, saving, (2,), rng, contended_save)
            key = saving.history[2]
            held = snapshots_held(pc)
            try:
                assert pc.save(2, list(key))
                saved.add(key)
            except recurrent_cache.UsageError:
                refused_saves.add(key)
                assert snapshots_held(pc) == held, "a refused save changed the snapshots held"
            if step % 3 == 2 and saved:
                tokens = rng.choice(sorted(saved | refused_saves)) + (rng.randrange(VOCAB),)
                try:
                    n = pc.restore(3, list(tokens))
                except recurrent_cache.UsageError:
                    assert contended_save(lambda: cache.seq_pos_max(3)) == -1, "a refused restore placed seq 3"
                    continue
                if n:
                    expect_state(cache, 3, tokens[:n], contended_save, f"restore of {tokens}")
                    assert contended_save(lambda: cache.seq_rm(3, -1, -1))

    def run(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:   # re-raised in the test's thread
            failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)        # switch threads often: inside the cache, not only between calls
    try:
        threads = [threading.Thread(target=run, args=(body,)) for body in (decoder, saver)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(3 * RACE_SECONDS + 2 * STUCK_SECONDS)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"
    if failures:
        raise failures[0]
    assert contended_decode.refused + contended_save.refused + len(refused_saves) > 0, "the threads never met"

    # every snapshot the prefix cache holds restores to the state of its own prompt
    assert pc.stats()["evictions"] == 0
    for key in sorted(saved | refused_saves):
        n = pc.restore(4, list(key) + [0])
        longest = max((len(p) for p in saved if key[:len(p)] == p), default=0)
        assert n == longest, f"restore of {key} matched {n} tokens; the longest saved prefix has {longest}"
        if n:
            expect_state(cache, 4, key[:n], Contended(), f"restore of {key} after the race")
            assert cache.seq_rm(4, -1, -1)
    for seq in (0, 1):
        expect_state(cache, seq, decoding.history[seq], Contended(), "the decoding thread's sequence")
    cache.check()


class Occupant:
    """Another thread inside the cache: it stays in a ``state_write_into`` until released.  If the
    cache is busy when it tries (the call that lets it in is inside the cache itself), it stays out."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.inside, self.kept_out, self.released = threading.Event(), threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.occupy)

    def occupy(self) -> None:
        try:
            self.cache.state_write_into(self)
        except recurrent_cache.UsageError:
            self.kept_out.set()

    def write(self, data) -> None:     # the file object the cache writes to: None means all written
        self.inside.set()
        self.released.wait(STUCK_SECONDS)

    def enter(self) -> None:
        self.thread.start()
        give_up = time.monotonic() + STUCK_SECONDS
        while not (self.inside.wait(0.001) or self.kept_out.is_set()):
            assert time.monotonic() < give_up, "the other thread neither entered the cache nor was refused"

    def leave(self) -> None:
        self.released.set()
        if self.thread.ident is not None:
            self.thread.join(STUCK_SECONDS)


class LetsAnotherThreadIn(int):
    """A seq id whose ``use``-th use (a conversion, comparison or hash) lets ``occupant`` into the
    cache: whatever the call does at that point, another thread is inside from then on."""

    def __new__(cls, value: int, use: int, occupant: Occupant) -> LetsAnotherThreadIn:
        seq = super().__new__(cls, value)
        seq.use, seq.uses, seq.occupant = use, 0, occupant
        return seq

    def used(self) -> None:
        self.uses += 1
        if self.uses == self.use:
            self.occupant.enter()

    def __int__(self) -> int:
        self.used()
        return int.__int__(self)

    def __index__(self) -> int:
        self.used()
        return int.__index__(self)

    def __hash__(self) -> int:
        self.used()
        return int.__hash__(self)

    def __eq__(self, other: object) -> bool:
        self.used()
        return int.__eq__(self, other)

    def __lt__(self, other: int) -> bool:
        self.used()
        return int.__lt__(self, other)

    def __le__(self, other: int) -> bool:
        self.used()
        return int.__le__(self, other)

    def __gt__(self, other: int) -> bool:
        self.used()
        return int.__gt__(self, other)

    def __ge__(self, other: int) -> bool:
        self.used()
        return int.__ge__(self, other)


@pytest.mark.parametrize("call", ["save", "restore"])
@pytest.mark.parametrize("engine", VARIANTS)
def test_a_prefix_cache_call_that_meets_another_thread_changes_nothing(engine, call):
    """Another thread enters the cache at every point of a ``save`` / ``restore`` in turn: the call
    either completes or raises ``UsageError`` having changed nothing — and every snapshot held
    afterwards restores to the state of its own prompt, never to a pool slot nobody filled."""
    prompt = (1, 2, 3, 0, 1)
    occupied = new_cache(engine, "f16", 0)
    occupant = Occupant(occupied)
    occupant.enter()
    try:
        assert occupant.inside.is_set()
        with pytest.raises(recurrent_cache.UsageError):
            occupied.seq_pos_max(0)             # the occupant really holds the cache
    finally:
        occupant.leave()
    for use in range(1, 40):
        h = Harness(new_cache(engine, "f16", 3, size=3), 3, with_c=False)
        feed(h, 0, prompt)
        if call == "restore":
            h.save(0)
        occupant = Occupant(h.cache)
        held, before = snapshots_held(h.prefix_cache), h.everything()
        seq = LetsAnotherThreadIn(0 if call == "save" else 1, use, occupant)
        try:
            if call == "save":
                h.save(seq)
            else:
                h.restore(seq, prompt + (2,))
            raised = False
        except recurrent_cache.UsageError:
            raised = True
        finally:
            occupant.leave()
        if raised:
            assert snapshots_held(h.prefix_cache) == held, f"a {call} refused at use {use} changed the snapshots"
            h.expect_unchanged(before, f"a {call} refused at use {use}")
        h.verify(h.cache.seq_rollback_min)
        if call == "save" or raised:
            h.restore(2, prompt + (3,))       # what is held is the prompt's state, or nothing
            h.verify(h.cache.seq_rollback_min)
        if seq.uses < use:                    # the call finished before its use-th use: every point met
            return
    raise AssertionError("a call used its seq id 40 times")


def test_a_c_context_over_null_is_refused_not_a_crash():
    """``rc_ctx_new(NULL)`` (a C caller's mistake) raises in the caller, in a child interpreter so
    that a crash fails this test instead of the suite."""
    child = subprocess.run(
        [sys.executable, "-c", "import ctypes, sys\n"
         f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
         "from capi_table import table\n"
         "try:\n"
         "    table().ctx_new(ctypes.py_object())\n"
         "except Exception as exc:\n"
         "    print(type(exc).__name__, exc)\n"
         "else:\n"
         "    print('accepted')\n"],
        capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, f"rc_ctx_new(NULL) killed the interpreter: status {child.returncode}"
    assert "accepted" not in child.stdout and child.stdout.strip(), child.stdout + child.stderr
