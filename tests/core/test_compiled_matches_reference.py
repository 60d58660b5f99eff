"""Model-based test: the compiled engine against the pure-Python reference engine.

A hypothesis ``RuleBasedStateMachine`` builds one cache on each engine
with the same random shape and applies the same random operations to both:
prompts, decode steps, shared prompts, forks, removals, seq_keep, seq_add /
seq_div, clear, init_full, invalid operations and state serialisation (writes,
sequence reads, whole-cache round trips and corrupted blobs).  After every
applied ubatch it compares the ubatch, the copy plan, the cells and every state
byte, then writes the same deterministic values into the group rows of both
caches (standing in for the model's forward pass); after every rule the
invariant compares the whole cache and runs both ``check()``s.

Operations are generated from the live sequences of the reference cache, so
most of them are valid and the machine gets deep into interesting cell tables
(shared cells, wrap-around, gathers) instead of bouncing off input checks.

Both caches are the same facade, so every outcome must match exactly: the same
return values, the same exception class with the same message.
"""

from __future__ import annotations

import os

import io
import struct

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, event, note, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import recurrent_cache
from variants import package_on
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


# -- state blobs (SPEC §5), built here independently of both implementations ----------

GGML_TYPE = {"f32": 0, "f16": 1, "bf16": 30}
READ_FORMS = st.sampled_from(["bytes", "bytearray", "memoryview", "numpy", "file"])


def expected_blob(cache, seq):
    """SPEC §5's layout of ``state_write(seq)``, from ``cell()`` and the state rows."""
    cells = [cache.cell(c) for c in range(cache.size)]
    chosen = [c for c, (_, _, _, ids) in enumerate(cells) if (ids if seq == -1 else seq in ids)]
    out = [struct.pack("<I", len(chosen))]
    for c in chosen:
        ids = sorted(int(s) for s in cells[c][3]) if seq == -1 else []
        out.append(struct.pack(f"<iI{len(ids)}i", int(cells[c][0]), len(ids), *ids))
    out.append(struct.pack("<II", 0, cache.n_layer))
    for tensors, dtype in ((cache.r, cache.dtype_r), (cache.s, cache.dtype_s)):
        for tensor in tensors:
            rows = np.ascontiguousarray(tensor)
            out.append(struct.pack("<iQ", GGML_TYPE[dtype], rows.shape[1] * rows.itemsize))
            out.extend(rows[c].tobytes() for c in chosen)
    return b"".join(out)


def blob_fields(blob):
    """The fields of a well-formed blob, in order: (name, start, end) byte ranges."""
    (count,) = struct.unpack_from("<I", blob, 0)
    fields = [("cell_count", 0, 4)]
    at = 4
    for _ in range(count):
        (n_seq_id,) = struct.unpack_from("<I", blob, at + 4)
        fields += [("pos", at, at + 4), ("n_seq_id", at + 4, at + 8)]
        if n_seq_id:
            fields.append(("seq_ids", at + 8, at + 8 + 4 * n_seq_id))
        at += 8 + 4 * n_seq_id
    fields.append(("data header", at, at + 8))
    at += 8
    while at < len(blob):
        (row_bytes,) = struct.unpack_from("<Q", blob, at + 4)
        fields.append(("tensor header", at, at + 12))
        at += 12
        if count * row_bytes:
            fields.append(("rows", at, at + count * row_bytes))
        at += count * row_bytes
    assert at == len(blob), (at, len(blob))
    return fields


def read_as(cache, blob, seq, form):
    """``state_read`` of ``blob`` handed over as ``form`` (``state_read_from`` for "file")."""
    if form == "file":
        file = io.BytesIO(b"skip" + bytes(blob))
        file.seek(4)  # state_read_from reads from the file's position to its end
        return cache.state_read_from(file, seq)
    data = {"bytes": lambda: bytes(blob), "bytearray": lambda: bytearray(blob),
            "memoryview": lambda: memoryview(bytes(blob)),
            "numpy": lambda: np.frombuffer(bytes(blob), dtype=np.uint8)}[form]()
    return cache.state_read(data, seq)


def row_bytes_of(snap, key, il, c, size):
    """Row ``c`` of layer ``il`` of tensor ``key`` ("r" / "s") in a ``snapshot``."""
    whole = snap[key][il]
    n = len(whole) // size
    return whole[c * n:(c + 1) * n]


