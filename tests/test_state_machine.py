"""Model-based test: the package's ``RecurrentCache`` against the pure-Python reference.

A hypothesis ``RuleBasedStateMachine`` builds one cache of each implementation
with the same random shape and applies the same random operations to both:
prompts, decode steps, shared prompts, forks, removals, seq_keep, seq_add /
seq_div, clear, init_full and invalid operations.  After every applied ubatch it
compares the ubatch, the copy plan, the cells and every state byte, then writes
the same deterministic values into the group rows of both caches (standing in
for the model's forward pass); after every rule the invariant compares the
whole cache and runs both ``check()``s.

Operations are generated from the live sequences of the reference cache, so
most of them are valid and the machine gets deep into interesting cell tables
(shared cells, wrap-around, gathers) instead of bouncing off input checks.

When the package is run with RECURRENT_CACHE_IMPL=reference both sides are the
reference; the test then only checks the invariants.
"""

from __future__ import annotations


import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import recurrent_cache
import recurrent_cache.reference as reference
from golden import formula, store

DTYPES = st.sampled_from(["f32", "f16", "bf16"])
# Mostly tiny caches, where sequences collide, cells wrap around and gathers swap;
# sometimes big ones, up to 512 cells.
SIZES = st.one_of(st.integers(1, 4), st.integers(1, 8), st.integers(5, 24), st.integers(25, 512))
N_UBATCH = st.one_of(st.integers(1, 4), st.just(512), st.integers(5, 16))
BUILTINS = (recurrent_cache.RecurrentCacheError, ValueError, IndexError, TypeError, RuntimeError)


