"""PrefixCache against a brute-force model: a dict of token tuples -> state rows.

A hypothesis state machine serves random requests (new prompts, prompts that
extend or branch off earlier ones, conversation turns) through a cache and a
PrefixCache, following ``plan`` and saving at every cut, with a fake model
whose state after a prefix identifies that prefix.  After every restore the
sequence holds exactly the rows the brute force recorded for that prefix, at
the right position; the prefix restored is the longest proper prefix among
the snapshots held (with an unbounded budget: among everything ever saved);
``plan`` gives every grid point, the end, and the deepest point where the
prompt leaves a remembered path.  Runs on both engines, and on torch storage.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import recurrent_cache
from variants import package_on
from recurrent_cache.prefix_cache import PrefixCache
from rows import host
from test_prefix_cache import N_EMBD_R, N_EMBD_S, N_LAYER, fake_state, prefill, snapshot_bytes

BLOCK = 3
N_SEQ = 3
tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=8)


def common(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCacheMachine(RuleBasedStateMachine):
    engine = recurrent_cache

    @initialize(capacity=st.sampled_from([1, 2, 5, 10_000]))
    def setup(self, capacity: int) -> None:
        self.cache = self.engine.RecurrentCache(N_LAYER, N_EMBD_R, N_EMBD_S, n_seq_max=N_SEQ)
        self.pc = PrefixCache(self.cache, capacity * snapshot_bytes(), block_size=BLOCK)
        self.unbounded = capacity == 10_000
        self.brute: dict[tuple, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self.history: list[tuple] = []   # every text served (prompt, and prompt + reply)

    def held_keys(self, ghosts: bool = False) -> set[tuple]:
        keys = set()
        stack = [self.pc._root]   # noqa: SLF001 - the model check walks the trie it checks
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for snapshot in node.tails.values():
                if snapshot.slot >= 0 or ghosts:
                    keys.add(tuple(self.pc._tokens_of(snapshot).tolist()))   # noqa: SLF001 - (the trie's keys)
        return keys

    def serve(self, seq: int, prompt: tuple, reply: tuple) -> None:
        cache, pc = self.cache, self.pc
        cache.seq_rm(seq, -1, -1)
        held = self.held_keys()
        remembered = self.held_keys(ghosts=True)
        assert held <= set(self.brute)
        expected = max((len(k) for k in held if len(k) < len(prompt) and prompt[:len(k)] == k), default=0)
        if self.unbounded:
            assert expected == max((len(k) for k in self.brute if len(k) < len(prompt) and prompt[:len(k)] == k),
                                   default=0)
        assert pc.match(prompt) == expected
        n = pc.restore(seq, prompt)
        assert n == expected
        if n:
            row = cache.cell(seq)[2]
            assert cache.seq_pos_max(seq) == n - 1
            r_rows, s_rows = self.brute[prompt[:n]]
            for il in range(N_LAYER):
                assert np.array_equal(host(cache.r[il][row]), r_rows[il])
                assert np.array_equal(host(cache.s[il][row]), s_rows[il])
        else:
            assert cache.cell(seq)[2] == -1
        cuts = pc.plan(prompt, n)
        assert cuts == sorted(set(cuts)) and all(n < c <= len(prompt) for c in cuts)
        assert cuts[-1] == len(prompt) and set(range(BLOCK * (n // BLOCK + 1), len(prompt) + 1, BLOCK)) <= set(cuts)
        leaves = [common(prompt, k) for k in remembered if common(prompt, k) < len(k)]
        deepest = max(leaves, default=0)
        if n < deepest < len(prompt):
            assert deepest in cuts, (prompt, remembered, cuts)
        for cut in cuts:   # every cut is the grid, the end, or where the prompt leaves a remembered path
            assert cut % BLOCK == 0 or cut == len(prompt) or cut in leaves
        done = n
        for cut in cuts:
            self.advance(seq, prompt, done, cut)
            done = cut
        whole = prompt + reply
        if reply:
            self.advance(seq, whole, len(prompt), len(whole))
        self.history += [prompt, whole]

    def advance(self, seq: int, text: tuple, start: int, end: int) -> None:
        prefill(recurrent_cache, self.cache, seq, list(text), start, end)
        row = self.cache.cell(seq)[2]
        self.brute[text[:end]] = ([host(self.cache.r[il][row]) for il in range(N_LAYER)],
                                  [host(self.cache.s[il][row]) for il in range(N_LAYER)])
        for il in range(N_LAYER):   # the fake model: the state identifies the prefix
            assert np.array_equal(self.brute[text[:end]][0][il], fake_state(text[:end], N_EMBD_R, il, "r"))
        self.pc.save(seq, list(text[:end]))

    @rule(seq=st.integers(0, N_SEQ - 1), prompt=tokens_strategy, reply=st.lists(st.integers(0, 2), max_size=3))
    def new_prompt(self, seq, prompt, reply):
        self.serve(seq, tuple(prompt), tuple(reply))

    @rule(seq=st.integers(0, N_SEQ - 1), data=st.data(), extra=tokens_strategy,
          reply=st.lists(st.integers(0, 2), max_size=3))
    def branch_or_next_turn(self, seq, data, extra, reply):
        """A prompt that shares a prefix (or all) of an earlier text: a branch, or the next turn."""
        if not self.history:
            return
        base = data.draw(st.sampled_from(self.history))
        keep = data.draw(st.integers(0, len(base)))
        self.serve(seq, base[:keep] + tuple(extra), tuple(reply))

    @invariant()
    def within_budget(self):
        if not hasattr(self, "pc"):
            return
        stats = self.pc.stats()
        assert stats["snapshots"] == len(self.held_keys()) <= self.pc.capacity
        assert stats["bytes"] == stats["snapshots"] * snapshot_bytes() <= self.pc.max_bytes
        assert stats["ghosts"] <= self.pc.max_ghosts
        self.cache.check()


class ReferencePrefixCacheMachine(PrefixCacheMachine):
    engine = package_on("reference")


class TorchPrefixCacheMachine(PrefixCacheMachine):
    engine = package_on("torch")


SETTINGS = settings(max_examples=int(os.environ.get("RECURRENT_CACHE_SM_EXAMPLES", "100")), stateful_step_count=30,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])
PrefixCacheMachine.TestCase.settings = SETTINGS
ReferencePrefixCacheMachine.TestCase.settings = SETTINGS
TorchPrefixCacheMachine.TestCase.settings = SETTINGS
TestPrefixCacheCore = PrefixCacheMachine.TestCase
TestPrefixCacheReference = ReferencePrefixCacheMachine.TestCase
TestPrefixCacheTorch = TorchPrefixCacheMachine.TestCase
