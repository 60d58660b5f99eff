"""Model-based test of the hybrid memory: random scripts through both engines, checked after every step.

A hypothesis ``RuleBasedStateMachine`` builds two ``HybridCache``s of one random shape — the
compiled engine and the reference — and drives the same script through both: batches of several
sequences split into ubatches of random size, forks, whole and partial removals, rollbacks, keeps,
shifts, clears, a sequence and the whole memory through their state bytes and back, prefixes kept
and restored into other sequences (``HybridPrefixCache``), and bad arguments.  The made-up model of
``hybrid_model`` writes every row, so after every rule:

- both engines hold the same cells in both halves and the same rows;
- both ``check()`` (each half's invariants, and that they agree on each sequence's last position);
- the history oracle: every sequence holds exactly the K, V, r and s rows of its own history.

A refused call (an exception, ``False``, a failed prepare) must leave both caches as they were.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from recurrent_cache.errors import NoFreeCellError
from recurrent_cache.hybrid import HybridCache
from recurrent_cache.hybrid_prefix import HybridPrefixCache
from recurrent_cache.memory_state import MemoryStatus

from hybrid_model import Histories, assert_holds_its_history, decode, same, snapshot

N_LAYER = 4
LAYOUTS = st.sampled_from([((1, 3), (0, 2)), ((0, 1, 2, 3), (1, 2)), ((2,), (0, 1, 3)), ((1,), (1,))])


def outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - both engines must raise the same
        return "raise", (type(exc), str(exc))


class HybridMachine(RuleBasedStateMachine):
    @initialize(layout=LAYOUTS, kv_size=st.integers(4, 40), n_seq_max=st.integers(1, 5),
                n_rollback=st.sampled_from([0, 0, 2, 4]), v_trans=st.booleans(),
                n_embd_s=st.sampled_from([3, 0]))   # 0: a conv-only recurrent state (LFM2)
    def build(self, layout, kv_size, n_seq_max, n_rollback, v_trans, n_embd_s):
        attn, recr = layout
        self.caches = [HybridCache(N_LAYER, attn_layers=attn, recr_layers=recr, n_embd_k=2, n_embd_v=3, n_embd_r=2,
                                   n_embd_s=n_embd_s, kv_size=kv_size, n_seq_max=n_seq_max, dtype_k="f32",
                                   dtype_v="f32", v_trans=v_trans, n_rollback=n_rollback, engine=engine)
                       for engine in ("compiled", "reference")]
        self.histories = [Histories(n_seq_max) for _ in self.caches]
        self.prefixes = [HybridPrefixCache(cache, 1 << 20, block_size=3) for cache in self.caches]
        self.next_token = 1

    def both(self, fn, changes=True):
        """``fn(cache, histories)`` on both engines: the same outcome; a refusal changes nothing."""
        before = [snapshot(cache) for cache in self.caches]
        results = [outcome(lambda c=cache, h=hist: fn(c, h)) for cache, hist in zip(self.caches, self.histories)]
        assert results[0] == results[1], results
        kind, value = results[0]
        if kind == "raise" or value is False or not changes:
            for cache, old in zip(self.caches, before):
                assert same(old, snapshot(cache)), f"a refused call changed the cache: {value}"
        return value

    @property
    def n_seq_max(self):
        return self.caches[0].n_seq_max

    @rule(data=st.data(), n_ubatch=st.integers(1, 6))
    def decode(self, data, n_ubatch):
        seqs = data.draw(st.lists(st.integers(0, self.n_seq_max - 1), min_size=1, max_size=3, unique=True))
        lengths = data.draw(st.lists(st.integers(1, 4), min_size=len(seqs), max_size=len(seqs)))
        tokens = {}
        for seq, n in zip(seqs, lengths):
            tokens[seq] = list(range(self.next_token, self.next_token + n))
            self.next_token += n

        def run(cache, histories):
            saved = histories.saved()
            state = decode(cache, histories, tokens, n_ubatch)
            if state.status is not MemoryStatus.SUCCESS:
                histories.restore(saved)
                return False
            return True
        self.both(run)

    @rule(data=st.data())
    def fork(self, data):
        src, dst = (data.draw(st.integers(0, self.n_seq_max - 1)) for _ in range(2))

        def run(cache, histories):
            cache.seq_rm(dst, -1, -1)
            histories.forget(dst)
            cache.seq_cp(src, dst)
            histories.copy(src, dst)
        self.both(run)

    @rule(data=st.data())
    def remove(self, data):
        seq = data.draw(st.integers(-1, self.n_seq_max))

        def run(cache, histories):
            removed = cache.seq_rm(seq, -1, -1)
            for s in (range(self.n_seq_max) if seq < 0 else [seq] if removed else []):
                histories.forget(s)
            return removed
        self.both(run)

    @rule(data=st.data())
    def take_back(self, data):
        """A rollback (``seq_rm(seq, p0, -1)``): both halves or neither."""
        seq = data.draw(st.integers(0, self.n_seq_max - 1))
        n = len(self.histories[0].of_seq[seq])
        p0 = data.draw(st.integers(0, n + 1))

        def run(cache, histories):
            removed = cache.seq_rm(seq, p0, -1)
            if removed:
                histories.keep_before(seq, p0)
            return removed
        self.both(run)

    @rule(data=st.data())
    def cut_the_middle(self, data):
        """Never possible for a recurrent state: refused, nothing changed."""
        seq = data.draw(st.integers(0, self.n_seq_max - 1))
        positions = self.histories[0].positions[seq]
        if positions and positions[-1] >= 2:   # [1, last) splits the state after the last position
            assert self.both(lambda cache, _: cache.seq_rm(seq, 1, positions[-1])) is False

    @rule(data=st.data())
    def keep(self, data):
        seq = data.draw(st.integers(0, self.n_seq_max - 1))

        def run(cache, histories):
            cache.seq_keep(seq)
            for s in range(self.n_seq_max):
                if s != seq:
                    histories.forget(s)
        self.both(run)

    @rule(data=st.data(), shift=st.one_of(st.integers(1, 5), st.integers(-3, -1), st.just(2**31 - 2)))
    def shift_the_end(self, data, shift):
        """The positions of a sequence sharing no KV cell move from p0 on (from 0 when moving down, so
        the order of its history holds); refused by either half, neither changes."""
        seq = data.draw(st.integers(0, self.n_seq_max - 1))
        cells = self.caches[0].seq_kv_cells(seq).tolist()
        if any(len(self.caches[0].kv_cell(c)[1]) > 1 for c in cells):
            return
        p0 = 0 if shift < 0 else data.draw(st.integers(0, 6))

        def run(cache, histories):
            cache.seq_add(seq, p0, -1, shift)
            histories.shift(seq, p0, shift)
            cache.kv_reset_shift()
        self.both(run)

    @rule(data=st.data(), framing=st.sampled_from(["bare", "llama"]))
    def move_a_sequence_through_its_bytes(self, data, framing):
        """A sequence written, removed and read back: it holds its own rows again (in cells of its own)."""
        seq = data.draw(st.integers(0, self.n_seq_max - 1))

        def run(cache, histories):
            blob = cache.state_write(seq, framing=framing)
            cache.seq_rm(seq, -1, -1)
            try:
                cache.state_read(blob, seq)
            except NoFreeCellError:   # its shared cells, now its own, fit nowhere: it is gone
                histories.forget(seq)
        self.both(run)

    @rule()
    def the_whole_memory_through_its_bytes(self):
        def run(cache, _):
            blob = cache.state_write(framing="llama", arch="jamba")
            cache.clear()
            assert cache.state_read(blob, arch="jamba") == len(blob)
        self.both(run)

    @rule(data=st.data())
    def keep_and_restore_a_prefix(self, data):
        """A sequence's prefix kept, then restored into an empty sequence, which then holds that history."""
        src = data.draw(st.integers(0, self.n_seq_max - 1))
        empty = [s for s in range(self.n_seq_max) if not self.histories[0].of_seq[s]]
        history = self.histories[0].of_seq[src]
        if not empty or not history or self.histories[0].positions[src] != list(range(len(history))):
            return
        dst = data.draw(st.sampled_from(empty))

        def run(cache, histories):
            prefixes = self.prefixes[self.caches.index(cache)]
            if not prefixes.save(src, list(history)):
                return False
            restored = prefixes.restore(dst, list(history))
            histories.copy(src, dst)
            return restored
        self.both(run)

    @rule()
    def clear(self):
        def run(cache, histories):
            cache.clear()
            for s in range(self.n_seq_max):
                histories.forget(s)
        self.both(run)

    @rule(seq=st.integers(-3, 9))
    def bad_sequence_ids(self, seq):
        if not 0 <= seq < self.n_seq_max:
            self.both(lambda cache, _: cache.seq_keep(seq), changes=False)
            self.both(lambda cache, _: cache.seq_cp(0, seq), changes=False)

    @invariant()
    def engines_agree_and_every_sequence_holds_its_own_history(self):
        if not hasattr(self, "caches"):
            return
        compiled, reference = self.caches
        a, b = snapshot(compiled), snapshot(reference)
        assert a[:-1] == b[:-1]
        for x, y in zip(a[-1], b[-1]):
            assert np.array_equal(x, y)
        for cache, histories in zip(self.caches, self.histories):
            cache.check()
            assert_holds_its_history(cache, histories)


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