def call(fn):
    """Run ``fn``; return ("ok", result) or ("raise", exception)."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - every exception must match between the two
        return "raise", exc


def normal_cell(cell):
    pos, src, tail, ids = cell
    return int(pos), int(src), int(tail), tuple(sorted(int(s) for s in ids))


def snapshot(cache):
    return {
        "cells": [normal_cell(cache.cell(i)) for i in range(cache.size)],
        "head": cache.head,
        "used": cache.used,
        "n": cache.n,
        "r": [np.ascontiguousarray(a).tobytes() for a in cache.r],
        "s": [np.ascontiguousarray(a).tobytes() for a in cache.s],
    }


def ubatch_fields(ub):
    return {
        "n_tokens": int(ub.n_tokens),
        "n_seq_tokens": int(ub.n_seq_tokens),
        "n_seqs": int(ub.n_seqs),
        "token": None if ub.token is None else np.asarray(ub.token).tolist(),
        "embd": None if ub.embd is None else np.asarray(ub.embd).tolist(),
        "pos": np.asarray(ub.pos).tolist(),
        "seq_id": tuple(tuple(int(s) for s in ids) for ids in ub.seq_id),
        "output": [bool(x) for x in ub.output],
        "batch_index": np.asarray(ub.batch_index).tolist(),
    }


class CoreMatchesReference(RuleBasedStateMachine):
    # -- setup -------------------------------------------------------------------

    @initialize(size=SIZES, n_layer=st.integers(0, 2), n_embd_r=st.integers(1, 4),
                n_embd_s=st.integers(1, 4), dtype_r=DTYPES, dtype_s=DTYPES, data=st.data())
    def build(self, size, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, data):
        kwargs = dict(n_layer=n_layer, n_embd_r=n_embd_r, n_embd_s=n_embd_s,
                      dtype_r=dtype_r, dtype_s=dtype_s)
        if data.draw(st.booleans(), label="explicit size"):
            kwargs.update(n_seq_max=data.draw(st.integers(0, size), label="n_seq_max"), size=size)
        else:
            kwargs.update(n_seq_max=size)  # size defaults to max(1, n_seq_max)
        # looked up at run time, so a test can swap in another implementation
        self.core = recurrent_cache.RecurrentCache(**kwargs)
        self.ref = reference.RecurrentCache(**kwargs)
        self.pairs = ((recurrent_cache, self.core), (reference, self.ref))
        self.size = size
        self.step = 0  # seeds the values written after each ubatch
        assert self.core.size == self.ref.size == size

    # -- helpers -----------------------------------------------------------------

    def live(self):
        """seq -> pos of every sequence that has a cell, read from the reference."""
        found = {}
        for c in range(self.size):
            pos, _src, _tail, ids = self.ref.cell(c)
            for s in ids:
                found[s] = pos
        return found

    def both(self, op, what):
        """Apply ``op(impl, cache)`` to both; the outcomes must match; a raise changes nothing."""
        before = [snapshot(cache) for _, cache in self.pairs]
        outcomes = [call(lambda impl=impl, cache=cache: op(impl, cache)) for impl, cache in self.pairs]
        self.same_outcome(outcomes, what)
        if outcomes[0][0] == "raise":
            for name, snap, (_, cache) in zip(("core", "reference"), before, self.pairs):
                assert snapshot(cache) == snap, f"{what}: the {name} changed the cache before raising"
        return outcomes

    @staticmethod
    def same_outcome(outcomes, what):
        (kind_a, a), (kind_b, b) = outcomes
        assert kind_a == kind_b, f"{what}: core {kind_a} {a!r} but reference {kind_b} {b!r}"
        if kind_a == "raise":
            note(f"{what} raised {type(a).__name__}: {a}")
            assert type(a).__name__ == type(b).__name__, f"{what}: core {a!r} vs reference {b!r}"
            for builtin in BUILTINS:
                assert isinstance(a, builtin) == isinstance(b, builtin), f"{what}: {a!r} vs {b!r}"
            assert isinstance(a, recurrent_cache.RecurrentCacheError), f"{what}: core raised {a!r}"
        elif not isinstance(a, (reference.MemoryState, getattr(recurrent_cache, "MemoryState", ()))):
            assert a == b, f"{what}: core returned {a!r}, reference {b!r}"

    def compare_caches(self, what):
        a, b = snapshot(self.core), snapshot(self.ref)
        for key in ("cells", "head", "used", "n"):
            assert a[key] == b[key], f"{what}: {key}\n core      {a[key]}\n reference {b[key]}"
        for key in ("r", "s"):
            assert len(a[key]) == len(b[key]), f"{what}: number of {key} layers"
            for il, (x, y) in enumerate(zip(a[key], b[key])):
                assert x == y, f"{what}: bytes of {key}[{il}] differ"

    # -- batches -----------------------------------------------------------------

    def draw_batch(self, data, decode=True, prompts=True, shared=True):
        """A valid batch: (seq-id tuple, pos) per token, in a random token order."""
        live = self.live()
        taken = set()
        entries = []
        if decode and live:
            seqs = data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1, max_size=4,
                                      unique=True), label="decode")
            for s in seqs:
                n = data.draw(st.integers(1, 3), label=f"tokens of {s}")
                entries += [((s,), live[s] + 1 + k) for k in range(n)]
                taken.add(s)
        free = [s for s in range(self.size) if s not in live]
        if prompts and free:
            seqs = data.draw(st.lists(st.sampled_from(free), max_size=3, unique=True), label="prompts")
            for s in seqs:
                start = data.draw(st.sampled_from([0, 0, 0, 2]), label=f"start of {s}")
                n = data.draw(st.sampled_from([1, 1, 2, 3, 5]), label=f"tokens of {s}")
                entries += [((s,), start + k) for k in range(n)]
                taken.add(s)
        if shared:
            entries += self.draw_shared(data, live, taken)
        return entries

    def draw_shared(self, data, live, taken):
        """A prompt shared by several sequences: live ones at one pos and/or new ones,
        then optionally a few own tokens per member."""
        by_pos = {}
        for s, p in live.items():
            if s not in taken:
                by_pos.setdefault(p, []).append(s)
        free = [s for s in range(self.size) if s not in live and s not in taken]
        members = []
        base = -1
        if by_pos and data.draw(st.booleans(), label="shared with live sequences"):
            base = data.draw(st.sampled_from(sorted(by_pos)), label="shared base pos")
            members += data.draw(st.lists(st.sampled_from(by_pos[base]), min_size=1, unique=True),
                                 label="live members")
        if free:
            members += data.draw(st.lists(st.sampled_from(free), max_size=3, unique=True),
                                 label="new members")
        if len(members) < 2:
            return []
        members = data.draw(st.permutations(members), label="shared seq-id order (owner first)")
        length = data.draw(st.integers(1, 3), label="shared length")
        entries = [(tuple(members), base + 1 + k) for k in range(length)]
        for s in members:
            n = data.draw(st.integers(0, 2), label=f"own tokens of {s}")
            entries += [((s,), base + 1 + length + k) for k in range(n)]
        return entries

    def make_batch_kwargs(self, data, entries):
        order = data.draw(st.permutations(range(len(entries))), label="token order")
        entries = [entries[i] for i in order]
        n = len(entries)
        kwargs = {}
        if data.draw(st.booleans(), label="embeddings"):
            kwargs["embd"] = (np.arange(n * 2, dtype=np.float32).reshape(n, 2) + self.step) / 4
        else:
            kwargs["token"] = [(self.step * 7 + i) % 1000 for i in range(n)]
        pos = [p for _, p in entries]
        kwargs["pos"] = np.array(pos, dtype=np.int32) if data.draw(st.booleans(), label="np pos") else pos
        if all(len(ids) == 1 for ids, _ in entries):
            form = data.draw(st.sampled_from(["array", "ints", "lists"]), label="seq_id form")
            ids = [ids[0] for ids, _ in entries]
            kwargs["seq_id"] = {"array": np.array(ids, dtype=np.int32), "ints": ids,
                                "lists": [[s] for s in ids]}[form]
        else:
            kwargs["seq_id"] = [list(ids) for ids, _ in entries]
        flags = data.draw(st.sampled_from(["default", "explicit"]), label="logits")
        if flags == "explicit":
            kwargs["logits"] = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="flags")
        return kwargs

    def draw_options(self, data):
        return dict(n_ubatch=data.draw(N_UBATCH, label="n_ubatch"),
                    embd_pooled=data.draw(st.booleans(), label="embd_pooled"),
                    logits_all=data.draw(st.sampled_from([False, False, True]), label="logits_all"))

    def run_batch(self, data, kwargs, options, expect=None):
        """init_batch on both; apply (some of) the ubatches in lockstep, comparing everything."""
        outcomes = self.both(lambda impl, cache: cache.init_batch(impl.Batch(**kwargs), **options),
                             f"init_batch({kwargs}, {options})")
        if expect is not None:
            assert outcomes[0][0] == expect, f"init_batch({kwargs}, {options}): expected {expect}, got {outcomes[0]}"
        if outcomes[0][0] == "raise":
            event("batch rejected")
            return
        event("batch accepted")
        sa, sb = outcomes[0][1], outcomes[1][1]
        assert int(sa.status) == int(sb.status) and sa.status.name == sb.status.name
        if sb.status != reference.MemoryStatus.SUCCESS:
            event("FAILED_PREPARE")
            return
        stop_after = data.draw(st.one_of(st.none(), st.none(), st.integers(0, 3)), label="abandon after")
        style = data.draw(st.sampled_from(["apply/next", "for ub in st"]), label="style")
        done = 0
        finished = False
        if style == "for ub in st":
            ia, ib = iter(sa), iter(sb)
            while stop_after is None or done < stop_after:
                ua, ub = next(ia, None), next(ib, None)
                assert (ua is None) == (ub is None), f"ubatch {done}: iteration lengths differ"
                if ua is None:
                    finished = True
                    break
                self.after_apply(sa, sb, done)
                done += 1
        else:
            while stop_after is None or done < stop_after:
                sa.apply()
                sb.apply()
                self.after_apply(sa, sb, done)
                done += 1
                more = sa.next()
                assert more == sb.next(), f"ubatch {done}: next() differs"
                if not more:
                    finished = True
                    break
        if finished:
            a, b = sa.out_ids, sb.out_ids
            assert a.dtype == np.int64, a.dtype
            assert a.tolist() == b.tolist(), f"out_ids {a.tolist()} != {b.tolist()}"
        else:
            event("state abandoned")

    def after_apply(self, sa, sb, k):
        what = f"ubatch {k}"
        ua, ub = ubatch_fields(sa.ubatch), ubatch_fields(sb.ubatch)
        assert ua == ub, f"{what}:\n core      {ua}\n reference {ub}"
        assert (sa.head, sa.n_kv) == (sb.head, sb.n_kv), f"{what}: plan head/n_kv"
        assert np.asarray(sa.copy_src).tolist() == np.asarray(sb.copy_src).tolist(), f"{what}: copy_src"
        assert [bool(z) for z in sa.zero] == [bool(z) for z in sb.zero], f"{what}: zero"
        assert (self.core.head, self.core.n) == (sa.head, sa.n_kv), f"{what}: cache head/n vs plan"
        self.compare_caches(what)
        n_seqs = ua["n_seqs"]
        for il in range(self.core.n_layer):
            for views, cache in ((sa, self.core), (sb, self.ref)):
                for tensor, rows in ((views.r(il), cache.r[il]), (views.s(il), cache.s[il])):
                    assert np.asarray(tensor)[:n_seqs].tobytes() == \
                        rows[views.head:views.head + n_seqs].tobytes(), f"{what}: st.r/st.s views"
        # the model writes each group's new state into row head + s
        for _, cache in self.pairs:
            for s in range(n_seqs):
                for il in range(cache.n_layer):
                    store(cache.r[il][sa.head + s], formula(self.step, s, il, 0, cache.n_embd_r))
                    store(cache.s[il][sa.head + s], formula(self.step, s, il, 1, cache.n_embd_s))
        self.step += 1

    # -- rules: batches ------------------------------------------------------------

    @rule(data=st.data())
    def continuous_batch(self, data):
        entries = self.draw_batch(data)
        if not entries:
            entries = [((0,), self.ref.seq_pos_max(0) + 1)]
        self.run_batch(data, self.make_batch_kwargs(data, entries), self.draw_options(data), expect="ok")

    @rule(data=st.data())
    def prompts_only(self, data):
        entries = self.draw_batch(data, decode=False, shared=data.draw(st.booleans()))
        if entries:
            self.run_batch(data, self.make_batch_kwargs(data, entries), self.draw_options(data), expect="ok")

    @rule(data=st.data())
    def decode_every_sequence(self, data):
        live = self.live()
        if not live:
            return
        entries = [((s,), p + 1) for s, p in sorted(live.items())]
        self.run_batch(data, self.make_batch_kwargs(data, entries), self.draw_options(data), expect="ok")

    @rule(data=st.data(), n=st.integers(1, 4))
    def default_batch_continues_seq_0(self, data, n):
        kwargs = {"token": list(range(n))}
        if data.draw(st.booleans(), label="explicit logits"):
            kwargs["logits"] = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
        self.run_batch(data, kwargs, self.draw_options(data), expect="ok")

    # -- rules: sequence operations --------------------------------------------------

    def by_cell(self):
        """Owners of the non-empty cells, lowest cell first."""
        return [min(ids) for ids in (self.ref.cell(c)[3] for c in range(self.size)) if ids]

    def any_seq(self, data, label):
        live = sorted(self.live())
        options = [st.integers(-1, self.size), st.integers(-3, self.size + 3)]
        if live:
            # a sequence of the lowest / highest cell: removing low cells while high ones
            # keep decoding leaves head far above used, where find_slot's search restarts at 0
            edges = self.by_cell()
            options = [st.sampled_from(live)] * 3 + [st.sampled_from([edges[0], edges[-1]])] * 2 + options
        return data.draw(st.one_of(options), label=label)

    @rule(data=st.data())
    def fork(self, data):
        src = self.any_seq(data, "src")
        dst = data.draw(st.integers(-1, self.size), label="dst")
        p0, p1 = data.draw(st.integers(-1, 5)), data.draw(st.integers(-1, 5))
        self.both(lambda impl, c: c.seq_cp(src, dst, p0, p1), f"seq_cp({src}, {dst}, {p0}, {p1})")

    @rule(data=st.data())
    def remove(self, data):
        seq = self.any_seq(data, "seq")
        pos = self.live().get(seq, 3)
        ends = st.sampled_from([-1, 0, pos, pos + 1, max(pos - 1, 0)]) | st.integers(-2, 8)
        if seq < 0 and data.draw(st.booleans(), label="whole-cache form"):
            p0, p1 = data.draw(st.sampled_from([(-1, -1), (0, -1), (-5, -1), (2, 2)]), label="range")
        else:
            p0, p1 = data.draw(ends, label="p0"), data.draw(ends, label="p1")
        outcomes = self.both(lambda impl, c: c.seq_rm(seq, p0, p1), f"seq_rm({seq}, {p0}, {p1})")
        if outcomes[0][0] == "ok":
            event(f"seq_rm -> {outcomes[0][1]}")

    @rule(data=st.data())
    def finish_oldest(self, data):
        """The sequences of the lowest cells finish (a server's usual pattern). The rest
        then decode from high cells, leaving head far above used: the case where
        find_slot restarts its search at 0 (SPEC §2 step 1)."""
        owners = self.by_cell()
        if len(owners) < 2:
            return
        n = len(owners)
        k = data.draw(st.integers(max(1, n - 2), n - 1) | st.integers(1, n - 1), label="finished")
        for seq in owners[:k]:
            self.both(lambda impl, c, seq=seq: c.seq_rm(seq, -1, -1), f"seq_rm({seq}, -1, -1)")

    @rule(data=st.data())
    def keep(self, data):
        if data.draw(st.integers(0, 2), label="keep gate"):
            return  # rarely: it empties most of the cache
        seq = data.draw(st.sampled_from(self.by_cell()[-1:] or [0]) | st.integers(0, self.size - 1),
                        label="kept seq")
        self.both(lambda impl, c: c.seq_keep(seq), f"seq_keep({seq})")

    @rule(data=st.data())
    def shift(self, data):
        live = self.live()
        seq = self.any_seq(data, "seq") if data.draw(st.booleans()) else \
            data.draw(st.sampled_from(sorted(live) or [0]))
        pos = live.get(seq, 0)
        ends = st.sampled_from([-1, 0, pos, pos + 1]) | st.integers(-1, 10)
        p0, p1 = data.draw(ends, label="p0"), data.draw(ends, label="p1")
        if data.draw(st.booleans(), label="add"):
            amount = data.draw(st.integers(-pos, 6) | st.integers(-pos - 3, 3), label="shift")
            self.both(lambda impl, c: c.seq_add(seq, p0, p1, amount), f"seq_add({seq}, {p0}, {p1}, {amount})")
        else:
            d = data.draw(st.integers(1, 4) | st.integers(-1, 4), label="d")
            self.both(lambda impl, c: c.seq_div(seq, p0, p1, d), f"seq_div({seq}, {p0}, {p1}, {d})")

    @rule(data=st.data())
    def clear(self, data):
        if data.draw(st.integers(0, 4), label="clear gate"):
            return  # rarely, so the machine can build deep states
        self.both(lambda impl, c: c.clear(), "clear()")

    @rule(data=st.data())
    def queries(self, data):
        for seq in data.draw(st.lists(st.integers(-2, self.size + 1), max_size=4), label="queried"):
            self.both(lambda impl, c: c.seq_pos_min(seq), f"seq_pos_min({seq})")
            self.both(lambda impl, c: c.seq_pos_max(seq), f"seq_pos_max({seq})")
        states = [cache.init_full() for _, cache in self.pairs]
        assert [(s.head, s.n_kv, int(s.status)) for s in states] == [(0, self.size, 0)] * 2

    # -- rules: invalid operations ---------------------------------------------------

    @rule(data=st.data())
    def invalid(self, data):
        live = self.live()
        free = [s for s in range(self.size) if s not in live]
        size = self.size
        kinds = ["seq id out of range", "negative pos", "gap", "bad n_ubatch", "seq_div d <= 0",
                 "seq id out of range for seq_keep/add/div", "malformed batch", "cell index",
                 "repeated pos"]
        if live:
            kinds += ["not continuing", "seq_add below 0"]
            if free:
                kinds += ["shared token jumps"]
        kind = data.draw(st.sampled_from(kinds), label="invalid kind")
        event(f"invalid: {kind}")
        new = data.draw(st.sampled_from(free), label="new seq") if free else None
        some = data.draw(st.sampled_from(sorted(live)), label="live seq") if live else None
        bad_seq = data.draw(st.sampled_from([size, size + 3, -1, -2]), label="bad seq id")
        options = self.draw_options(data)
        if kind == "seq id out of range":
            owner_first = data.draw(st.booleans())
            ids = [bad_seq] if owner_first or new is None else [new, bad_seq]
            self.run_batch(data, {"token": [1], "pos": [0], "seq_id": [ids]}, options, expect="raise")
        elif kind == "negative pos":
            s = new if new is not None else some
            self.run_batch(data, {"token": [1], "pos": [-1 - data.draw(st.integers(0, 3))],
                                  "seq_id": [s]}, options, expect="raise")
        elif kind == "gap":
            s = new if new is not None else some
            start = live.get(s, -1) + 1
            gap = data.draw(st.integers(2, 4))
            self.run_batch(data, {"token": [1, 2], "pos": [start, start + gap], "seq_id": [s, s]},
                           options, expect="raise")
        elif kind == "repeated pos":
            # a pos listed twice for one sequence: SPEC checks positions "as a set"; both
            # implementations must simply agree
            s = new if new is not None else some
            start = live.get(s, -1) + 1
            self.run_batch(data, {"token": [1, 2], "pos": [start, start], "seq_id": [s, s]}, options)
        elif kind == "not continuing":
            p = live[some]
            wrong = data.draw(st.sampled_from([p, p + 2, p + 5, 0] if p > 0 else [p, p + 2, p + 5]))
            self.run_batch(data, {"token": [1], "pos": [wrong], "seq_id": [some]}, options, expect="raise")
        elif kind == "shared token jumps":
            # own token at p+1, shared (owner some or new) at p+2: the shared group goes first
            p = live[some]
            ids = data.draw(st.permutations([some, new]))
            self.run_batch(data, {"token": [1, 2], "pos": [p + 1, p + 2], "seq_id": [[some], list(ids)]},
                           options, expect="raise")
        elif kind == "bad n_ubatch":
            options["n_ubatch"] = data.draw(st.sampled_from([0, -1, -512, 1.5, True, "4", None]))
            self.run_batch(data, {"token": [1]}, options, expect="raise")
        elif kind == "malformed batch":
            kwargs = data.draw(st.sampled_from([
                {"token": []},
                {"token": [1, 2], "pos": [0]},
                {"token": [1], "seq_id": [[0, 0]]},
                {"token": [1, 2], "seq_id": [[0], []]},
                {"token": [1], "logits": [1, 1]},
                {"token": [0.5]},
                {"embd": np.zeros((1, 2, 2))},
                {},
            ]))
            self.run_batch(data, kwargs, options, expect="raise")
        elif kind == "seq_div d <= 0":
            s = some if some is not None else 0
            d = data.draw(st.integers(-3, 0))
            outcomes = self.both(lambda impl, c: c.seq_div(s, -1, -1, d), f"seq_div({s}, -1, -1, {d})")
            assert outcomes[0][0] == "raise"
        elif kind == "seq_add below 0":
            p = live[some]
            amount = -p - data.draw(st.integers(1, 3))
            outcomes = self.both(lambda impl, c: c.seq_add(some, -1, -1, amount), f"seq_add({some}, {amount})")
            assert outcomes[0][0] == "raise"
        elif kind == "seq id out of range for seq_keep/add/div":
            op = data.draw(st.sampled_from(["keep", "add", "div"]))
            fn = {"keep": lambda impl, c: c.seq_keep(bad_seq),
                  "add": lambda impl, c: c.seq_add(bad_seq, -1, -1, 1),
                  "div": lambda impl, c: c.seq_div(bad_seq, -1, -1, 2)}[op]
            outcomes = self.both(fn, f"seq_{op}({bad_seq})")
            assert outcomes[0][0] == "raise" and isinstance(outcomes[0][1], IndexError)
        elif kind == "cell index":
            outcomes = self.both(lambda impl, c: c.cell(bad_seq), f"cell({bad_seq})")
            assert outcomes[0][0] == "raise" and isinstance(outcomes[0][1], IndexError)

    # -- the comparison ------------------------------------------------------------------

    @invariant()
    def caches_agree(self):
        if not hasattr(self, "core"):
            return
        self.compare_caches("after the rule")
        self.core.check()
        self.ref.check()


CoreMatchesReference.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
TestCoreMatchesReference = CoreMatchesReference.TestCase
