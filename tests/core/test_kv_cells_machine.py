"""Model-based test: the compiled KV cell table (``_kv_cells.KVCells``) against ``kv_reference.KVCells``.

A hypothesis ``RuleBasedStateMachine`` builds both tables with one random shape
(size, n_seq_max, sliding window of every type or none) and drives the same
random script through them: ubatches of many sequences (tokens shared by
several sequences, positions that continue a sequence or jump anywhere,
continuous slots), lone ``find_slot`` calls, every sequence operation with
partial ranges, ``seq_rm(-1)``, ``reset_shift``, ``clear``, ``prepare`` of a
batch split into ubatches (then applied at the slots it gave, against ``place``
of each ubatch), ``load`` of a whole context, ``load_seq`` of one sequence, and
bad arguments.
Every call must give the same result or the same exception with the same
message; a refused call (an exception, or no slot) must leave both tables as
they were.  After every rule the invariant compares every cell, ``head``,
``used``, the shifts and each sequence's ``seq_pos_min`` / ``max``, runs both
``check()``s, and compares the masks of the last ubatch (with and without the
window, at llama.cpp's padding and at other widths).
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, assume, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from recurrent_cache import kv_reference
from recurrent_cache._kv_cells import KVCells as CompiledCells

SIZES = st.one_of(st.integers(1, 8), st.integers(9, 40), st.integers(41, 100))
N_SEQ_MAX = st.one_of(st.integers(1, 4), st.integers(5, 16), st.integers(64, 70))   # one and two bitset words
WINDOWS = st.one_of(st.just(("none", 0)), st.tuples(st.sampled_from(["standard", "chunked", "symmetric"]),
                                                    st.integers(1, 9)))
BOUND = st.one_of(st.just(-1), st.integers(0, 40), st.integers(-5, -2))


def call(fn):
    """("ok", result) or ("raise", exception)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - every exception must match between the two tables
        return "raise", exc


def state(table):
    return (table.cells(), table.head, table.used, table.used_max_p1, table.has_shift, table.shifts().tolist(),
            [(table.seq_pos_min(s), table.seq_pos_max(s), table.seq_cells(s).tolist()) for s in range(table.n_seq_max)])