class CoreMatchesReference(RuleBasedStateMachine):
    # -- setup -------------------------------------------------------------------

    @initialize(size=SIZES, n_layer=st.integers(0, 2), n_embd_r=st.integers(1, 4),
                n_embd_s=st.integers(0, 4), dtype_r=DTYPES, dtype_s=DTYPES, data=st.data())
    def build(self, size, n_layer, n_embd_r, n_embd_s, dtype_r, dtype_s, data):
        kwargs = dict(n_layer=n_layer, n_embd_r=n_embd_r, n_embd_s=n_embd_s,
                      dtype_r=dtype_r, dtype_s=dtype_s,
                      n_rollback=data.draw(st.sampled_from([0, 1, 3, 4]), label="n_rollback"))
        if data.draw(st.booleans(), label="explicit size"):
            kwargs.update(n_seq_max=data.draw(st.integers(0, size), label="n_seq_max"), size=size)
        else:
            kwargs.update(n_seq_max=size)  # size defaults to max(1, n_seq_max)
        # the compiled engine against the reference engine, whatever RECURRENT_CACHE_IMPL says
        compiled, reference = package_on("compiled"), package_on("reference")
        self.core = compiled.RecurrentCache(**kwargs)
        self.ref = reference.RecurrentCache(**kwargs)
        self.pairs = ((compiled, self.core), (reference, self.ref))
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
            assert type(a) is type(b) and str(a) == str(b), f"{what}: core {a!r} vs reference {b!r}"
            for builtin in BUILTINS:
                assert isinstance(a, builtin) == isinstance(b, builtin), f"{what}: {a!r} vs {b!r}"
            assert isinstance(a, recurrent_cache.RecurrentCacheError), f"{what}: core raised {a!r}"
        elif not isinstance(a, recurrent_cache.MemoryState):
            assert a == b, f"{what}: core returned {a!r}, reference {b!r}"

    def compare_caches(self, what):
        reach = [[cache.seq_rollback_min(seq) for seq in range(self.size)] for cache in (self.core, self.ref)]
        assert reach[0] == reach[1], f"{what}: seq_rollback_min\n core      {reach[0]}\n reference {reach[1]}"
        (tags, history), (ref_tags, ref_history) = self.core.memory_core.history(), self.ref.memory_core.history()
        assert tags.tobytes() == ref_tags.tobytes(), f"{what}: history tags"
        for k, (x, y) in enumerate(zip(history, ref_history)):
            held = tags > 0
            assert x[held].tobytes() == y[held].tobytes(), f"{what}: held history states of tensor {k}"
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
        if sb.status != recurrent_cache.MemoryStatus.SUCCESS:
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
        # ... and, with n_rollback > 0, the states after its earlier tokens into the step arrays
        for views, cache in ((sa, self.core), (sb, self.ref)):
            for il in range(cache.n_layer):
                r_steps, s_steps = views.r_steps(il), views.s_steps(il)
                assert r_steps.shape[:2] == (n_seqs, min(cache.n_rollback, ua["n_seq_tokens"] - 1))
                for s in range(n_seqs):
                    for j in range(r_steps.shape[1]):
                        store(r_steps[s, j], formula(self.step, s, il, 2 + j, cache.n_embd_r))
                        store(s_steps[s, j], formula(self.step, s, il, 9 + j, cache.n_embd_s))
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
    def roll_back(self, data):
        """seq_rm(seq, p0, -1) of a live sequence: a rollback where its history reaches (SPEC §7)."""
        live = self.live()
        if not live:
            return
        seq = data.draw(st.sampled_from(sorted(live)), label="seq")
        pos = live[seq]
        p0 = data.draw(st.integers(max(1, pos - 3), pos + 1) if pos >= 1 else st.just(1), label="p0")
        p1 = data.draw(st.sampled_from([-1, pos + 1, pos + 5]), label="p1")
        reach = self.ref.seq_rollback_min(seq)
        outcomes = self.both(lambda impl, c: c.seq_rm(seq, p0, p1), f"seq_rm({seq}, {p0}, {p1}) [rollback]")
        if outcomes[0] == ("ok", True) and 0 < p0 <= pos:
            event("rolled back")
            assert reach >= 0 and p0 - 1 >= reach and self.ref.seq_pos_max(seq) == p0 - 1
        elif 0 < p0 <= pos:
            event("rollback refused")

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
            self.both(lambda impl, c, seq=seq: c.seq_pos_min(seq), f"seq_pos_min({seq})")
            self.both(lambda impl, c, seq=seq: c.seq_pos_max(seq), f"seq_pos_max({seq})")
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

    # -- rules: state serialisation (SPEC §5) --------------------------------------------

    def draw_state_seq(self, data, label, whole=True, bad=False):
        """("whole", -1), ("live", s), ("absent", s) or, with ``bad``, ("out of range", s)."""
        live = sorted(self.live())
        absent = [s for s in range(self.size) if s not in live]
        kinds = (["whole"] if whole else []) + (["live"] * 2 if live else []) + \
            (["absent"] if absent else []) + (["out of range"] if bad else [])
        kind = data.draw(st.sampled_from(kinds), label=f"{label} kind")
        if kind == "whole":
            return kind, -1
        choices = {"live": live, "absent": absent,
                   "out of range": [-2, -5, self.size, self.size + 2]}[kind]
        return kind, data.draw(st.sampled_from(choices), label=label)

    def some_cells(self, data):
        """Mostly run a batch first when the cache is empty: a blob of no cells tests little."""
        if not self.ref.used and data.draw(st.integers(0, 3), label="fill gate"):
            self.prompts_only(data)

    def write_both(self, seq):
        """``state_write(seq)`` of both caches, which must be the same bytes; returns them."""
        a, b = self.core.state_write(seq), self.ref.state_write(seq)
        assert type(a) is bytes and type(b) is bytes, (type(a), type(b))
        assert a == b, f"state_write({seq}): the blobs differ\n core      {a.hex()}\n reference {b.hex()}"
        return b

    @rule(data=st.data())
    def write_state(self, data):
        """state_write / state_size / state_write_into of the whole cache or one sequence."""
        kind, seq = self.draw_state_seq(data, "written seq", bad=True)
        event(f"state_write: {kind}")
        outcomes = self.both(lambda impl, c: c.state_write(seq), f"state_write({seq})")
        if kind == "out of range":
            assert outcomes[0][0] == "raise" and isinstance(outcomes[0][1], IndexError), outcomes[0]
            for op in ("state_size", "state_write_into"):
                args = (seq,) if op == "state_size" else (bytearray(1 << 12), seq)
                outcomes = self.both(lambda impl, c, op=op, args=args: getattr(c, op)(*args),
                                     f"{op}({seq})")
                assert outcomes[0][0] == "raise" and isinstance(outcomes[0][1], IndexError), outcomes[0]
            return
        assert outcomes[0][0] == "ok", outcomes   # same_outcome has compared the bytes
        blob = outcomes[1][1]
        assert type(outcomes[0][1]) is bytes and type(blob) is bytes
        assert blob == expected_blob(self.ref, seq), f"state_write({seq}) is not SPEC §5's layout"
        (count,) = struct.unpack_from("<I", blob, 0)
        assert count == (self.ref.used if seq == -1 else int(kind == "live")), count
        spare = data.draw(st.integers(0, 8), label="spare bytes")
        for name, (_, cache) in zip(("core", "reference"), self.pairs):
            assert cache.state_size(seq) == len(blob), f"{name}: state_size({seq}) != len(blob)"
            target = bytearray(b"\xa5" * (len(blob) + spare))
            n = cache.state_write_into(target, seq)
            assert n == len(blob), f"{name}: state_write_into({seq}) returned {n}, blob has {len(blob)}"
            assert bytes(target[:n]) == blob, f"{name}: state_write_into({seq}) wrote other bytes"
            assert target[n:] == b"\xa5" * spare, f"{name}: state_write_into({seq}) wrote past the blob"

    def rows_of_cell(self, cache, c):
        """Every state row of cell ``c``: r of each layer, then s."""
        return [np.ascontiguousarray(t[c]).tobytes() for t in list(cache.r) + list(cache.s)]

    @rule(data=st.data())
    def read_sequence_blob(self, data):
        """A blob of one sequence (live or absent) read into another id (new or live) or itself;
        sometimes a whole-cache blob read as a sequence (the two must simply agree)."""
        self.some_cells(data)
        live = self.live()
        free = [s for s in range(self.size) if s not in live]
        if data.draw(st.integers(0, 5), label="whole-cache blob gate") == 0:
            src_kind, src = "whole", -1
        else:
            src_kind, src = self.draw_state_seq(data, "source seq", whole=False)
        dst_kinds = ["same"] * (src >= 0) + ["live"] * bool(live) + ["new"] * bool(free)
        dst_kind = data.draw(st.sampled_from(dst_kinds), label="target kind")
        dst = src if dst_kind == "same" else \
            data.draw(st.sampled_from(sorted(live) if dst_kind == "live" else free), label="target seq")
        form = data.draw(READ_FORMS, label="read form")
        blob = self.write_both(src)
        src_cell = self.ref.cell(src)[2] if src >= 0 else -1   # the tail: the cell holding src
        saved = self.rows_of_cell(self.ref, src_cell) if src_cell >= 0 else None
        outcomes = self.both(lambda impl, c: read_as(c, blob, dst, form),
                             f"state_read(<blob of {src}>, {dst}) as {form}")
        event(f"state_read seq: {src_kind} -> {dst_kind}: {outcomes[0][0]}")
        if src_kind == "whole":
            return
        assert outcomes[0] == ("ok", len(blob)), f"state_read(<blob of {src}>, {dst}): {outcomes[0]}"
        after = self.live()
        for s, p in live.items():   # the other sequences keep their positions
            if s != dst:
                assert after.get(s) == p, f"state_read into {dst} moved seq {s}: {p} -> {after.get(s)}"
        if saved is None:
            assert dst not in after, f"an empty blob read into {dst} left it live"
            return
        assert after.get(dst) == live[src], f"pos of {dst}: {after.get(dst)}, blob has {live[src]}"
        for name, (_, cache) in zip(("core", "reference"), self.pairs):
            cell = cache.cell(dst)[2]
            pos, cell_src, _, ids = normal_cell(cache.cell(cell))
            assert (pos, cell_src, ids) == (live[src], cell, (dst,)), f"{name}: cell {cell} is {cache.cell(cell)}"
            assert self.rows_of_cell(cache, cell) == saved, f"{name}: rows of the read sequence"

    @rule(data=st.data())
    def whole_cache_round_trip(self, data):
        """state_write(-1), change the cache, state_read the blob back: the state before,
        compacted to cells 0..used-1 with src = i and head = 0 (SPEC §5)."""
        self.some_cells(data)
        before = snapshot(self.ref)
        blob = self.write_both(-1)
        live = sorted(self.live())
        mutations = ["batch", "clear"] + ["seq_rm", "finish_oldest", "decode", "fork", "shift",
                                          "sequence read"] * bool(live)
        mutation = data.draw(st.sampled_from(mutations), label="mutation")
        seq = data.draw(st.sampled_from(live), label="mutated seq") if live else None
        other = data.draw(st.integers(0, self.size - 1), label="other seq")
        if mutation == "seq_rm":
            self.both(lambda impl, c: c.seq_rm(seq, -1, -1), f"seq_rm({seq}, -1, -1)")
        elif mutation == "finish_oldest":
            self.finish_oldest(data)
        elif mutation == "decode":
            self.decode_every_sequence(data)
        elif mutation == "batch":
            self.continuous_batch(data)
        elif mutation == "fork":
            self.both(lambda impl, c: c.seq_cp(seq, other, -1, -1), f"seq_cp({seq}, {other})")
        elif mutation == "shift":
            self.both(lambda impl, c: c.seq_add(seq, -1, -1, 1 + other), f"seq_add({seq}, {1 + other})")
        elif mutation == "sequence read":
            part = self.write_both(seq)
            self.both(lambda impl, c: c.state_read(part, other), f"state_read(<blob of {seq}>, {other})")
        else:
            self.both(lambda impl, c: c.clear(), "clear()")
        mutated = snapshot(self.ref)
        assert snapshot(self.core) == mutated, f"after the mutation {mutation}: the caches differ"
        form = data.draw(READ_FORMS, label="read form")
        outcomes = self.both(lambda impl, c: read_as(c, blob, -1, form), f"state_read(<whole cache>) as {form}")
        assert outcomes[0] == ("ok", len(blob)), f"state_read(<whole cache>): {outcomes[0]}"
        kept = [c for c, cell in enumerate(before["cells"]) if cell[3]]
        event(f"round trip after {mutation}: {'changed' if mutated != before else 'unchanged'}, "
              + ("no cells" if not kept else "cells 0..k" if kept[-1] == len(kept) - 1 else "cells with holes"))
        tail = {s: i for i, c in enumerate(kept) for s in before["cells"][c][3]}
        expected = [(before["cells"][kept[i]][0], i, tail.get(i, -1), before["cells"][kept[i]][3])
                    if i < len(kept) else (-1, -1, tail.get(i, -1), ()) for i in range(self.size)]
        for name, (_, cache) in zip(("core", "reference"), self.pairs):
            snap = snapshot(cache)
            assert snap["cells"] == expected, f"{name}: cells\n got      {snap['cells']}\n expected {expected}"
            assert (snap["head"], snap["used"]) == (0, len(kept)), \
                f"{name}: head/used {snap['head']}, {snap['used']}"
            for key in ("r", "s"):
                for il in range(cache.n_layer):
                    row = len(before[key][il]) // self.size
                    want = b"".join(before[key][il][c * row:(c + 1) * row] for c in kept)
                    want += bytes(row * (self.size - len(kept)))   # the other rows are cleared
                    assert snap[key][il] == want, f"{name}: {key}[{il}] rows after the round trip"
        assert self.write_both(-1) == blob, "state_write(-1) after the round trip differs from the blob"

    @rule(data=st.data())
    def read_corrupted_blob(self, data):
        """A blob truncated, with one byte flipped, or with trailing bytes: both reject it
        alike, changing nothing, or both accept it (a flip in row data, a pos, a seq id)."""
        self.some_cells(data)
        kind, seq = self.draw_state_seq(data, "written seq")
        blob = self.write_both(seq)
        if data.draw(st.integers(0, 7), label="cross-kind gate") == 0:
            target = data.draw(st.integers(0, self.size - 1), label="target") if seq == -1 else -1
        elif seq == -1:
            target = -1
        else:
            target = data.draw(st.sampled_from([seq, seq, *range(self.size)]), label="target")
        matching = (seq == -1) == (target == -1)
        corruption = data.draw(st.sampled_from(["truncate", "flip", "append"]), label="corruption")
        if corruption == "append":
            where = "end"
            bad = blob + data.draw(st.binary(min_size=1, max_size=9), label="trailing bytes")
        else:
            # a field first, then a byte in it: row data and seq ids are rare among uniform offsets
            fields = blob_fields(blob)
            names = sorted({name for name, _, _ in fields})
            where = data.draw(st.sampled_from(names), label="field")
            start, end = data.draw(st.sampled_from([(a, b) for n, a, b in fields if n == where]),
                                   label="which one")
            at = data.draw(st.integers(start, end - 1), label="byte")
            if corruption == "truncate":
                bad = blob[:at]
            else:
                bad = blob[:at] + bytes([blob[at] ^ data.draw(st.integers(1, 255), label="xor")]) + blob[at + 1:]
        form = data.draw(READ_FORMS, label="read form")
        what = f"state_read(<{kind} blob, {corruption} in {where}>, {target}) as {form}"
        before = [snapshot(cache) for _, cache in self.pairs]
        outcomes = [call(lambda cache=cache: read_as(cache, bad, target, form)) for _, cache in self.pairs]
        self.same_outcome(outcomes, what)   # same class (and the same built-in bases)
        status, result = outcomes[0]
        event(f"corrupt {corruption} in {where}: {'rejected' if status == 'raise' else 'accepted'}"
              + ("" if matching else " (cross-kind)"))
        if status == "raise":
            assert isinstance(result, recurrent_cache.StateError), f"{what}: {result!r}"
            assert str(result) == str(outcomes[1][1]), f"{what}: messages differ: {result} / {outcomes[1][1]}"
            for name, snap, (_, cache) in zip(("core", "reference"), before, self.pairs):
                assert snapshot(cache) == snap, f"{what}: the {name} changed the cache before raising"
        else:
            assert result == len(bad), f"{what} returned {result}"
        if corruption != "flip":
            assert status == "raise", f"{what} was accepted"
        elif where in ("data header", "tensor header"):
            assert status == "raise", f"{what} was accepted"
        elif where == "rows" and matching:
            assert status == "ok", f"{what} was rejected: {result}"

    # -- the comparison ------------------------------------------------------------------

    @invariant()
    def caches_agree(self):
        if not hasattr(self, "core"):
            return
        self.compare_caches("after the rule")
        self.core.check()
        self.ref.check()


# RECURRENT_CACHE_SM_EXAMPLES=3000 for a long soak; CI keeps the suite fast
CoreMatchesReference.TestCase.settings = settings(
    max_examples=int(os.environ.get("RECURRENT_CACHE_SM_EXAMPLES", "200")), stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
TestCoreMatchesReference = CoreMatchesReference.TestCase
