"""Differential fuzzing of the whole Python API with hostile arguments: compiled vs reference engine.

Every step calls one public entry point — the sequence operations, ``init_batch``
with hostile batches and flags, ``apply`` / ``next`` / ``r`` / ``s`` / ``r_steps``
in and out of order, ``state_write`` / ``state_read``, ``cell``, the
``cell_table`` handle, ``PrefixCache`` — with arguments drawn from a pool of
wrong types, extreme and boundary values, on a cache of each engine in the same
state, and checks:

* nothing crashes the interpreter or raises anything but a ``RecurrentCacheError``
  (``MemoryError`` aside) — the C-level handle, driven on a cache of its own, may
  also raise the conversion errors of its C argument types;
* both engines give the same outcome: the same return value, or the same
  exception class with the same message;
* a rejected call leaves both caches bit-identical (cells, head, used, every
  tensor byte), and ``check()`` holds after every step.

    python bench/fuzz/fuzz_api.py --steps 200000 [--seed 1]

It prints the number of calls per entry point and per outcome; a failure stops
the run with a non-zero exit and the step that failed.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter

import numpy as np

import recurrent_cache as rc

INT_EDGES = [-2**63, -2**31 - 1, -2**31, -3, -2, -1, 0, 1, 2, 3, 5, 2**31 - 2, 2**31 - 1, 2**31, 2**63]
ODD_VALUES = [None, True, False, 1.5, "1", b"\x00", [], [1], (0,), {0: 1}, np.int64(1), np.float32(2.0),
              np.array([1, 2]), np.ma.masked_array([1], mask=[1]), object()]


def hostile(rng: random.Random, size: int) -> object:
    roll = rng.random()
    if roll < 0.55:
        return rng.randrange(-1, size + 1)
    if roll < 0.85:
        return rng.choice(INT_EDGES + [size - 1, size, size + 1])
    return rng.choice(ODD_VALUES)


def snapshot(cache: rc.RecurrentCache) -> tuple:
    cells = tuple(cache.cell(i) for i in range(cache.size))
    rows = tuple(t.tobytes() for t in cache.r + cache.s)
    tags = cache.memory_core.history()[0]   # (files the last ubatch's step states, as the next change would)
    return cells, cache.head, cache.used, cache.n, rows, tags.tobytes(), \
        tuple(cache.seq_rollback_min(s) for s in range(cache.size))


def outcome(fn) -> tuple:
    try:
        result = fn()
    except rc.RecurrentCacheError as exc:
        return ("raise", type(exc).__name__, str(exc))
    except MemoryError as exc:
        return ("raise", "MemoryError", str(exc))
    if isinstance(result, np.ndarray):
        return ("ok", result.dtype.str, result.shape, result.tobytes())
    if isinstance(result, (rc.MemoryState, rc.PrefixCache)):
        return ("ok", type(result).__name__)
    return ("ok", result)


class Pair:
    """One cache per engine, in the same state, and the states / prefix caches made from them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        size = rng.choice([1, 2, 3, 5, 8])
        kwargs = dict(n_layer=rng.choice([0, 1, 2]), n_embd_r=rng.choice([1, 3]), n_embd_s=rng.choice([1, 2]),
                      n_seq_max=size, dtype_r=rng.choice(["f32", "f16", "bf16"]), dtype_s="f32",
                      n_rollback=rng.choice([0, 0, 2]))
        self.caches = [rc.RecurrentCache(**kwargs, engine=e) for e in ("compiled", "reference")]
        self.states: list | None = None
        self.size = size
        self.handle_cache = rc.RecurrentCache(**kwargs)

    def both(self, name: str, call, counts: Counter) -> tuple:
        before = [snapshot(c) for c in self.caches]
        results = [outcome(lambda c=c, i=i: call(c, i)) for i, c in enumerate(self.caches)]
        counts[(name, results[0][0])] += 1
        if results[0] != results[1]:
            raise AssertionError(f"{name}: engines disagree\n compiled:  {results[0]!r:.600}\n"
                                 f" reference: {results[1]!r:.600}")
        if results[0][0] == "raise":
            for b, c in zip(before, self.caches):
                if snapshot(c) != b:
                    raise AssertionError(f"{name}: a rejected call changed the {c.engine} cache: {results[0]}")
        for c in self.caches:
            c.check()
        after = [snapshot(c) for c in self.caches]
        if after[0][:4] != after[1][:4] or after[0][5:] != after[1][5:]:
            which = [k for k in range(len(after[0])) if k != 4 and after[0][k] != after[1][k]]
            raise AssertionError(f"{name}: the engines' caches differ after {results[0]!r:.300} in parts {which}: "
                                 f"{[after[0][k] for k in which]!r:.400} vs {[after[1][k] for k in which]!r:.400}")
        return results[0]

    # -- the entry points ------------------------------------------------------------------

    def step(self, counts: Counter) -> None:
        rng, size = self.rng, self.size
        h = lambda: hostile(rng, size)  # noqa: E731
        op = rng.choice(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "queries", "cell", "batch",
                         "batch", "batch", "state", "state_io", "place", "clear", "handle"])
        if op == "seq_rm":
            a = (h(), h(), h())
            self.both(op, lambda c, i: c.seq_rm(*a), counts)
        elif op == "seq_cp":
            a = (h(), h(), h(), h())
            self.both(op, lambda c, i: c.seq_cp(*a), counts)
        elif op == "seq_keep":
            a = h()
            self.both(op, lambda c, i: c.seq_keep(a), counts)
        elif op in ("seq_add", "seq_div"):
            a = (h(), h(), h(), h())
            self.both(op, lambda c, i: getattr(c, op)(*a), counts)
        elif op == "queries":
            a = h()
            name = rng.choice(["seq_pos_min", "seq_pos_max", "seq_rollback_min"])
            self.both(name, lambda c, i: getattr(c, name)(a), counts)
        elif op == "cell":
            a = h()
            self.both(op, lambda c, i: c.cell(a), counts)
        elif op == "batch":
            self.batch(counts)
        elif op == "state":
            self.state_calls(counts)
        elif op == "state_io":
            a = h()
            if rng.random() < 0.7:
                blob = self.caches[0].state_write(rng.randrange(-1, size))
            else:
                blob = bytes(rng.randrange(40))
            if rng.random() < 0.5 and blob:
                blob = bytearray(blob)
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
            self.both("state_read", lambda c, i: c.state_read(bytes(blob), a), counts)
            self.both("state_write", lambda c, i: c.state_write(a), counts)
        elif op == "place":
            a, b = h(), h()
            self.both("seq_restore", lambda c, i: c.seq_restore(a, b, [t[0] for t in c.r], [t[0] for t in c.s]),
                      counts)
        elif op == "clear":
            if rng.random() < 0.1:
                self.both(op, lambda c, i: c.clear(), counts)
        else:
            # the compiled engine's C-level handle takes C types and no package checks: on a
            # third cache of its own (it changes cells behind the facade), it must not crash
            a = (h(), h(), h())
            name = rng.choice(["cell", "seq_rm", "seq_pos_max", "place", "rollback_min", "seq_keep"])
            n_args = {"cell": 1, "seq_rm": 3, "seq_pos_max": 1, "place": 2, "rollback_min": 1, "seq_keep": 1}[name]
            try:
                getattr(self.handle_cache.cell_table, name)(*a[:n_args])
            except Exception:  # noqa: BLE001 - conversion errors of C arguments; a crash is what counts
                pass
            counts[("cell_table." + name, "called")] += 1
            self.handle_cache.check()

    def batch(self, counts: Counter) -> None:
        rng, size = self.rng, self.size
        n = rng.randrange(1, 6)
        live = {s: self.caches[1].seq_pos_max(s) for s in range(size)}
        seq_id: object = [rng.randrange(size) for _ in range(n)]
        pos: object = None
        nexts = dict(live)
        positions = []
        for s in seq_id:
            nexts[s] += 1
            positions.append(nexts[s])
        pos = positions if rng.random() < 0.8 else None
        if rng.random() < 0.3:   # something hostile in it
            which = rng.choice(["seq_id", "pos", "token", "logits"])
            bad = hostile(rng, size) if rng.random() < 0.5 else [hostile(rng, size) for _ in range(n)]
            seq_id, pos = (bad, pos) if which == "seq_id" else (seq_id, bad) if which == "pos" else (seq_id, pos)
            token = bad if which == "token" else [1] * n
            logits = bad if which == "logits" else None
        else:
            token, logits = [1] * n, None
        flags = dict(n_ubatch=rng.choice([1, 2, 512, hostile(rng, size)]))
        if rng.random() < 0.2:
            flags[rng.choice(["embd_pooled", "logits_all"])] = hostile(rng, size)
        self.states = None

        def make(c, i):
            st = c.init_batch(rc.Batch(token=token, pos=pos, seq_id=seq_id, logits=logits), **flags)
            if i == 0:
                self.states = [st]
            else:
                self.states.append(st)
            return st
        self.both("init_batch", make, counts)

    def state_calls(self, counts: Counter) -> None:
        if not self.states or len(self.states) != 2:
            return
        rng = self.rng
        name = rng.choice(["apply", "apply", "next", "r", "s", "r_steps", "ubatch", "out_ids", "iterate"])
        if name in ("r", "s", "r_steps"):
            a = hostile(rng, 3)
            self.both("st." + name, lambda c, i: getattr(self.states[i], name)(a), counts)
        elif name == "ubatch":
            self.both("st.ubatch", lambda c, i: self.states[i].ubatch.pos, counts)
        elif name == "out_ids":
            self.both("st.out_ids", lambda c, i: self.states[i].out_ids, counts)
        elif name == "iterate":
            self.both("for ub in st", lambda c, i: [ub.pos.tolist() for ub in self.states[i]], counts)
        else:
            self.both("st." + name, lambda c, i: getattr(self.states[i], name)(), counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-per-cache", type=int, default=200)
    options = parser.parse_args()
    rng = random.Random(options.seed)
    counts: Counter = Counter()
    pair = Pair(rng)
    for step in range(options.steps):
        if step % options.steps_per_cache == 0:
            pair = Pair(rng)
        try:
            pair.step(counts)
        except AssertionError as exc:
            print(f"FAILED at step {step} (seed {options.seed}): {exc}")
            return 1
    surfaces: dict[str, Counter] = {}
    for (name, result), n in counts.items():
        surfaces.setdefault(name, Counter())[result] += n
    print(f"{options.steps} steps, seed {options.seed}: no crash, no disagreement, no rejected call changed a cache")
    for name in sorted(surfaces):
        print(f"  {name:24s} " + ", ".join(f"{k} {v}" for k, v in sorted(surfaces[name].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