def arrays(pos, seq_ids):
    """Tokens in place_arrays's encoding: positions, seq ids one after the other, offsets."""
    lengths = [len(ids) for ids in seq_ids]
    offsets = np.zeros(len(pos) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.asarray([seq for ids in seq_ids for seq in ids], np.int32)
    return np.asarray(pos, np.int32), flat, offsets


class KVCellsMachine(RuleBasedStateMachine):
    @initialize(size=SIZES, n_seq_max=N_SEQ_MAX, window=WINDOWS)
    def build(self, size, n_seq_max, window):
        swa_type, n_swa = window
        self.compiled = CompiledCells(size, n_seq_max, n_swa, swa_type)
        self.reference = kv_reference.KVCells(size, n_seq_max, n_swa, swa_type)
        self.last_ubatch = None

    def both(self, name, *args, refused_if_none=False):
        """Call ``name`` on both tables: the same outcome, and a refused call changes nothing."""
        before = state(self.reference)
        outcomes = [call(lambda table=table: getattr(table, name)(*args)) for table in (self.compiled,
                                                                                     self.reference)]
        (kind_c, got_c), (kind_r, got_r) = outcomes
        assert kind_c == kind_r, (name, args, outcomes)
        if kind_c == "raise":
            assert type(got_c) is type(got_r) and str(got_c) == str(got_r), (name, args, outcomes)
        elif isinstance(got_r, (np.ndarray, list)) or isinstance(got_c, (np.ndarray, list)):
            assert got_c is not None and got_r is not None, (name, args, outcomes)
            slots_c, slots_r = (got_c, got_r) if isinstance(got_r, list) else ([got_c], [got_r])
            assert all(c.dtype == r.dtype == np.int32 for c, r in zip(slots_c, slots_r)), (name, args)
            assert [c.tolist() for c in slots_c] == [r.tolist() for r in slots_r], (name, args, outcomes)
        else:
            assert got_c == got_r, (name, args, outcomes)
        if kind_c == "raise" or (refused_if_none and got_r is None):
            assert state(self.reference) == before == state(self.compiled), (name, args)
        return kind_r, got_r

    def seq(self, data, valid=True):
        n = self.reference.n_seq_max
        if valid:
            return data.draw(st.integers(0, n - 1), label="seq")
        return data.draw(st.one_of(st.integers(0, n - 1), st.integers(-3, -1), st.integers(n, n + 3),
                                   st.just(2**31)), label="seq")

    def seq32(self, data):
        """A seq id an int32 array can hold, in range or not."""
        n = self.reference.n_seq_max
        return data.draw(st.one_of(st.integers(0, n - 1), st.integers(-3, -1), st.integers(n, n + 3)), label="seq")

    def tokens(self, data):
        """A ubatch: per token its position and seq ids (first the one whose row it is)."""
        n_seq_max = self.reference.n_seq_max
        n_tokens = data.draw(st.integers(1, min(12, self.reference.size + 2)), label="n_tokens")
        next_pos = {}
        pos, seq_ids = [], []
        for _ in range(n_tokens):
            owner = self.seq(data)
            if owner not in next_pos:
                next_pos[owner] = self.reference.seq_pos_max(owner) + 1
            if data.draw(st.integers(0, 9), label="jump") == 0:
                next_pos[owner] = data.draw(st.integers(0, 60), label="pos")
            ids = [owner]
            if n_seq_max > 1 and data.draw(st.integers(0, 5), label="shared") == 0:
                ids += [s for s in data.draw(st.sets(st.integers(0, n_seq_max - 1), max_size=3)) if s != owner]
            pos.append(next_pos[owner])
            seq_ids.append(ids)
            next_pos[owner] += 1
        return pos, seq_ids

    @rule(data=st.data())
    def decode(self, data):
        pos, seq_ids = self.tokens(data)
        cont = data.draw(st.integers(0, 7), label="cont") == 0
        self.placed(self.both("place", pos, seq_ids, cont, refused_if_none=True), pos, seq_ids)

    @rule(data=st.data())
    def decode_one_token_per_sequence(self, data):
        seqs = data.draw(st.lists(st.integers(0, self.reference.n_seq_max - 1), min_size=1, max_size=8,
                                  unique=True), label="seqs")
        pos = [self.reference.seq_pos_max(s) + 1 for s in seqs]
        outcome = self.both("place", np.asarray(pos, np.int32), np.asarray(seqs, np.int32), refused_if_none=True)
        self.placed(outcome, pos, seqs)

    def placed(self, outcome, pos, seq_ids):
        """Remember a placed ubatch: the mask invariant checks its mask from now on."""
        if outcome[0] == "ok" and outcome[1] is not None:
            self.last_ubatch = (pos, seq_ids)

    @rule(data=st.data())
    def find_slot_alone(self, data):
        pos, seq_ids = self.tokens(data)
        self.both("find_slot", pos, seq_ids, data.draw(st.booleans(), label="cont"), refused_if_none=True)

    @rule(data=st.data())
    def apply_chosen_cells(self, data):
        """apply with cells the caller picked: refused when a cell is out of range, repeated or shared."""
        pos, seq_ids = self.tokens(data)
        size = self.reference.size
        cells = data.draw(st.lists(st.integers(-1, size), min_size=len(pos), max_size=len(pos) + 1), label="cells")
        self.both("apply", cells, pos, seq_ids)

    @rule(data=st.data(), p0=BOUND, p1=BOUND)
    def seq_rm(self, data, p0, p1):
        seq = data.draw(st.sampled_from([-1, -2]), label="seq") if data.draw(st.booleans()) else self.seq(data, False)
        self.both("seq_rm", seq, p0, p1)

    @rule(data=st.data(), p0=BOUND, p1=BOUND)
    def seq_cp(self, data, p0, p1):
        self.both("seq_cp", self.seq(data, valid=False), self.seq(data), p0, p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        self.both("seq_keep", self.seq(data, valid=False))

    @rule(data=st.data(), p0=BOUND, p1=BOUND,
          delta=st.one_of(st.integers(-12, 12), st.just(2**31 - 2), st.just(-(2**31)), st.just(2**31)))
    def seq_add(self, data, p0, p1, delta):
        self.both("seq_add", self.seq(data, valid=False), p0, p1, delta)

    @rule(data=st.data(), p0=BOUND, p1=BOUND, d=st.integers(-1, 5))
    def seq_div(self, data, p0, p1, d):
        self.both("seq_div", self.seq(data, valid=False), p0, p1, d)

    @rule(data=st.data())
    def bad_ubatch(self, data):
        """Positions out of range, a seq id listed twice or out of range, an empty token, mismatched lengths."""
        pos, seq_ids = self.tokens(data)
        which = data.draw(st.integers(0, 4), label="defect")
        token = data.draw(st.integers(0, len(pos) - 1), label="token")
        if which == 0:
            pos[token] = data.draw(st.sampled_from([-1, 2**31 - 1, 2**31, -(2**40)]))
        elif which == 1:
            seq_ids[token] = seq_ids[token] + [seq_ids[token][0]]
        elif which == 2:
            seq_ids[token] = [self.seq(data, valid=False)]
        elif which == 3:
            seq_ids[token] = []
        else:
            pos = pos + [0]
        self.both(data.draw(st.sampled_from(["place", "find_slot"])), pos, seq_ids)

    @rule(data=st.data())
    def prepare(self, data):
        """A batch cut into ubatches: prepare changes nothing; then each ubatch applied at its slot in
        the compiled table gives the table ``place`` of each in turn gives the reference."""
        pos, seq_ids = self.tokens(data)
        assume(max(pos) < 2**31)          # the arrays are int32 (a shifted sequence may continue past it)
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(pos) - 1)), max_size=3), label="cuts") - {len(pos)})
        pieces = list(zip([0, *cuts], [*cuts, len(pos)]))
        ubatches = [arrays(pos[start:end], seq_ids[start:end]) for start, end in pieces]
        before = state(self.reference)
        kind, slots = self.both("prepare", ubatches)
        assert state(self.reference) == before == state(self.compiled)
        if kind != "ok" or slots is None or data.draw(st.integers(0, 3), label="apply") == 0:
            return
        for (start, end), slot in zip(pieces, slots):
            self.compiled.apply(slot, pos[start:end], seq_ids[start:end])
            assert self.reference.place(pos[start:end], seq_ids[start:end]).tolist() == slot.tolist()
        self.last_ubatch = (pos[pieces[-1][0]:], seq_ids[pieces[-1][0]:])

    @rule(data=st.data())
    def prepare_bad(self, data):
        """No ubatch, a ubatch that is not a triple, or a bad token in some ubatch: refused, nothing changed."""
        pos, seq_ids = self.tokens(data)
        assume(max(pos) < 2**31)
        ubatches = [arrays(pos, seq_ids), arrays(pos, seq_ids)]
        which = data.draw(st.integers(0, 4), label="defect")
        if which == 0:
            ubatches = []
        elif which == 1:
            ubatches[1] = ubatches[1][:2]
        elif which == 2:
            ubatches[1][0][-1] = data.draw(st.sampled_from([-1, 2**31 - 1]))
        elif which == 3:
            ubatches[1][1][0] = self.seq32(data)
        else:
            ubatches[0] = (ubatches[0][0], ubatches[0][1], ubatches[0][2][:-1])
        self.both("prepare", ubatches)

    @rule(data=st.data())
    def load(self, data):
        """A whole context: any cells, several sequences per cell; sometimes too many, or a bad one."""
        size, n_seq_max = self.reference.size, self.reference.n_seq_max
        n = data.draw(st.one_of(st.integers(0, size), st.just(size + 1)), label="n_cells")
        pos = data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n), label="pos")
        seq_ids = [sorted(data.draw(st.sets(st.integers(0, n_seq_max - 1), min_size=1, max_size=3), label="ids"))
                   for _ in range(n)]
        if n and data.draw(st.integers(0, 4), label="defect") == 0:
            cell = data.draw(st.integers(0, n - 1), label="cell")
            seq_ids[cell] = data.draw(st.sampled_from([[self.seq32(data)], seq_ids[cell] * 2]))
            pos[cell] = data.draw(st.sampled_from([pos[cell], -1, 2**31 - 1]))
        self.both("load", *arrays(pos, seq_ids))
        if n and data.draw(st.integers(0, 4), label="empty cell") == 0:
            positions, flat, offsets = arrays(pos, seq_ids)
            first = offsets[1]                 # cell 0 lists no sequence
            self.both("load", positions, flat[first:], np.concatenate([[0, 0], offsets[2:] - first]).astype(np.int32))

    @rule(data=st.data())
    def load_seq(self, data):
        """One sequence's cells: a run of positions, or any; sometimes more than fit, or none."""
        seq = self.seq(data, valid=False)
        n = data.draw(st.one_of(st.integers(0, 6), st.integers(0, self.reference.size + 2)), label="n_cells")
        if data.draw(st.booleans(), label="run"):
            first = data.draw(st.integers(0, 40), label="first")
            pos = list(range(first, first + n))
        else:
            pos = data.draw(st.lists(st.one_of(st.integers(0, 60), st.just(-1)), min_size=n, max_size=n), label="pos")
        self.both("load_seq", seq, np.asarray(pos, np.int64), refused_if_none=True)

    @rule()
    def reset_shift(self):
        self.both("reset_shift")

    @precondition(lambda self: self.reference.used > 0)
    @rule(data=st.data())
    def clear(self, data):
        if data.draw(st.integers(0, 5), label="clear") == 0:
            self.both("clear")

    @invariant()
    def tables_agree(self):
        assert state(self.compiled) == state(self.reference)
        self.compiled.check()
        self.reference.check()
        for pad in (1, 7, 256):
            assert self.compiled.n_kv(pad) == self.reference.n_kv(pad)

    @invariant()
    def masks_agree(self):
        if self.last_ubatch is None:
            return
        pos, seq_ids = self.last_ubatch
        for n_kv in {self.reference.n_kv(), self.reference.size}:
            for sliding in (True, False):
                got = np.full((len(pos), n_kv), 7.0, np.float32)
                want = got.copy()
                self.compiled.mask(pos, seq_ids, got, sliding)
                self.reference.mask(pos, seq_ids, want, sliding)
                assert np.array_equal(got, want), (n_kv, sliding)


TestKVCellsMachine = KVCellsMachine.TestCase
TestKVCellsMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
